"""One training run for a benchmark, and what the benchmarks read from its run folder. Shared by
the training benchmarks (``benchmarks.engine_runs``, ``benchmarks.lora``, ``benchmarks.preset_runs``, ...)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    cfg: object
    out: Path
    wall_s: float
    metrics: list[dict]  # every record, step 0 (validation before training) included

    @property
    def steps(self) -> list[dict]:
        return [m for m in self.metrics if m["step"] >= 1]

    def median(self, key: str) -> float:
        """Median of ``key`` over steps 2 and later (step 1 includes the pipeline's fill)."""
        return statistics.median(m[key] for m in self.steps[1:])

    @property
    def val(self) -> list[float]:
        return [m["val/acc"] for m in self.metrics if "val/acc" in m]

    @property
    def val_curve(self) -> list[tuple[int, float]]:
        """(step, validation accuracy) at every validation, step 0 (before training) first."""
        return [(m["step"], m["val/acc"]) for m in self.metrics if "val/acc" in m]

    @property
    def rewards(self) -> list[float]:
        """Training reward (mean over the batch) of every step, step 1 first."""
        return [m["reward/mean"] for m in self.steps]

    def reward(self, first: bool, n: int = 3) -> float:
        return statistics.mean(self.rewards[:n] if first else self.rewards[-n:])

    def timeline(self) -> list[dict]:
        return read_jsonl(self.out / "timeline.jsonl")


def train_and_read(overrides: list[str], out: Path, steps: int, val_freq: int = 0) -> Run:
    """Train with ``overrides`` for ``steps`` steps into ``out`` (a rerun moves the previous run
    aside), validating before, after and every ``val_freq`` steps (0: before and after only), with
    plain progress; return what the run recorded."""
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train

    cfg = load_config(
        [
            *overrides,
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.overwrite=true",
            f"trainer.val_freq={val_freq or steps}",
            "trainer.progress=plain",
        ]
    )
    t0 = time.time()
    train(cfg)
    return Run(cfg, out, time.time() - t0, read_jsonl(out / "metrics.jsonl"))
