"""Run checkpoints on disk: where they live, how they are committed atomically, which one a
resume picks, and how many are kept.

A checkpoint of step ``s`` is the folder ``<output_dir>/checkpoints/step_<s>``::

    actor/            the actor's model and optimizer shards (DCP) + rank<i>.pt (scheduler, RNG)
    critic/           the same for the critic (GAE only)
    trainer_state.pt  the driver's state: step, policy version, prompt stream position, KL
                      controller, and the batches that were generating when it was written
    config.yaml       the configuration of the run that wrote it

It is written into ``step_<s>.partial`` and renamed once complete; a rename is atomic on POSIX
file systems, so a crash while saving leaves at most a ``.partial`` folder, which no resume picks
and the next save clears away. Only complete checkpoints count towards ``keep_checkpoints``.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from offstep.config.loader import ConfigError

_NAME = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.pt"
# Keys a resumed run must share with the run that wrote the checkpoint, or it would not be the
# same run continued (the rest, e.g. total_steps, logging, may change).
MUST_MATCH = (
    "model.path", "data.train_files", "data.task", "data.task_options", "data.train_batch_size",
    "rollout.n", "pipeline.max_staleness", "trainer.seed", "algorithm.adv_estimator",
)


@dataclass
class TrainerState:
    """The driver's share of a checkpoint (the trainer roles write their own shards)."""

    step: int  # the last step done
    version: int  # the trainer's policy version
    t0: float  # the run's clock origin (timeline.jsonl is relative to it)
    stream: dict  # PromptStream.state_dict(): epoch, position, order
    in_flight: list  # (batch index, epoch, prompt indices, Generated) of each batch generating ahead
    restarts: int  # rollout replicas replaced so far
    kl_ctrl: dict | None = None  # the KL-in-reward controller's state


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


class Checkpoints:
    def __init__(self, output_dir: str | Path, keep: int = 0):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep

    def staging(self, step: int) -> Path:
        """A clean ``.partial`` folder to write the checkpoint of ``step`` into."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        path = self.root / f"step_{step:06d}.partial"
        path.mkdir()
        return path

    def commit(self, staging: Path, state: TrainerState, config_yaml: str) -> Path:
        """Write the driver's state last, then make the checkpoint visible with one rename."""
        (staging / "config.yaml").write_text(config_yaml)
        torch.save(vars(state), staging / STATE_FILE)
        final = step_dir(self.root, state.step)
        if final.exists():  # re-saving a step (e.g. a resumed run stopped again at once)
            shutil.rmtree(final)
        staging.rename(final)
        self._prune()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in complete_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint folder that ``trainer.resume`` names: ``off`` none; ``auto`` the latest
        committed one of this run (none if there is none); otherwise a path, which must exist."""
        if resume == "off":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1][1] if found else None
        return resolve_path(resume)


def resolve_path(path: str | Path, step: int | None = None) -> Path:
    """A checkpoint folder from a checkpoint folder, a run directory (its latest, or ``step``)."""
    p = Path(path)
    if (p / STATE_FILE).is_file() and step is None:
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = dict(complete_checkpoints(root))
    if not found:
        raise ConfigError(
            f"{str(path)!r} holds no complete checkpoint (looked for {root}/step_<N>/{STATE_FILE}); give a run "
            f"directory trained with trainer.save_freq > 0, or one of its checkpoints/step_<N> folders"
        )
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ConfigError(f"{str(path)!r} has no checkpoint of step {step}; it has steps {sorted(found)}")
    return found[step]


def load_state(path: Path) -> TrainerState:
    return TrainerState(**torch.load(path / STATE_FILE, weights_only=False))


def check_compatible(saved_yaml: str, cfg) -> None:
    """Refuse to resume a checkpoint written by a run that differs in a key that changes what
    the continued run would compute."""
    from omegaconf import OmegaConf

    saved = OmegaConf.create(saved_yaml)
    now = OmegaConf.structured(cfg)
    diffs = []
    for key in MUST_MATCH:
        a, b = OmegaConf.select(saved, key), OmegaConf.select(now, key)
        a = OmegaConf.to_container(a) if OmegaConf.is_config(a) else a
        b = OmegaConf.to_container(b) if OmegaConf.is_config(b) else b
        if a != b:
            diffs.append(f"{key}: checkpoint {a!r}, now {b!r}")
    if diffs:
        raise ConfigError(
            "the checkpoint was written by a different run configuration (" + "; ".join(diffs) + "); resume with "
            "the same values, or start a new run with trainer.resume=off or another trainer.output_dir"
        )
