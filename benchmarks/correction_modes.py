"""Final reward of one-step off-policy training with each off-policy correction mode, against
the synchronous run: same preset, seed and number of steps.

    .venv/bin/python -m benchmarks.correction_modes [--preset default] [--steps 12]

Runs, one after another: k=0 (synchronous, decoupled correction: the reference), then k=1 with
``algorithm.correction_mode`` = decoupled (a), bypass (b) and off (c). Writes
``benchmarks/results/results_correction.md``: mean training reward over the first and last 5 steps, the
final validation accuracy, the largest mismatch KL and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train

RUNS = [
    ("synchronous (k=0)", ["pipeline.max_staleness=0", "algorithm.correction_mode=decoupled"]),
    ("one-step, (a) decoupled", ["pipeline.max_staleness=1", "algorithm.correction_mode=decoupled"]),
    ("one-step, (b) bypass", ["pipeline.max_staleness=1", "algorithm.correction_mode=bypass"]),
    ("one-step, (c) off", ["pipeline.max_staleness=1", "algorithm.correction_mode=off"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "results_correction.md"))
    args = ap.parse_args()
    rows = []
    for name, extra in RUNS:
        out = Path("runs") / "bench_correction" / name.split()[0].strip(",") / extra[1].split("=")[1]
        # A rerun moves the previous run's folder aside (trainer.overwrite) rather than refusing.
        cfg = load_config(
            [
                f"preset={args.preset}",
                f"trainer.total_steps={args.steps}",
                f"trainer.seed={args.seed}",
                f"trainer.output_dir={out}",
                "trainer.overwrite=true",
                f"trainer.val_freq={args.steps}",
                "trainer.progress=plain",
                *extra,
            ]
        )
        t0 = time.time()
        history = train(cfg)
        steps = [m for m in history if "reward/mean" in m]
        rewards = [m["reward/mean"] for m in steps]
        val = [m["val/acc"] for m in history if "val/acc" in m]
        mism = [m.get("actor/mismatch_kl_k1", 0.0) or 0.0 for m in steps]
        rows.append(
            (
                name,
                statistics.mean(rewards[:5]),
                statistics.mean(rewards[-5:]),
                val[0] if val else float("nan"),
                val[-1] if val else float("nan"),
                max(mism),
                statistics.median(m["timing_s/step"] for m in steps[1:]),
                time.time() - t0,
            )
        )
    lines = [
        provenance(),
        "",
        f"Preset `{args.preset}`, {args.steps} steps, seed {args.seed}; one run per row, one after another.",
        "",
        "| run | reward, first 5 steps | reward, last 5 steps | val acc before | val acc after | max mismatch KL (k1) | median step s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r0, r1, v0, v1, mk, st, _ in rows:
        lines.append(f"| {name} | {r0:.3f} | {r1:.3f} | {v0:.3f} | {v1:.3f} | {mk:.4f} | {st:.1f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    refresh("correction", args.out)


if __name__ == "__main__":
    main()
