"""Which run a ``trainer.output_dir`` belongs to, so that a run never writes into a folder it does
not own (called by the controller before anything is written).

A run folder carries ``.offstep-run``, a JSON file with the run's id, written when the run first
starts there. Every checkpoint records the id of the run that wrote it, and pruning deletes only
this run's. What a start does with the folder:

===========================================  ==================================================
the folder                                   trainer.resume=off / auto / a path
===========================================  ==================================================
missing or empty                             a new run
this run's, holding no records yet           off/auto: used again; a path: a new run
(only config.yaml, data/, tmp/, empty logs)
a run with an intact checkpoint              auto: continues the run from its latest (or from
                                             trainer.resume_step); off: refused
a run with records but no intact checkpoint  refused (the run cannot be continued, and a new one
                                             would write over its metrics)
not an offstep run, and not empty            refused
===========================================  ==================================================

A run killed before its first checkpoint (or one that kept none) is not refused with
``trainer.resume=auto``: the same command moves its records aside to ``<output_dir>.old-<time>``,
saying so in one line, and starts afresh. One with checkpoints, all damaged, is still refused.

One run at a time: a start takes an exclusive lock (``fcntl.flock`` on ``.offstep-lock``) for the
run's whole life, and a second start into the folder is refused naming the holder. The folder
holds no symbolic links among its own files (``config.yaml``, ``data/``, the records, the marker,
``checkpoints/``): each is refused by name, since writing or reading through one would leave the
folder; what a run writes goes through a temporary name and ``os.replace`` (``offstep/files.py``).
A file of the run's with a second hard link is replaced by a copy of its own before it is written,
and a FIFO, device or socket where a run file or folder belongs is refused before anything is read.

A resume from a checkpoint of this folder continues its run (checkpoints of later steps are then
renamed ``.superseded``, so no later resume picks them); a resume from elsewhere starts a new run
in the folder. Where the table says refused, ``trainer.overwrite=true`` moves the folder aside to
``<output_dir>.old-<time>`` (nothing is deleted) and starts a new run there.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offstep.config.schema import Config
from offstep.errors import ConfigError
from offstep.files import (
    kind,
    loads_json,
    open_regular,
    printable,
    read_text,
    refuse_links,
    refuse_links_under,
    remove_tree,
    short,
    walk,
    write_file,
)
from offstep.pipeline.checkpoints import (
    LEGACY_STATE_FILE,
    Checkpoints,
    Loaded,
    check_compatible,
    open_checkpoint,
    resolve_path,
)
from offstep.pipeline.replay import SCHEDULE_FILE
from offstep.pipeline.trainer_state import RUN_ID
from offstep.train.checkpoint import fsync_dir

MARKER = ".offstep-run"
LOCK = ".offstep-lock"
# Scratch files of the run's workers (the vLLM engine's LoRA adapters, written at each sync for vLLM
# to read), emptied at every start: a killed run leaves them here, never outside the folder.
SCRATCH = "tmp"
# What a run writes that does not make the folder worth keeping: the marker, the lock, the config
# it rewrites at every start, the built-in task's data, which it regenerates, and the scratch.
_NOT_RECORDS = {MARKER, LOCK, "config.yaml", "data", SCRATCH}
# What each of the run's own names must be, where it exists.
_FOLDERS = {"data", "checkpoints", SCRATCH}
_FILES = {MARKER, LOCK, "config.yaml", "metrics.jsonl", "timeline.jsonl", "samples.jsonl", SCHEDULE_FILE}


class RunLock:
    """An exclusive ``flock`` on ``<output_dir>/.offstep-lock``, held until :meth:`release` (or
    the process's end: the kernel drops it with the file descriptor)."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    @classmethod
    def acquire(cls, out: Path) -> "RunLock":
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK
        refuse_links(path)
        if path.is_file() and os.lstat(path).st_nlink > 1:
            write_file(path, "")  # a lock of its own: the other name of a hard link keeps its text
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode("utf-8", errors="replace").strip() or "a run still starting"
            os.close(fd)
            raise ConfigError(
                f"trainer.output_dir={out} is in use by another offstep run ({printable(holder)}); one "
                f"run per folder: wait for it to end or stop it, or give another trainer.output_dir"
            ) from None
        if os.fstat(fd).st_nlink > 1:  # linked while it was being taken
            os.close(fd)
            raise ConfigError(
                f"{path} was given a second hard link while this run started; delete it, or give "
                f"another trainer.output_dir"
            )
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(),
            0,
        )
        return cls(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class Run:
    run_id: str
    resume: Loaded | None  # the checkpoint to continue from
    lock: RunLock | None = None  # held for the run's life


def read_marker(out: Path) -> str | None:
    path = out / MARKER
    if not path.exists() and not path.is_symlink():
        return None
    try:
        doc = loads_json(read_text(path, limit=4096))
        if not isinstance(doc, dict) or not isinstance(doc.get("run_id"), str) or not RUN_ID.fullmatch(doc["run_id"]):
            raise ValueError(f"it is not an object with a run_id of letters, digits, '_', '.' and '-': {short(doc)}")
        return doc["run_id"]
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} cannot be read ({e}); if {out} is yours, delete that file, or give "
            f"trainer.overwrite=true to move the folder aside, or another trainer.output_dir"
        ) from None


