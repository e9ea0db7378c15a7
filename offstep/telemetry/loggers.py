"""Metric loggers beside ``metrics.jsonl`` (always written): TensorBoard, and sample generations.

``trainer.loggers`` picks them: ``console`` (the progress line), ``jsonl`` (always on: it is the
run's record), ``tensorboard`` (scalars under ``<output_dir>/tensorboard``, grouped by the metric
prefix: ``actor/``, ``timing_s/``, ``val/`` ...).
"""

from __future__ import annotations

import json
from pathlib import Path

KNOWN = ("console", "jsonl", "tensorboard")


class TensorBoardLogger:
    def __init__(self, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ValueError("trainer.loggers includes tensorboard but the tensorboard package is missing: "
                             "pip install tensorboard (or remove it from trainer.loggers)") from e
        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def log(self, m: dict) -> None:
        step = int(m["step"])
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        text = "\n\n".join(f"**reward {r['reward']:.3f}** (v{r['version']})\n\n    {r['prompt']}\n\n    {r['response']}" for r in rows)
        self.writer.add_text("samples", text, step)

    def close(self) -> None:
        self.writer.close()


class SampleLog:
    """``samples.jsonl``: a few prompts, responses and rewards every N steps."""

    def __init__(self, path: Path):
        self._f = open(path, "w", buffering=1)

    def write(self, rows: list[dict]) -> None:
        for r in rows:
            self._f.write(json.dumps(r) + "\n")

    def close(self) -> None:
        self._f.close()
