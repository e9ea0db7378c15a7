"""Saving and restoring one trainer role (actor or critic) with torch's distributed checkpointing.

Every rank writes its own shards of the model and optimizer state (``torch.distributed.checkpoint``
with FSDP2's sharded state dicts), so saving needs no gather onto one rank and a checkpoint can be
loaded by the same number of ranks or, for export, without any process group. The scheduler and
the RNG states, which are small and per rank, go beside it as ``rank<i>.pt``.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_role(path: str | Path, rank: int, model, opt=None, sched=None, extra: dict | None = None) -> None:
    """Write ``model`` (and ``opt``) shards under ``path`` with DCP, plus ``rank<i>.pt``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, opt) if opt is not None else (get_state_dict(model, [])[0], None)
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(path))
    local = {"rng": rng_state(), "sched": sched.state_dict() if sched is not None else None, "extra": extra or {}}
    torch.save(local, path / f"rank{rank}.pt")


def load_role(path: str | Path, rank: int, model, opt=None, sched=None) -> dict:
    """Restore what ``save_role`` wrote into an identically built (and sharded) role; returns
    the ``extra`` dict."""
    path = Path(path)
    if opt is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_state_dict(model, [])[0]}
    dcp.load(state, checkpoint_id=str(path))
    if opt is not None:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    local = torch.load(path / f"rank{rank}.pt", weights_only=False)
    set_rng_state(local["rng"])
    if sched is not None and local["sched"] is not None:
        sched.load_state_dict(local["sched"])
    return local["extra"]


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a role checkpoint into a plain (unsharded) model, without a
    process group: DCP reads the shards of every rank and reassembles full tensors."""
    sd = model.state_dict()
    state = {"model": sd}
    with warnings.catch_warnings():  # "no process group: assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
