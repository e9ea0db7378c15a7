"""Saving and restoring one trainer role (actor or critic) with torch's distributed checkpointing,
and reading checkpoints, which may come from someone else, without running any code of theirs.

Every rank writes its own shards of the model and optimizer state (``torch.distributed.checkpoint``
with FSDP2's sharded state dicts), so saving needs no gather onto one rank and a checkpoint can be
loaded by the same number of ranks or, for export, without any process group. The scheduler, the
RNG states and the role's counters, which are small and per rank, go beside them as
``rank<i>.json``.

What reading executes: nothing. DCP's ``.metadata`` is a pickle; :class:`SafeReader` reads it with
an unpickler that builds only the classes DCP's metadata is made of and refuses anything else.
DCP reads tensors with ``torch.load(weights_only=True)``; its non-tensor items (the optimizer's
hyper-parameters) it would unpickle unrestricted, so :class:`SafePlanner` reads them
with ``weights_only=True`` too. ``rank<i>.json`` is JSON.

The helpers at the end write files durably (fsync) and turn a failed write (a full disk) into a
message that names the folder and the free space.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from offstep.errors import CheckpointError, OffstepError
from offstep.files import loads_json, open_regular, read_text, remove_tree, walk

RANK_FORMAT = 1
MAX_RANK_BYTES = 64 * 2**20  # RNG states and the scheduler: a few KB
# A checkpoint holds what trains: the frozen base weights of a LoRA model are the base model's,
# which the run's config names, and are not written (a full model has no frozen parameters).
_TRAINED = StateDictOptions(ignore_frozen_params=True)


# ------------------------------------------------------------------ per-rank state (JSON)
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """Python's, NumPy's and torch's RNG states as JSON values."""
    version, words, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(words), gauss],
        "numpy": [kind, key.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _rng_problem(rng) -> str | None:
    """What is wrong with a stored RNG state (None: it has the shapes :func:`rng_state` writes)."""
    if not isinstance(rng, dict):
        return "rng is not an object"
    py, npy = rng.get("python"), rng.get("numpy")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)  # noqa: E731
    if not (
        isinstance(py, list)
        and len(py) == 3
        and isinstance(py[0], int)
        and ints(py[1])
        and len(py[1]) == 625
        and (py[2] is None or isinstance(py[2], (int, float)))
    ):
        return "rng.python is not Python's RNG state"
    if not (
        isinstance(npy, list)
        and len(npy) == 5
        and npy[0] == "MT19937"
        and ints(npy[1])
        and len(npy[1]) == 624
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in npy[2:])
    ):
        return "rng.numpy is not NumPy's RNG state"
    states = [rng.get("torch")] + (rng.get("cuda") or [])
    if not isinstance(rng.get("cuda", []), list) or not all(isinstance(t, str) for t in states):
        return "rng.torch is not torch's RNG state"
    try:
        for t in states:
            base64.b64decode(t, validate=True)
    except ValueError:
        return "rng.torch is not base64"
    return None


def read_rank_file(path: Path) -> dict:
    """``rank<i>.json``: {rng, sched, extra}; a damaged file is a :class:`CheckpointError`."""
    try:
        local = loads_json(read_text(path, limit=MAX_RANK_BYTES))
        if (
            not isinstance(local, dict)
            or local.get("format") != RANK_FORMAT
            or not {"rng", "sched", "extra"} <= set(local)
        ):
            raise ValueError("not a rank state of this offstep version")
        problem = (
            _rng_problem(local["rng"])
            or (None if local["sched"] is None or isinstance(local["sched"], dict) else "sched is not an object")
            or (None if isinstance(local["extra"], dict) else "extra is not an object")
        )
        if problem:
            raise ValueError(problem)
    except (OSError, ValueError, OffstepError) as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    return local


