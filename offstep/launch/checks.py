"""The small helpers every config check uses: a condition with its message, a value among its
choices, and the floats of a subtree (``validate.py``, ``validate_training.py``)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass


def need(ok: bool, msg: str, errors: list[str]) -> None:
    if not ok:
        errors.append(msg)


def choice(value, key: str, choices, errors: list[str]) -> None:
    need(value in choices, f"{key}={value!r} is not one of {list(choices)}", errors)


def floats(node, prefixes: tuple[str, ...], key: str = ""):
    """(dotted key, value) of every float in the config subtrees named by ``prefixes``."""
    if is_dataclass(node):
        for f in fields(node):
            sub = f"{key}.{f.name}" if key else f.name
            if not key and f.name not in prefixes:
                continue
            yield from floats(getattr(node, f.name), prefixes, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from floats(v, prefixes, f"{key}[{i}]")
    elif isinstance(node, float):
        yield key, node
