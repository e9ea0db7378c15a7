"""Small saved roles and committed checkpoints for the checkpoint safety tests
(tests/pipeline/test_safety.py, tests/pipeline/test_folder_safety.py), without Ray."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from offstep.pipeline.checkpoints import Checkpoints, file_digests
from offstep.pipeline.run_dir import open_run
from offstep.pipeline.trainer_state import STATE_FILE, TrainerState
from offstep.train.checkpoint import save_role


@pytest.fixture(autouse=True)
def single_process_dcp():
    """Import it into a test module: DCP's "no process group, assuming a single process" warning
    is the intent there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def save_small_role(path: Path, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """A Linear(3, 2) (or ``model``) after one AdamW step, saved as a role at ``path``."""
    model = model or torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()
    sched.step()
    save_role(path, 0, model, opt, sched, {"updates": 1})
    return model


def commit_small(
    ck: Checkpoints, step: int, cfg_yaml: str = "model: {path: tiny}\n", in_flight: list | None = None
) -> Path:
    """Step ``step`` committed to ``ck`` with a small actor role and a trainer state."""
    staging = ck.staging(step)
    save_small_role(staging / "actor")
    return ck.commit(
        staging, TrainerState(step, step, 12.5, {"epoch": 0, "position": step}, in_flight or [], 0), cfg_yaml
    )


def ended_run(cfg, log):
    """``open_run`` of a run that then ends (its folder's lock released)."""
    run = open_run(cfg, log)
    run.lock.release()
    return run


def recraft(ckpt: Path) -> None:
    """What a crafter does after editing a checkpoint's files: list their new digests in its state."""
    doc = json.loads((ckpt / STATE_FILE).read_text())
    doc["files"] = file_digests(ckpt)
    (ckpt / STATE_FILE).write_text(json.dumps(doc))
