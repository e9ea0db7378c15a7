"""Prompt datasets: reading verl-format parquet / JSON-lines files and tokenizing prompts.

File formats
------------
``.parquet`` -- verl's row format, one row per prompt:

* ``data_source`` (str): selects the reward scorer (e.g. ``"openai/gsm8k"``).
* ``prompt`` (list of ``{"role", "content"}`` chat messages, or a plain string).
* ``ability`` (str, optional).
* ``reward_model`` (struct): ``{"style": "rule", "ground_truth": ...}``.
* ``extra_info`` (struct / dict, optional): passed through to the scorer; with a tool agent its
  ``tools_kwargs`` (``{tool name: {"create_kwargs": {...}}}``, verl's) are per-row tool arguments.
* ``images`` (optional, verl's multimodal layout; ``image_key``): one image per ``<image>`` in the
  prompt (``offstep.data.images``).
* ``agent_name`` (str, optional, verl's): ``single_turn_agent`` or ``tool_agent``, the loop that
  answers the row (``offstep.rollout.agents.agent_loop``); absent: ``rollout.agent.default_agent``.

``.jsonl`` / ``.json`` -- one JSON object per line with the same fields (a ``.json`` file holding a
single JSON array of such objects is accepted too). The ``prompt_key`` field holds either a list of
chat messages or a plain string; a string becomes one user message.

For both formats:

* the prompt column is ``prompt_key`` (default ``"prompt"``);
* the ground truth is ``reward_model["ground_truth"]``, or the ``answer_key`` column when one is
  given (then ``reward_model`` is not needed);
* ``data_source`` defaults to the file's stem (``"train"`` for ``/data/train.jsonl``) when the
  column is absent or a row's value is empty (null or ``""``); with the built-in scorers, which
  ``data_source`` picks, such a row is refused unless the stem names one (:func:`check_rule_ground_truths`);
* ``ability`` defaults to ``""`` and ``extra_info`` to ``{}``.

``PromptRecord.index`` is the row's 0-based position in the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from offstep.config.choices import AGENT_NAMES, OVERLONG_MODES, SINGLE_TURN, TOOL_AGENT, TRUNCATIONS
from offstep.data.images import DEFAULT_MAX_IMAGE_PIXELS, ImageSpec, check_image_model, encode_images, row_images
from offstep.data.plain import to_plain as _to_plain
from offstep.data.render import render_all
from offstep.data.row_limits import DEFAULT_MAX_ROWS, check_size, out_of_memory
from offstep.data.truncate import truncate_prompt
from offstep.errors import DatasetError

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".parquet", ".jsonl", ".json")
# The settings that messages name: offstep train's config keys; offstep eval passes its flags.
TRAIN_KEYS = {
    "files": "data.train_files / data.val_files",
    "prompt_key": "data.prompt_key",
    "answer_key": "data.answer_key",
    "max_prompt_length": "data.max_prompt_length",
    "tools": "rollout.agent.tools",
    "reward_path": "reward.custom_path",
    "max_rows": "data.max_rows",
}


@dataclass
class PromptRecord:
    """One prompt row, as plain Python values."""

    index: int
    data_source: str
    messages: list[dict]
    ground_truth: object
    ability: str = ""
    extra_info: dict = field(default_factory=dict)
    agent_name: str = SINGLE_TURN
    data_source_missing: bool = False  # the row had none: data_source is the file's stem
    images: list[bytes] = field(default_factory=list)  # its image files, one per <image> (offstep.data.images)


@dataclass
class EncodedPrompt:
    """A record with its chat-templated prompt token ids."""

    record: PromptRecord
    prompt_ids: list[int]
    images: tuple[bytes, ...] = ()  # its images fitted to the model's size (PNG); prompt_ids has their tokens


# --------------------------------------------------------------------------------------------------
# conversion helpers


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


# --------------------------------------------------------------------------------------------------
# reading rows


def _read_parquet(path: str) -> tuple[list[dict], list[str]]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except MemoryError:  # not the file's format: load_records says what to do
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise DatasetError(
            f"{path}: cannot read the parquet file ({type(exc).__name__}: {exc}). "
            "Fix: re-create the file (e.g. with `offstep` task generation or "
            "pandas.DataFrame.to_parquet) or point the data path at a valid parquet file."
        ) from exc
    columns = list(table.column_names)
    try:
        rows = table.to_pylist()
    except MemoryError:
        raise
    except Exception as exc:
        raise DatasetError(
            f"{path}: cannot convert the parquet rows to Python values "
            f"({type(exc).__name__}: {exc}). Fix: re-write the file with plain list/struct columns."
        ) from exc
    return rows, columns


def _read_json(path: str) -> tuple[list[dict], list[str]]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(
            f"{path}: cannot read the file as UTF-8 text ({type(exc).__name__}: {exc}). "
            "Fix: write the dataset as UTF-8 JSON lines (one JSON object per line)."
        ) from exc

    rows: list[Any] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        # a single JSON array of objects
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{path}: the file starts with '[' but is not a valid JSON array ({exc}). "
                "Fix: write one JSON object per line (JSON lines) or a valid JSON array."
            ) from exc
        rows = list(loaded)
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path}: line {lineno} is not valid JSON ({exc}). "
                    "Fix: each non-empty line must hold exactly one JSON object."
                ) from exc

    columns: list[str] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(
                f"{path}: row {i} is a JSON {type(row).__name__}, not an object. "
                "Fix: each row must be a JSON object such as "
                '{"prompt": [{"role": "user", "content": "..."}], '
                '"reward_model": {"ground_truth": "..."}}.'
            )
        for key in row:
            if key not in seen:
                seen.add(key)
                columns.append(key)
    return rows, columns


def _normalize_messages(path: str, row_index: int, prompt_key: str, value: Any, keys: dict = TRAIN_KEYS) -> list[dict]:
    value = _to_plain(value)
    example = '[{"role": "user", "content": "..."}]'
    if isinstance(value, str):
        if not value.strip():  # as empty as an empty list: the model would answer nothing
            what = "an empty string" if not value else f"only whitespace ({_short(value)})"
            raise DatasetError(
                f"{path}: row {row_index}: column '{prompt_key}' is {what}: there is no question to answer. "
                "Fix: write the prompt's text there, or drop the row."
            )
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{path}: row {row_index}: column '{prompt_key}' must be a non-empty list of chat "
            f"messages or a string, got {type(value).__name__} {_short(value)}. "
            f"Fix: store prompts as {example} or plain strings, or set {keys['prompt_key']} to the "
            "column that holds them."
        )
    messages: list[dict] = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DatasetError(
                f"{path}: row {row_index}: message {j} of '{prompt_key}' is a "
                f"{type(msg).__name__}, not a dict with 'role' and 'content'. "
                f"Fix: store prompts as {example}."
            )
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise DatasetError(
                f"{path}: row {row_index}: message {j} of '{prompt_key}' has no string 'role' "
                f"(keys: {sorted(msg)}). Fix: store prompts as {example}."
            )
        if not isinstance(content, str):
            raise DatasetError(
                f"{path}: row {row_index}: message {j} ({role}) of '{prompt_key}' has no string "
                f"'content' (got {type(content).__name__}). Fix: store prompts as {example}."
            )
        # keep other fields (e.g. "name") but drop the None padding that parquet structs add
        clean = {k: v for k, v in msg.items() if k in ("role", "content") or v is not None}
        messages.append(clean)
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(
            f"{path}: row {row_index}: every message of '{prompt_key}' has empty (or whitespace-only) "
            "content: there is no question to answer. Fix: write the prompt's text into its 'content', or drop the row."
        )
    return messages


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_records(
    path: str,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    default_agent: str = SINGLE_TURN,
    keys: dict = TRAIN_KEYS,
    max_rows: int = DEFAULT_MAX_ROWS,
    image_key: str = "images",
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> list[PromptRecord]:
    """Read a verl-format ``.parquet`` or a ``.jsonl``/``.json`` file into :class:`PromptRecord` s.

    See the module docstring for the expected fields. ``data_source`` defaults to the file's stem
    when absent. Raises :class:`DatasetError` for a missing, unsupported, unreadable or empty file,
    missing columns and malformed (or empty) prompts, and, before it is read, a file of more than
    ``max_rows`` rows (0: no limit) or more than memory holds; its messages name the settings in
    ``keys`` (``TRAIN_KEYS``'s names).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DatasetError(
            f"{path}: file not found. Fix: check {keys['files']}: give the path of a verl parquet or JSONL file."
        )
    if os.path.isdir(path):
        raise DatasetError(
            f"{path}: is a directory, not a dataset file. Fix: point the data path at a "
            f"{'/'.join(SUPPORTED_EXTENSIONS)} file."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise DatasetError(
            f"{path}: unsupported file extension '{ext or '(none)'}'. Fix: use one of "
            f"{', '.join(SUPPORTED_EXTENSIONS)} (verl-format parquet or JSON lines)."
        )

    size = check_size(path, ext, max_rows, keys)  # a 75 KB parquet file can hold 20 million rows
    try:
        rows, columns = _read_parquet(path) if ext == ".parquet" else _read_json(path)
    except MemoryError:
        raise out_of_memory(path, size, keys) from None

    if not rows:
        raise DatasetError(
            f"{path}: the dataset is empty (0 rows). Fix: point the data path at a file with at "
            "least one prompt, or regenerate it."
        )

    column_set = set(columns)
    if prompt_key not in column_set:
        raise DatasetError(
            f"{path}: missing prompt column '{prompt_key}'; the file has columns {columns}. "
            f"Fix: set {keys['prompt_key']} to the column that holds the prompts."
        )
    if answer_key is not None:
        if answer_key not in column_set:
            raise DatasetError(
                f"{path}: missing answer column '{answer_key}'; the file has columns {columns}. "
                f"Fix: set {keys['answer_key']} to the column that holds the ground truth, or unset it "
                "to use reward_model.ground_truth."
            )
    elif "reward_model" not in column_set:
        raise DatasetError(
            f"{path}: missing column 'reward_model' (with a 'ground_truth' field); the file has "
            f"columns {columns}. Fix: add reward_model={{'style': 'rule', 'ground_truth': ...}} "
            f"to every row, or set {keys['answer_key']} to the column that holds the ground truth."
        )

    stem = os.path.splitext(os.path.basename(path))[0]
    records: list[PromptRecord] = []
    for i, row in enumerate(rows):
        messages = _normalize_messages(path, i, prompt_key, row.get(prompt_key), keys)
        images = row_images(row, i, path, messages, image_key, max_image_pixels)

        if answer_key is not None:
            ground_truth = _to_plain(row.get(answer_key))
        else:
            reward_model = _to_plain(row.get("reward_model"))
            if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
                raise DatasetError(
                    f"{path}: row {i}: 'reward_model' must be a dict with a 'ground_truth' field, "
                    f"got {_short(reward_model)}. Fix: store reward_model={{'style': 'rule', "
                    f"'ground_truth': ...}}, or set {keys['answer_key']} to the column that holds the "
                    "ground truth."
                )
            ground_truth = reward_model["ground_truth"]

        data_source = row.get("data_source")
        source_missing = _is_missing(data_source) or data_source == ""
        data_source = stem if source_missing else str(data_source)

        ability = row.get("ability")
        ability = "" if _is_missing(ability) else str(ability)

        extra_info = _to_plain(row.get("extra_info"))
        if _is_missing(extra_info):
            extra_info = {}
        if not isinstance(extra_info, dict):
            raise DatasetError(
                f"{path}: row {i}: 'extra_info' must be a dict/struct, got "
                f"{type(extra_info).__name__} {_short(extra_info)}. Fix: store extra_info as a "
                "JSON object (or drop the column)."
            )

        agent_name = row.get("agent_name")
        agent_name = default_agent if _is_missing(agent_name) or agent_name == "" else str(agent_name)
        if agent_name not in AGENT_NAMES:
            raise DatasetError(
                f"{path}: row {i}: agent_name {agent_name!r} is not one of {list(AGENT_NAMES)}. Fix: use "
                f"{TOOL_AGENT} for rows answered with tools ({keys['tools']}), {SINGLE_TURN} (or no "
                "value) for plain ones."
            )

        records.append(
            PromptRecord(
                index=i,
                data_source=data_source,
                messages=messages,
                ground_truth=ground_truth,
                ability=ability,
                extra_info=extra_info,
                agent_name=agent_name,
                data_source_missing=source_missing,
                images=images,
            )
        )
    return records


def check_rule_ground_truths(records: list[PromptRecord], path: str, keys: dict = TRAIN_KEYS) -> None:
    """Refuse rows that the built-in rule scorers cannot score: a row without a data_source (which
    picks the scorer) in a file whose stem names no scorer, and ground truths they cannot compare
    with: they read the ground truth as one string or number, so a list, a dict, a bool or a missing
    value would score every response 0 without an error. (A custom reward function may take any
    data_source and ground truth.)"""
    from offstep.rewards.sources import DICT_TRUTH_SOURCES, builtin_names, builtin_scorer

    custom = (
        f"score with your own function: {keys['reward_path']}=FILE.py defining compute_score(data_source, "
        "solution_str, ground_truth, extra_info=None)"
    )
    unnamed = [r for r in records if r.data_source_missing and builtin_scorer(r.data_source) is None]
    if unnamed:
        first = unnamed[0]
        raise DatasetError(
            f"{path}: row {first.index} has no data_source ({len(unnamed)} of {len(records)} rows have none), and "
            f"the built-in scorers are picked by it (offstep would use the file's name {first.data_source!r}, "
            f"for which there is none). Fix: set data_source in every row to one of {builtin_names()}, "
            f"or {custom}."
        )

    def usable(truth: Any, source: str) -> bool:
        if source in DICT_TRUTH_SOURCES:  # Search-R1: {"target": an answer or a list of answers}
            target = truth.get("target") if isinstance(truth, dict) else None
            return isinstance(target, str) or (isinstance(target, list) and all(isinstance(t, str) for t in target))
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
            return False
        return not (isinstance(truth, float) and not math.isfinite(truth))

    bad = [r for r in records if not usable(r.ground_truth, r.data_source)]
    if bad:
        first = bad[0]
        what = (
            "missing"
            if first.ground_truth is None
            else f"a {type(first.ground_truth).__name__} {_short(first.ground_truth)}"
        )
        if first.data_source in DICT_TRUTH_SOURCES:
            shape, example = "a dict {'target': [answers]}", "{'target': ['Paris']}"
        else:
            shape, example = "one string or number", '"42"'
        raise DatasetError(
            f"{path}: row {first.index}: the ground truth is {what} ({len(bad)} of {len(records)} rows have no "
            f"usable ground truth); the built-in scorer for data source {first.data_source!r} compares "
            f"the response with {shape}, so every reward would be 0. Fix: store the ground truth "
            f"as {shape} (e.g. {example}), or {custom}."
        )


# --------------------------------------------------------------------------------------------------
# tokenization


def encode_prompts(
    records: Iterable[PromptRecord],
    tokenizer: Any,
    max_prompt_length: int,
    overlong: str = "filter",
    tools: list[dict] | None = None,
    keys: dict = TRAIN_KEYS,
    image_spec: ImageSpec | None = None,
) -> list[EncodedPrompt]:
    """Chat-template (``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``;
    a ``tool_agent`` row with the ``tools`` schemas) and tokenize each record's messages, without
    special tokens (the template has them). Prompts longer than ``max_prompt_length`` tokens are
    dropped (``overlong="filter"``, the count is logged), raise :class:`DatasetError` (``"error"``)
    or are cut (``left``, ``right``, ``middle``: ``truncate_prompt``; a row with images is dropped
    instead, as a cut could split an image). ``image_spec``: a VL model's (images' tokens expanded).
    """
    if overlong not in OVERLONG_MODES:
        raise ValueError(
            f"overlong={overlong!r} is not one of {OVERLONG_MODES}. "
            f"Fix: set data.overlong_prompts to one of {', '.join(OVERLONG_MODES)}."
        )
    if int(max_prompt_length) <= 0:
        raise ValueError(
            f"max_prompt_length must be positive, got {max_prompt_length}. "
            f"Fix: set {keys['max_prompt_length']} to a positive number of tokens."
        )
    records = list(records)
    if not records:
        raise DatasetError("encode_prompts got no records. Fix: check that the dataset file has rows.")

    check_image_model(records, image_spec)
    texts = render_all(tokenizer, records, tools)  # under a time limit per row: a template may hang
    encoded = tokenizer(texts, add_special_tokens=False)
    all_ids = encoded["input_ids"]

    out: list[EncodedPrompt] = []
    dropped = 0
    longest = 0
    for record, ids in zip(records, all_ids):
        ids = [int(t) for t in ids]
        ids, images = encode_images(record, ids, image_spec) if record.images else (ids, ())
        if len(ids) > max_prompt_length and overlong in TRUNCATIONS and not images:
            ids = truncate_prompt(ids, max_prompt_length, overlong)
        if len(ids) > max_prompt_length:
            if overlong == "error":
                raise DatasetError(
                    f"data_source {record.data_source!r} row {record.index}: the prompt is "
                    f"{len(ids)} tokens long, over {keys['max_prompt_length']}={max_prompt_length}. "
                    f"Fix: raise {keys['max_prompt_length']} (to at least {len(ids)}) or set "
                    "data.overlong_prompts=filter to drop overlong prompts."
                )
            dropped += 1
            longest = max(longest, len(ids))
            continue
        out.append(EncodedPrompt(record=record, prompt_ids=ids, images=images))

    if dropped:
        logger.warning(
            "dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest: %d)",
            dropped,
            len(records),
            max_prompt_length,
            longest,
        )
    if not out:
        raise DatasetError(
            f"all {len(records)} prompts (data_source {records[0].data_source!r}) are longer than "
            f"{keys['max_prompt_length']}={max_prompt_length} tokens (longest: {longest}). "
            f"Fix: raise {keys['max_prompt_length']}."
        )
    return out
