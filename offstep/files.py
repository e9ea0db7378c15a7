"""File primitives for what a run folder holds, which may have come from someone else.

Writes never leave the folder: a file is written under a fresh temporary name (opened with
``O_EXCL | O_NOFOLLOW``) and moved into place with ``os.replace``, which replaces a symbolic link
instead of writing through it; a record file is opened with ``O_NOFOLLOW``, and one with a second
hard link (whose other name may lie outside the folder) is first replaced by a copy of its own.
Reads of received files refuse links and anything that is not a regular file (a FIFO would block
the reader forever), check the size before reading, and decode defensively: JSON nested too
deeply, YAML aliases (the "billion laughs") and oversized files are refused with a message, never a
traceback or a hang. Trees are walked with an explicit stack and a bound on their entries, so a
folder nested thousands deep is an error with a message, not a ``RecursionError``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Iterator

import yaml

from offstep.errors import LinkRefused, NotAFile

MAX_CONFIG_BYTES = 4 * 2**20  # a saved config.yaml is a few KB
# What a read of a run's or checkpoint's file takes at most unless its caller says less: the
# largest is trainer_state.json with the batches generating ahead (tens of MB at verl's sizes).
MAX_READ_BYTES = 1 << 30
MAX_TREE_ENTRIES = 200_000  # a checkpoint of a sharded 70B run holds a few thousand files


def link_refused(path: Path) -> LinkRefused:
    return LinkRefused(
        f"{path} is a symbolic link (to {os.readlink(path)!r}); offstep neither writes nor reads a "
        f"run's files through links, which could point outside the run folder. Replace the link with "
        f"the file or folder itself, or give another trainer.output_dir"
    )


def refuse_links(*paths: Path) -> None:
    """Raise :class:`LinkRefused` for the first of ``paths`` that is a symbolic link."""
    for p in paths:
        if os.path.islink(p):
            raise link_refused(Path(p))


def kind(mode: int) -> str:
    """What a ``st_mode`` is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def not_a_file(path: Path, mode: int) -> NotAFile:
    return NotAFile(
        f"{path} is {kind(mode)}, where offstep reads or writes a regular file; reading a FIFO or device "
        f"would block or never end. Delete it or replace it with the file, or give another folder"
    )


def walk(
    root: str | Path, limit: int = MAX_TREE_ENTRIES
) -> Iterator[tuple[Path, list[os.DirEntry], list[os.DirEntry]]]:
    """(folder, its sub-folders, its other entries) for ``root`` and every folder below it, top
    down, folders sorted by name; links are never followed (a link to a folder is an "other"
    entry). An explicit stack, not recursion, so any depth works; more than ``limit`` entries
    in all is a :class:`NotAFile` (a run's or checkpoint's tree is never that large)."""
    stack, seen = [Path(root)], 0
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):  # as os.walk: a root that is no folder has nothing below
            continue
        seen += len(entries)
        if seen > limit:
            raise NotAFile(
                f"{root} holds more than {limit} files and folders, more than a run or checkpoint ever "
                f"does; give the folder that holds only the run or checkpoint"
            )
        dirs = [e for e in entries if e.is_dir(follow_symlinks=False)]
        yield folder, dirs, [e for e in entries if not e.is_dir(follow_symlinks=False)]
        stack.extend(Path(e.path) for e in reversed(dirs))


def remove_tree(root: str | Path) -> None:
    """Delete ``root`` and everything below it, at any depth (``shutil.rmtree`` recurses, and a
    folder nested a thousand deep ends it in a ``RecursionError``); links are removed, never
    followed; a missing ``root`` is nothing to do, and what cannot be deleted is left."""
    root = Path(root)
    if root.is_symlink() or root.is_file():
        root.unlink(missing_ok=True)
        return
    stack = [(root, False)]
    while stack:
        folder, emptied = stack.pop()
        if emptied:
            try:
                os.rmdir(folder)
            except OSError:
                pass
            continue
        stack.append((folder, True))
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append((Path(e.path), False))
            else:
                try:
                    os.unlink(e.path)
                except OSError:
                    pass


def refuse_links_under(root: Path) -> None:
    """``root`` and everything below it hold no symbolic link (walked without following any)."""
    refuse_links(root)
    for _, _, others in walk(root):
        refuse_links(*(Path(e.path) for e in others if e.is_symlink()))


def _open_new(path: Path, mode: int = 0o644) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of the regular file ``path`` (``flags`` with ``O_NOFOLLOW``): a link is a
    :class:`LinkRefused`, anything but a regular file (a FIFO, a device, a folder) a
    :class:`NotAFile`, and neither is ever blocked on (opened ``O_NONBLOCK``, which a regular
    file ignores)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(Path(path)) from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a folder, a FIFO with no reader
            raise not_a_file(Path(path), os.lstat(path).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_a_file(Path(path), st.st_mode)
    os.set_blocking(fd, True)
    return fd


def own_file(path: str | Path) -> None:
    """Make sure ``path``, if it exists, is a regular file with one name only: a file with a
    second hard link (whose other name may be anywhere, outside the run folder included) is
    replaced by a copy under its own inode, so that what is written next changes nothing else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise link_refused(Path(path))
    if not stat.S_ISREG(st.st_mode):
        raise not_a_file(Path(path), st.st_mode)
    if st.st_nlink > 1:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        write_file(path, data)


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
    """A line-buffered text file to write records to (``metrics.jsonl``...), never through a link
    nor into an inode that another name shares (:func:`own_file`)."""
    own_file(path)
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0))
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "a" if append else "w", buffering=1)


def read_bytes(path: str | Path, limit: int = MAX_READ_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), refusing one larger than
    ``limit`` before reading it (``ValueError``; a sparse file of terabytes costs nothing)."""
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"it is {size} bytes, larger than the {limit} that offstep reads for it")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is larger than the {limit} bytes that offstep reads for it")
    return data


def read_text(path: str | Path, limit: int = MAX_READ_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (bad bytes replaced)."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


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


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 but newline and tab


def printable(text: str) -> str:
    """``text`` with control characters (terminal escape codes among them) shown escaped, for
    printing what was read from a file; newlines and tabs stay."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def short(value, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about received data."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