def check_entries(out: Path) -> None:
    """Refuse a symbolic link among the run's own files (any entry of the folder itself, and
    anything under ``data/`` and ``checkpoints/``: a link there would be written or read through),
    and anything but a regular file or folder where the run reads or writes (a FIFO blocks its
    reader forever), or a file where it keeps a folder and the other way round."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        refuse_links(p)
        mode = os.lstat(p).st_mode
        want_dir = p.name in _FOLDERS or (stat.S_ISDIR(mode) and p.name not in _FILES)
        if stat.S_ISDIR(mode) != want_dir or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise ConfigError(
                f"{p} is {kind(mode)}, where a run keeps {'a folder' if want_dir else 'a regular file'}; "
                f"move it away, or give another trainer.output_dir"
            )
    for sub in ("data", "checkpoints"):
        if (out / sub).is_dir():
            refuse_links_under(out / sub)
            for _, _, others in walk(out / sub):
                if bad := next((e for e in others if not e.is_file(follow_symlinks=False)), None):
                    raise ConfigError(
                        f"{bad.path} is {kind(os.lstat(bad.path).st_mode)}, where a run keeps regular "
                        f"files; delete it, or give another trainer.output_dir"
                    )


def records(out: Path) -> list[str]:
    """What in ``out`` a new run must not write over: checkpoints (not ``.partial`` ones),
    non-empty metrics, logs and anything else the run does not regenerate."""
    found = []
    for p in sorted(out.iterdir()) if out.is_dir() else []:
        if p.name in _NOT_RECORDS:
            continue
        if p.name == "checkpoints" and p.is_dir():
            n = sum(not c.name.endswith(".partial") for c in p.iterdir())
            if n:
                found.append(f"checkpoints/ ({n})")
        elif p.is_dir():
            if any(
                e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size
                for _, _, others in walk(p)
                for e in others
            ):
                found.append(p.name + "/")
        elif not p.is_file() or p.stat().st_size:
            found.append(p.name)
    return found


def _move_aside(out: Path, log: Callable[[str], None], why: str = "trainer.overwrite=true") -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out.with_name(f"{out.name}.old-{stamp}"), 1
    while aside.exists():
        aside, n = out.with_name(f"{out.name}.old-{stamp}-{n}"), n + 1
    try:
        os.rename(out, aside)
    except OSError as e:
        raise ConfigError(
            f"trainer.overwrite=true could not move {out} aside to {aside} ({e}); move it yourself, "
            f"or give another trainer.output_dir"
        ) from None
    log(f"offstep: {why}: moved the previous contents of {out} to {aside}")


def _claim(out: Path, run_id: str | None = None) -> str:
    """Make ``out`` (missing or empty, or this run's) the folder of run ``run_id`` (a new one)."""
    run_id = run_id or uuid.uuid4().hex
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / MARKER, json.dumps({"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    fsync_dir(out)
    return run_id


def _foreign(out: Path) -> list[str]:
    """What a folder that no offstep run ever claimed holds (empty: it may be claimed)."""
    if not out.is_dir() or (out / MARKER).exists() or (out / LOCK).exists():
        return []
    return sorted(p.name for p in out.iterdir())


def _refusal(out: Path, marker: str | None, held: list[str], resume: str) -> str:
    what = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "")
    fix = (
        f"give a new trainer.output_dir, or trainer.overwrite=true to move the folder aside to {out.name}.old-<time> "
        f"(nothing is deleted) and start afresh"
    )
    if marker is None:
        legacy = any((out / "checkpoints").glob(f"step_*/{LEGACY_STATE_FILE}"))
        why = (
            f"trainer.output_dir={out} is not empty and is not an offstep run folder (it has no {MARKER}; it holds "
            f"{what})"
        )
        if legacy:
            why += (
                "; it looks like a run of an older offstep, whose checkpoints (trainer_state.pt, a pickle) this "
                "version does not load"
            )
        return f"{why}; {fix}"
    if resume == "off":
        return (
            f"trainer.output_dir={out} holds run {marker} ({what}) and trainer.resume=off would write over it; "
            f"{fix}, or trainer.resume=auto to continue that run"
        )
    if resume == "auto":
        return (
            f"trainer.output_dir={out} holds run {marker} ({what}) but no intact checkpoint to continue it from, "
            f"and a new run would write over its records; {fix}"
        )
    return (
        f"trainer.output_dir={out} holds run {marker} ({what}); a resume from {resume} starts a new run, which "
        f"would write over it; {fix}"
    )


def open_run(cfg: Config, log: Callable[[str], None] = print) -> Run:
    """Decide, before anything is written, which run ``cfg.trainer.output_dir`` holds and what this
    start does with it (see the module's table): returns the run id and the checkpoint to resume
    from, or raises :class:`ConfigError` naming the fix. With ``trainer.overwrite=true`` a folder
    that would be refused is moved aside instead."""
    t = cfg.trainer
    out = Path(t.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"trainer.output_dir={out} is a file, not a folder; give a folder")
    if t.resume == "off" and t.resume_step:
        raise ConfigError(f"trainer.resume_step={t.resume_step} needs trainer.resume=auto or a run directory")
    if held := _foreign(out):  # decided before anything is written into it
        if not t.overwrite:
            raise ConfigError(_refusal(out, None, held, t.resume))
        if t.resume not in ("auto", "off") and out.resolve() in (
            Path(t.resume).resolve(),
            *Path(t.resume).resolve().parents,
        ):
            raise ConfigError(
                f"trainer.overwrite=true would move aside {out}, which holds the checkpoint to resume "
                f"from ({t.resume}); give another trainer.output_dir"
            )
        _move_aside(out, log)
    check_entries(out)
    lock = RunLock.acquire(out)
    try:
        run = _open_locked(cfg, out, log)
    except BaseException:
        lock.release()
        raise
    if run.lock is None:
        run.lock = lock
    else:  # the folder was moved aside (with its lock) and a new one claimed
        lock.release()
    remove_tree(out / SCRATCH)  # a killed run's; a link there was refused above
    return run


def _open_locked(cfg: Config, out: Path, log: Callable[[str], None]) -> Run:
    t = cfg.trainer
    marker = read_marker(out)
    loaded, continues = None, False
    if t.resume not in ("auto", "off"):
        loaded, damaged = _from_path(Path(t.resume), t.resume_step, log)
        own = out / "checkpoints"
        continues = marker is not None and own.is_dir() and loaded.path.resolve().parent == own.resolve()
        if continues and loaded.run_id != marker:
            raise ConfigError(
                f"the checkpoint {loaded.path} was written by run {loaded.run_id}, not by the run of "
                f"its folder ({marker}); it is refused (give a checkpoint of another folder to start a "
                f"new run from it)"
            )
    elif t.resume == "auto" and marker is not None:
        loaded, damaged = Checkpoints(out, run_id=marker).latest(log, t.resume_step)
        continues = loaded is not None
    if t.resume_step and loaded is None:
        raise ConfigError(f"trainer.resume_step={t.resume_step}: {out} has no checkpoint to resume from")
    if continues:
        check_compatible(loaded.config_yaml, cfg)
        Checkpoints(out, run_id=marker).set_aside_after(loaded.state.step, damaged, log)
        return Run(marker, loaded)
    if loaded is not None:
        check_compatible(loaded.config_yaml, cfg)
    held = records(out) if marker is not None else sorted(p.name for p in out.iterdir() if p.name != LOCK)
    lock = None
    if held:
        # A run of this folder killed before its first checkpoint: the same command starts afresh.
        # One whose checkpoints are all damaged is refused instead, naming them (never set aside unread).
        restart = (
            marker is not None
            and t.resume == "auto"
            and loaded is None
            and not any(h.startswith("checkpoints/") for h in held)
        )
        if not (t.overwrite or restart):
            raise ConfigError(_refusal(out, marker, held, t.resume))

        if loaded is not None and out.resolve() in loaded.path.resolve().parents:
            raise ConfigError(
                f"trainer.overwrite=true would move aside {out}, which holds the checkpoint to resume "
                f"from ({loaded.path}); give another trainer.output_dir"
            )
        _move_aside(
            out,
            log,
            "trainer.overwrite=true"
            if t.overwrite
            else f"run {marker} has no intact checkpoint to continue from (killed before its first, or it kept none)",
        )
        lock, marker = RunLock.acquire(out), None
    # A run of this folder that wrote nothing worth keeping continues under its id with resume=auto.
    return Run(_claim(out, marker if t.resume == "auto" else None), loaded, lock)


def _from_path(path: Path, step: int, log: Callable[[str], None]) -> tuple[Loaded, list[Path]]:
    """``trainer.resume=<path>``: a checkpoint folder as it is, or a run directory's latest intact
    checkpoint (or ``step``'s)."""
    if (path / "checkpoints").is_dir():
        loaded, damaged = Checkpoints(path).latest(log, step)
        if loaded is None:
            resolve_path(path)  # raises the message that names what is missing
            raise ConfigError(f"trainer.resume={path}: none of its checkpoints is intact (see above)")
        return loaded, damaged
    return open_checkpoint(resolve_path(path, step or None)), []
