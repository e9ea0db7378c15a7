"""The report of ``benchmarks/gpu_check.py``: one row per check, the Markdown table and page, the
command as recorded. Like the check, it imports neither Ray nor Hydra (the lent GPU machine has
neither)."""

from __future__ import annotations

import platform
import shlex
from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    model: str
    params: int
    check: str
    tokens: int = 0
    seconds: float = 0.0
    peak_gib: float | None = None
    diff_max: float | None = None
    diff_mean: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    lines = [
        "| model | parameters | check | tokens | seconds | tokens/s | peak GiB | log-prob abs diff max / mean | what |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        diff = "–" if r.diff_max is None else f"{r.diff_max:.3g} / {r.diff_mean:.3g}"
        lines.append(
            f"| {r.model} | {r.params / 1e6:.1f} M | {r.check} | {r.tokens} | {r.seconds:.2f} | "
            f"{r.tokens_per_s:.0f} | {fmt(r.peak_gib, '.2f')} | {diff} | {r.note} |"
        )
    return "\n".join(lines)


def report(rows: list[Row], skipped: list[str], failed: list[str], meta: dict) -> str:
    lines = [
        "# GPU check: built-in engine, actor update and LoRA at Qwen2.5 shapes (random weights)",
        "",
        f"Command: `{meta['command']}`. CPU: {meta['cpu']}. Date: {meta['date']}.",
        "",
        f"Device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, peft {meta['peft']}, "
        f"Python {meta['python']}{'; Ray not installed (stand-in module)' if meta['ray_stand_in'] else ''}. "
        f"Budget {meta['budget_s']:.0f} s, {meta['elapsed_s']:.0f} s used.",
        "",
        "Engine: bfloat16 weights, generated tokens/s; its log-probs against the trainer's (float32 master "
        "weights, bfloat16 autocast) on the same tokens. Update and LoRA: `ActorWorker.update` (GRPO loss, "
        "FSDP2 over one rank, AdamW), real prompt and response tokens/s; peak memory over the timed part.",
        "",
        table(rows),
    ]
    if skipped:
        lines += ["", "Skipped to stay within the budget: " + "; ".join(skipped) + "."]
    if failed:
        lines += ["", "Failed: " + "; ".join(failed) + "."]
    return "\n".join(lines) + "\n"


def recorded_command(argv: list[str]) -> str:
    """This run's command, without where its outputs went (``--json``/``--out`` paths of one machine)."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--out"):
            skip = True
        elif not a.startswith(("--json=", "--out=")):
            keep.append(a)
    return shlex.join(["python", "-m", "benchmarks.gpu_check", *keep])


def host_cpu(device: torch.device) -> str:
    if device.type == "cuda":
        return f"the host of an {torch.cuda.get_device_name(device)}"
    try:
        from benchmarks.common import cpu_kind

        return cpu_kind()
    except ImportError:  # offstep.launch.loader needs Hydra
        return platform.machine()
