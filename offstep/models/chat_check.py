"""A model folder's chat template, rendered once under a time limit when its tokenizer loads.

A template is code (Jinja) that comes with the model: one with a huge loop would hang every prompt's
rendering, before anything says why. Rendering a short conversation as soon as the tokenizer is
loaded, in a thread given up on (and stopped) past ``TEMPLATE_TIMEOUT_S``, names the file instead.
The rows' own rendering is watched the same way (``offstep.data.render``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offstep.errors import ModelError
from offstep.usercode import TimeLimit, run_stoppable

TEMPLATE_TIMEOUT_S = 5.0  # a real template renders a few messages in milliseconds
PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2 + 2?"},
]


def template_source(folder: str | Path) -> str:
    """Which file of ``folder`` holds its chat template (for messages)."""
    folder = Path(folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return str(folder / name)
    config = folder / "tokenizer_config.json"
    try:
        if "chat_template" in json.loads(config.read_text()):
            return f"{config} (its chat_template)"
    except (OSError, ValueError, TypeError):
        pass
    return f"the tokenizer of {folder}"


def too_slow(source: str, what: str, limit_s: float) -> str:
    return (
        f"the chat template ({source}) did not finish rendering {what} within {limit_s:g} s: it loops too long "
        "(a huge or nested loop?). Fix: repair the template (render a short conversation with "
        "tokenizer.apply_chat_template to see), or use the chat_template.jinja of the model it came from"
    )


def check_chat_template(tokenizer: Any, folder: str | Path, limit_s: float = TEMPLATE_TIMEOUT_S) -> None:
    """Render a four-message conversation with ``tokenizer``'s chat template within ``limit_s``
    seconds, or raise :class:`ModelError` naming the template's file. A template that raises on it
    (one that allows no system message, say) is left to the rows, which say why."""
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        run_stoppable(
            lambda: tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False),
            limit_s,
            name="offstep-chat-template",
        )
    except TimeLimit:
        raise ModelError(too_slow(template_source(folder), "a four-message conversation", limit_s)) from None
    except Exception:  # noqa: BLE001 - see the docstring
        pass