# ------------------------------------------------------------------ reading DCP without running code
# What a DCP .metadata pickle refers to (torch 2.13; read off a real save of a model + AdamW).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_NAMES:
            return super().find_class(module, name)
        if module in _METADATA_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # its own classes, not what it imports
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.path} refers to {module}.{name}, which checkpoint metadata never holds; it was not written by "
            f"torch's checkpointing and is refused unread (loading it could run code). Use a checkpoint from a "
            f"source you trust, or write a new one"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader, but its metadata is unpickled by :class:`_MetadataUnpickler`, and the
    shard files it names must lie in the checkpoint folder."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with os.fdopen(open_regular(path), "rb") as f:  # never a link or a FIFO
                metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except (
            OSError,
            OffstepError,
            EOFError,
            pickle.UnpicklingError,
            ValueError,
            TypeError,
            AttributeError,
            IndexError,
        ) as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
        for info in (metadata.storage_data or {}).values():
            rel = str(getattr(info, "relative_path", ""))
            if not rel or Path(rel).name != rel or rel in (".", ".."):
                raise CheckpointError(f"{path} names a shard file {rel!r} outside its folder; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            # Not torch's advice to load it unrestricted: that would run the pickle's code.
            raise CheckpointError(
                f"the checkpoint item {read_item.dest_index.fqn!r} holds a pickled object that is not "
                f"plain data: refused (loading it could run code)"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def check_role(path: Path) -> str | None:
    """What is wrong with the role folder ``path`` (missing, truncated or foreign files), or
    ``None``: its metadata reads safely, every shard it names is there at full length, and every
    ``rank<i>.json`` reads. Cheap: reads the metadata and the small files, stats the shards."""
    try:
        metadata = SafeReader(path).read_metadata()
        need: dict[str, int] = {}
        for info in metadata.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(need.items()):
            f = path / name
            have = f.stat().st_size if f.is_file() else None
            if have is None or have < size:
                return f"shard {f} is {'missing' if have is None else f'truncated ({have} of {size} bytes)'}"
        ranks = sorted(path.glob("rank*.json"))
        if not ranks:
            return f"{path} has no rank0.json"
        for f in ranks:
            read_rank_file(f)
    except CheckpointError as e:
        return str(e)
    return None


# ------------------------------------------------------------------ a role's save and load
def save_role(path: str | Path, rank: int, model, opt=None, sched=None, extra: dict | None = None) -> None:
    """Write ``model`` (and ``opt``) shards under ``path`` with DCP, plus ``rank<i>.json``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = (
            get_state_dict(model, opt, options=_TRAINED)
            if opt is not None
            else (get_state_dict(model, [], options=_TRAINED)[0], None)
        )
        model_sd = _trained_only(model, model_sd)
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        dcp.save(state, checkpoint_id=str(path))  # fsyncs its files (FileSystemWriter(sync_files=True))
        local = {
            "format": RANK_FORMAT,
            "rng": rng_state(),
            "sched": sched.state_dict() if sched is not None else None,
            "extra": extra or {},
        }
        write_durably(path / f"rank{rank}.json", json.dumps(local))
    except (OSError, RuntimeError, CheckpointException) as e:
        raise write_failed(path, e) from None


def _trained_only(model, model_sd: dict) -> dict:
    """Drop what DCP's ``ignore_frozen_params`` keeps of a partly frozen model: a tied weight's
    second name (``lm_head.weight`` tied to the frozen embeddings) is no parameter of its own, so
    torch does not see it as frozen."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if len(trained) == sum(1 for _ in model.parameters()):
        return model_sd  # nothing frozen: every entry (tied names included) as before
    return {k: v for k, v in model_sd.items() if k in trained}


def _loading(model) -> StateDictOptions:
    """How a role's state goes back in: strictly (every key) for a model that trains all of its
    weights; for a partly frozen one (LoRA), what trains, the frozen base staying as loaded. A key
    the checkpoint lacks fails in DCP's load before this either way."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def load_role(path: str | Path, rank: int, model, opt=None, sched=None) -> dict:
    """Restore what ``save_role`` wrote into an identically built (and sharded) role; returns
    the ``extra`` dict."""
    path = Path(path)
    local = read_rank_file(path / f"rank{rank}.json")
    if opt is not None:
        model_sd, optim_sd = get_state_dict(model, opt, options=_TRAINED)
        state = {"model": _trained_only(model, model_sd), "optim": optim_sd}
    else:
        state = {"model": _trained_only(model, get_state_dict(model, [], options=_TRAINED)[0])}
    _dcp_load(state, path)
    try:
        if opt is not None:
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_loading(model)
            )
        else:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={}, options=_loading(model))
        set_rng_state(local["rng"])
        if sched is not None and local["sched"] is not None:
            sched.load_state_dict(local["sched"])
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"the checkpoint {path} cannot be loaded ({_cause(e)})") from None
    return local["extra"]


def load_model_weights(path: str | Path, model: torch.nn.Module, names=None) -> None:
    """Load only the model weights of a role checkpoint into a plain (unsharded) model, without a
    process group: DCP reads the shards of every rank and reassembles full tensors. ``names``:
    only these tensors (a LoRA checkpoint's adapters; the rest of ``model`` is the base's)."""
    state = {"model": {n: t for n, t in model.state_dict().items() if names is None or n in names}}
    with warnings.catch_warnings():  # "no process group: assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(state, Path(path), no_dist=True)
    model.load_state_dict(state["model"], strict=names is None)


def _dcp_load(state: dict, path: Path, **kw) -> None:
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), **kw)
    except CheckpointError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, CheckpointException) as e:
        raise CheckpointError(f"the checkpoint {path} cannot be loaded ({_cause(e)})") from None


# ------------------------------------------------------------------ durable writes, full disks
def _cause(e: BaseException) -> str:
    """The first line of what went wrong (DCP wraps each rank's exception in its own)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    if isinstance(e, pickle.UnpicklingError):  # not torch's advice to load it unrestricted: that runs its code
        return "UnpicklingError: its bytes are not what torch wrote (garbled, or not plain tensors); refused unread"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def free_space(path: Path) -> str:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    return f"{free / 2**30:.2f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"


def write_failed(path: Path, e: BaseException) -> CheckpointError:
    """The error for a write into ``path`` that failed, typically a full disk (torch's writer
    reports it as "unexpected pos ..." or "file write failed")."""
    return CheckpointError(
        f"writing {path} failed ({_cause(e)}); {free_space(path)} free on that file system. Free some space "
        f"(or keep fewer checkpoints: trainer.keep_checkpoints, or write elsewhere: trainer.output_dir), then "
        f"continue from the last complete checkpoint with trainer.resume=auto"
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (never through a link) and fsync it (not its folder: the caller
    renames that)."""
    if path.is_file() and not path.is_symlink() and os.lstat(path).st_nlink > 1:
        os.unlink(path)  # a hard link's other name, outside the folder perhaps, is never written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and ``root``), so that a rename of ``root``
    that follows publishes complete contents even after a power loss."""
    for folder, _, others in walk(root):
        for entry in others:
            fd = open_regular(entry.path)  # a FIFO there is refused, not waited on
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def replace_dir(new: Path, final: Path, aside: Path) -> None:
    """Put the folder ``new`` at ``final`` so that a complete copy exists at every moment: an
    existing ``final`` is renamed to ``aside`` first and deleted only once ``new`` is in place."""
    if final.exists() or final.is_symlink():
        os.rename(final, aside)
    os.rename(new, final)
    fsync_dir(final.parent)
    remove_tree(aside)
