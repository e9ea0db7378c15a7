"""File primitives for what a run folder holds, which may have come from someone else.

Writes never leave the folder: a file is written under a fresh temporary name (opened with
``O_EXCL | O_NOFOLLOW``) and moved into place with ``os.replace``, which replaces a symbolic link
instead of writing through it; a record file is opened with ``O_NOFOLLOW``. Reads of received
files refuse links and decode defensively: JSON nested too deeply, YAML aliases (the "billion
laughs") and oversized files are refused with a message, never a traceback or a hang.
"""

from __future__ import annotations

import errno
import json
import os
import uuid
from pathlib import Path

import yaml

from offstep.errors import LinkRefused

MAX_CONFIG_BYTES = 4 * 2**20  # a saved config.yaml is a few KB


def link_refused(path: Path) -> LinkRefused:
    return LinkRefused(f"{path} is a symbolic link (to {os.readlink(path)!r}); offstep neither writes nor reads a "
                       f"run's files through links, which could point outside the run folder. Replace the link with "
                       f"the file or folder itself, or give another trainer.output_dir")


def refuse_links(*paths: Path) -> None:
    """Raise :class:`LinkRefused` for the first of ``paths`` that is a symbolic link."""
    for p in paths:
        if os.path.islink(p):
            raise link_refused(Path(p))


def refuse_links_under(root: Path) -> None:
    """``root`` and everything below it hold no symbolic link (walked without following any)."""
    refuse_links(root)
    for folder, dirs, files in os.walk(root):
        refuse_links(*(Path(folder, n) for n in dirs + files))


def _open_new(path: Path, mode: int = 0o644) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def temp_name(path: Path) -> Path:
    """A fresh name beside ``path`` for a file that will replace it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_file(path: str | Path, data: str | bytes, durable: bool = True) -> None:
    """Put ``data`` at ``path`` atomically: a new temporary file, fsynced, then ``os.replace``
    (a link at ``path`` is replaced, never followed)."""
    path = Path(path)
    tmp = temp_name(path)
    fd = _open_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def open_new(path: str | Path, binary: bool = True):
    """A new file at ``path`` that did not exist (``O_EXCL | O_NOFOLLOW``)."""
    return os.fdopen(_open_new(Path(path)), "wb" if binary else "w")


def open_record(path: str | Path, append: bool):
    """A line-buffered text file to write records to (``metrics.jsonl``...), never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(Path(path)) from None
        raise
    return os.fdopen(fd, "a" if append else "w", buffering=1)


def read_text(path: str | Path, limit: int | None = None) -> str:
    """The text of ``path``, refusing a link (``OSError``/``LinkRefused``) and, with ``limit``, a
    file larger than that (``ValueError``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(Path(path)) from None
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ValueError(f"it is larger than {limit} bytes")
    return data.decode("utf-8", errors="replace")


def loads_json(text: str):
    """``json.loads``, with a document nested too deeply for the parser a ``ValueError``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


class _NoAliasLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing anchors and aliases: a saved config never has them, and a
    crafted one can expand a kilobyte into billions of nodes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("it uses YAML aliases (*name), which a saved offstep config never holds")
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:
            raise yaml.YAMLError("it uses YAML anchors (&name), which a saved offstep config never holds")
        return super().compose_node(parent, index)


def loads_yaml(text: str):
    """Plain data from YAML: no tags, no aliases, no recursion deeper than the parser allows
    (``ValueError`` for all of them)."""
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except RecursionError:
        raise ValueError("the YAML is nested too deeply") from None
    finally:
        loader.dispose()


def short(value, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about received data."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
