"""The default preset (SmolLM2-135M-Instruct, GRPO on arithmetic, 1 + 1 cores) in the fully
asynchronous mode against the one-step batch mode, over several seeds, one run after another:
step time, the trainer's wait for generation, partial samples per step, reward and validation
accuracy.

    .venv/bin/python benchmarks/async_real.py [--steps 10] [--seeds 0 1 2]   # writes results_async_real.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora import cpu_kind  # noqa: E402
from readme import provenance, refresh  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "results_async_real.md"
MODES = {
    "one-step (batch, k=1)": ["pipeline.mode=batch", "pipeline.max_staleness=1"],
    "fully_async (k=1, keep)": ["pipeline.mode=fully_async", "pipeline.max_staleness=1", "rollout.partial=keep"],
}


def run(overrides: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "offstep.cli", "train", *overrides, f"trainer.output_dir={out}", "trainer.progress=off",
           "trainer.save_last=false"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(metrics: list[dict]) -> dict:
    steps = [m for m in metrics if m["step"] >= 1]
    val = [m for m in metrics if "val/acc" in m]
    later = steps[1:] or steps
    return {
        "step_s": statistics.median(m["timing_s/step"] for m in later),
        "wait_s": statistics.mean(m["timing_s/wait_gen"] for m in later),
        "partial": statistics.mean(m.get("rollout/partial_samples", 0) for m in steps),
        "reward_first3": statistics.mean(m["reward/mean"] for m in steps[:3]),
        "reward_last3": statistics.mean(m["reward/mean"] for m in steps[-3:]),
        "val_before": val[0]["val/acc"] if val else float("nan"),
        "val_after": val[-1]["val/acc"] if val else float("nan"),
    }


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args()
    rows: dict[str, list[dict]] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        for seed in a.seeds:
            for name, extra in MODES.items():
                out = Path(work) / f"{name.split()[0]}-{seed}"
                over = [f"trainer.seed={seed}", f"trainer.total_steps={a.steps}", f"trainer.val_freq={a.steps}", *extra]
                s = summary(run(over, out))
                rows.setdefault(name, []).append({"seed": seed, **s})
                print(name, seed, s, flush=True)
    lines = [
        "# The default preset: fully asynchronous against one-step",
        "",
        provenance(),
        "",
        f"`.venv/bin/python benchmarks/async_real.py --steps {a.steps} --seeds {' '.join(map(str, a.seeds))}` on "
        f"{cpu_kind()}; {time.strftime('%Y-%m-%d')}; {time.time() - t0:.0f} s in all, one run after another. The default "
        f"preset, {a.steps} steps, validation (35 held-out problems, greedy) before the first step and after the last. "
        "Step time: median of steps 2 on; wait: the trainer's mean wait for its batch (steps 2 on); partial: samples a "
        "step that crossed a weight load. Per mode: mean (min..max) over the seeds.",
        "",
        "| mode | seeds | step s | trainer wait s | partial samples / step | reward, first 3 steps | reward, last 3 steps | val acc before | val acc after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rs in rows.items():
        lines.append(f"| {name} | {', '.join(str(r['seed']) for r in rs)} | " + " | ".join(
            spread([r[k] for r in rs]) for k in ("step_s", "wait_s", "partial", "reward_first3", "reward_last3",
                                                 "val_before", "val_after")) + " |")
    lines += ["", "Per run:", "", "| mode | seed | step s | wait s | partial | reward first 3 | reward last 3 | val before | val after |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rs in rows.items():
        for r in rs:
            lines.append(f"| {name} | {r['seed']} | {r['step_s']:.1f} | {r['wait_s']:.2f} | {r['partial']:.1f} | "
                         f"{r['reward_first3']:.3f} | {r['reward_last3']:.3f} | {r['val_before']:.3f} | {r['val_after']:.3f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())
    refresh("async-real")


if __name__ == "__main__":
    main()
