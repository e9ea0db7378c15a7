"""Where a run's metrics and sample generations go, beside the console.

``trainer.loggers`` picks them: ``console`` (the progress line), ``jsonl`` (always on: it is the
run's record, ``metrics.jsonl`` and ``samples.jsonl``), ``tensorboard`` (scalars under
``<output_dir>/tensorboard``) and ``wandb`` (Weights & Biases under ``<output_dir>/wandb``,
offline unless asked otherwise, so no account is needed). Metric names keep their prefix
(``actor/``, ``timing_s/``, ``val/`` ...), which both tools show as groups. ``RunLoggers`` fans a
step's record and its samples out to every chosen sink.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from offstep.config.choices import WANDB_MODES
from offstep.errors import ConfigError
from offstep.files import open_record
from offstep.telemetry.metrics import JsonlWriter


def _scalars(m: dict) -> dict[str, float]:
    return {k: v for k, v in m.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLogger:
    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError(
                "trainer.loggers includes tensorboard but the tensorboard package is missing: "
                "pip install 'offstep[tensorboard]' (or remove it from trainer.loggers)"
            ) from e
        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def log(self, m: dict) -> None:
        step = int(m["step"])
        for k, v in _scalars(m).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        text = "\n\n".join(
            f"**reward {r['reward']:.3f}** (v{r['version']})\n\n    {r['prompt']}\n\n    {r['response']}" for r in rows
        )
        self.writer.add_text("samples", text, step)

    def close(self) -> None:
        self.writer.close()


def resolve_wandb_mode(configured: str, env: dict) -> str:
    """``trainer.wandb_mode`` if set, else ``$WANDB_MODE``, else ``offline`` (never needs a login)."""
    mode = configured or env.get("WANDB_MODE", "") or "offline"
    if mode not in WANDB_MODES:
        source = "trainer.wandb_mode" if configured else "the WANDB_MODE environment variable"
        raise ConfigError(f"{source}={mode!r} is not one of {list(WANDB_MODES)}")
    return mode


class WandbLogger:
    """A Weights & Biases run in ``<out_dir>/wandb``; offline by default (``wandb sync`` uploads it
    later). Samples go in a table logged with the metrics of their step, because W&B drops
    anything logged at a step lower than one already logged, and the controller logs a step's
    samples before the previous step's metrics are complete."""

    def __init__(self, out_dir: Path, config: dict, project: str, name: str, mode: str = ""):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                "trainer.loggers includes wandb but the wandb package is missing: "
                "pip install 'offstep[wandb]' (or remove it from trainer.loggers)"
            ) from e
        self._wandb = wandb
        mode = resolve_wandb_mode(mode, os.environ)
        if mode == "online" and not wandb.login(prompt=False, verify=False):
            raise ConfigError(
                "trainer.wandb_mode=online needs W&B credentials (WANDB_API_KEY or `wandb login`); "
                "use trainer.wandb_mode=offline to log locally and `wandb sync` later"
            )
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(out_dir),
            mode=mode,
            config=config,
            settings=wandb.Settings(console="off", silent=True),  # our console stays ours
        )
        self._samples: dict[int, list[dict]] = {}

    def log(self, m: dict) -> None:
        step = int(m["step"])
        record: dict = dict(_scalars(m))
        rows = [r for s in sorted(k for k in self._samples if k <= step) for r in self._samples.pop(s)]
        if rows:
            record["samples"] = self._table(rows)
        self.run.log(record, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            self._samples.setdefault(step, []).extend(rows)

    def _table(self, rows: list[dict]):
        cols = list(rows[0])
        return self._wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])

    def close(self) -> None:
        if self._samples:  # samples of a step whose metrics never came (an interrupted run)
            last = max(self._samples)
            self.run.log(
                {"samples": self._table([r for s in sorted(self._samples) for r in self._samples[s]])}, step=last
            )
            self._samples.clear()
        self.run.finish()


class SampleLog:
    """``samples.jsonl``: a few prompts, responses and rewards every N steps."""

    def __init__(self, path: Path, append: bool = False):
        self._f = open_record(path, append)

    def write(self, rows: list[dict]) -> None:
        for r in rows:
            self._f.write(json.dumps(r) + "\n")

    def close(self) -> None:
        self._f.close()


class RunLoggers:
    """Every per-step sink of a run behind ``log(metrics)``, ``log_samples(step, rows)``, ``close()``:
    ``metrics.jsonl`` and ``samples.jsonl`` always, TensorBoard and W&B when in ``trainer.loggers``.
    ``append``: a resumed run adds to the record files (and starts a new W&B run)."""

    def __init__(self, out_dir: Path, cfg, append: bool = False):
        out, t = Path(out_dir), cfg.trainer
        self.metrics = JsonlWriter(out / "metrics.jsonl", append=append)
        self.samples = SampleLog(out / "samples.jsonl", append=append)
        self.sinks: list = []
        try:
            if "tensorboard" in t.loggers:
                self.sinks.append(TensorBoardLogger(out))
            if "wandb" in t.loggers:
                self.sinks.append(
                    WandbLogger(out, asdict(cfg), t.wandb_project, t.wandb_run_name or out.resolve().name, t.wandb_mode)
                )
        except Exception:
            self.close()
            raise

    def log(self, m: dict) -> None:
        self.metrics.write(m)
        for s in self.sinks:
            s.log(m)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.samples.write(rows)
        for s in self.sinks:
            s.log_samples(step, rows)

    def close(self) -> None:
        for s in (self.metrics, self.samples, *self.sinks):
            s.close()
