"""The scorer of reasoning-gym rows (data_source ``reasoning_gym/<dataset>``): the answer is the text in
the response's last ``<answer>...</answer>`` (the library's ``extract_answer``; none: score 0), judged by
the dataset's own ``score_answer(answer, entry)``.

The row carries what ``score_answer`` needs in ``extra_info["reasoning_gym"]``, a JSON string (the
items' metadata differ in shape from row to row, which parquet's struct columns would pad with nulls):
``{"dataset", "config", "entry": {"question", "answer", "metadata"}}``, tuples marked (:func:`encode`).
A row without it (a file made elsewhere) is scored with its ground truth as the item's answer, which
serves the datasets whose ``score_answer`` reads nothing else. reasoning_gym is imported on first use.
"""

from __future__ import annotations

import functools
import json
from typing import Any

SOURCE_PREFIX = "reasoning_gym/"
INFO_KEY = "reasoning_gym"
_TUPLE = "__tuple__"  # JSON has no tuples; some datasets' score_answer compares with them (arc_agi, rearc)


def encode(value: Any) -> Any:
    """``value`` with its tuples marked, so that :func:`decode` after a JSON round trip gives them back."""
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(decode(v) for v in value[_TUPLE])
        return {k: decode(v) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=64)
def dataset(name: str, config_json: str) -> Any:
    """The library's dataset ``name`` with the options ``config_json``: its ``score_answer`` may read its config."""
    import reasoning_gym

    config = json.loads(config_json)
    config.setdefault("seed", 0)  # unseeded, the library draws a random seed; no score depends on it
    return reasoning_gym.create_dataset(name, **config)


def info_of(data_source: str, ground_truth: Any, extra_info: dict | None) -> tuple[str, dict, dict]:
    """(dataset name, config, item) of a row: from its ``extra_info`` JSON, else its source and ground truth."""
    raw = (extra_info or {}).get(INFO_KEY)
    if raw:
        info = json.loads(raw) if isinstance(raw, str) else raw
        return info["dataset"], info.get("config") or {}, decode(info["entry"])
    name = data_source[len(SOURCE_PREFIX) :] if data_source.startswith(SOURCE_PREFIX) else data_source
    question = (extra_info or {}).get("question", "")
    return (
        name,
        {},
        {"question": question, "answer": None if ground_truth is None else str(ground_truth), "metadata": {}},
    )


def reasoning_gym_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's signature: the row's dataset's ``score_answer`` on the response's ``<answer>`` text."""
    from reasoning_gym.utils import extract_answer

    name, config, entry = info_of(data_source, ground_truth, extra_info)
    scorer = dataset(name, json.dumps(config, sort_keys=True))
    return float(scorer.score_answer(extract_answer(solution_str), entry))
