"""Chat-templating the prompt rows, under a time limit per row.

The tokenizer's chat template was rendered once when it loaded (``offstep.models.chat_check``),
but a template's loops may depend on the messages: the rows are rendered in a helper thread that is
given up on (and stopped) when one row takes longer than ``TEMPLATE_TIMEOUT_S``.
"""

from __future__ import annotations

from typing import Any

from offstep.config.choices import TOOL_AGENT
from offstep.data.images import with_image_parts
from offstep.errors import DatasetError
from offstep.models.chat_check import TEMPLATE_TIMEOUT_S, template_source, too_slow
from offstep.usercode import TimeLimit, run_stoppable


def render(tokenizer: Any, record: Any, tools: list[dict] | None = None) -> str:
    """One ``PromptRecord``'s messages through the chat template, with the generation prompt."""
    # A tool row's prompt carries the tools' schemas where the template renders them (Qwen2.5's
    # system prompt); a template without tool support ignores them, and the row's own messages
    # must describe the tools (the calculator task's system prompt does).
    kwargs = {"tools": tools} if tools and record.agent_name == TOOL_AGENT else {}
    messages = with_image_parts(record.messages) if getattr(record, "images", None) else record.messages
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:
        raise DatasetError(
            f"data_source {record.data_source!r} row {record.index}: the tokenizer's chat template "
            f"failed ({type(exc).__name__}: {exc}). Fix: use an instruct/chat tokenizer that has a "
            "chat_template, or set one on the tokenizer."
        ) from exc
    if not isinstance(text, str):
        raise DatasetError(
            f"data_source {record.data_source!r} row {record.index}: apply_chat_template returned "
            f"{type(text).__name__}, not str. Fix: use a tokenizer whose chat template renders text."
        )
    return text


def render_all(
    tokenizer: Any, records: list, tools: list[dict] | None = None, limit_s: float = TEMPLATE_TIMEOUT_S
) -> list[str]:
    """:func:`render` of every record; :class:`DatasetError` naming the row (and the template's
    file) that takes over ``limit_s`` seconds."""
    texts: list[str] = []

    def work() -> list[str]:
        for r in records:
            texts.append(render(tokenizer, r, tools))
        return texts

    try:
        return run_stoppable(work, limit_s, progress=texts.__len__, name="offstep-chat-template")
    except TimeLimit as stuck:
        record = records[stuck.progress]
        source = template_source(tokenizer.name_or_path) if getattr(tokenizer, "name_or_path", "") else "the tokenizer"
        raise DatasetError(
            f"data_source {record.data_source!r} row {record.index}: " + too_slow(source, "its prompt", limit_s)
        ) from None
