"""Plain Python values from the numpy / pyarrow values a dataset file is read as."""

from __future__ import annotations

from typing import Any


def to_plain(value: Any) -> Any:
    """Recursively convert numpy / pyarrow containers and scalars to plain Python values."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    # pyarrow scalars
    as_py = getattr(value, "as_py", None)
    if callable(as_py):
        return to_plain(as_py())
    # numpy arrays and scalars (checked by duck typing so numpy is only needed when present)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_plain(tolist())
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return value
