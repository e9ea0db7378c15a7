"""One-step off-policy vs synchronous: step time measured side by side in one run.

For each preset, three runs of the same number of steps on the same machine, one after another:

* ``sync-colocated``: k = 0, rollout and trainer share all cores (each phase uses every core) —
  the equal-total-cores baseline;
* ``sync-disjoint``: k = 0 on the same disjoint pools as one-step (1 + 1 cores on 2 cores) —
  isolates what the overlap itself hides;
* ``one-step``: k = 1 on disjoint pools;
* ``one-step+ref-on-rollout``: the same, with the reference log-probs computed by the rollout
  worker after generating (``pipeline.ref_on_rollout=true``), off the trainer's critical path.

Reported: the median ``timing_s/step`` over steps 2..N (step 1 includes warm-up), the median
rollout-busy (generation, plus reference log-probs where the rollout computes them) and
trainer-busy time, and the overlap efficiency of the one-step run,
``(max(busy generation, busy training) + sync) / step time`` (1.0 is the physical limit).

    python -m benchmarks.overlap                      # tiny and default presets
    python -m benchmarks.overlap --presets tiny --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh

MODES = {
    "sync-colocated": [
        "pipeline.max_staleness=0",
        "pipeline.colocate=true",
        "resources.cpus_per_trainer_worker={cores}",
        "pipeline.ref_on_rollout=false",
    ],
    "sync-disjoint": ["pipeline.max_staleness=0", "pipeline.ref_on_rollout=false"],
    "one-step": ["pipeline.max_staleness=1", "pipeline.ref_on_rollout=false"],
    "one-step+ref-on-rollout": ["pipeline.max_staleness=1", "pipeline.ref_on_rollout=true"],
}


def run(preset: str, mode: str, steps: int, cores: int, out: Path) -> list[dict]:
    overrides = [
        f"preset={preset}",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.progress=off",
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        *[o.format(cores=cores) for o in MODES[mode]],
    ]
    cmd = [sys.executable, "-m", "offstep.cli", "train", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]


TRAINER_STAGES = (
    "timing_s/ref",
    "timing_s/values",
    "timing_s/old_logprobs",
    "timing_s/update_critic",
    "timing_s/update_actor",
)


def busy(m: dict) -> float:
    return sum(m.get(k, 0.0) for k in TRAINER_STAGES)


def rollout_busy(m: dict) -> float:
    return m["timing_s/gen"] + m.get("timing_s/ref_rollout", 0.0)


def summarise(metrics: list[dict]) -> dict:
    ms = [m for m in metrics if m.get("step", 0) >= 2 and "timing_s/step" in m]
    med = lambda key: statistics.median(key(m) for m in ms)  # noqa: E731
    step, gen, train, sync = (
        med(lambda m: m["timing_s/step"]),
        med(rollout_busy),
        med(busy),
        med(lambda m: m["timing_s/sync_weights"]),
    )
    return {"step": step, "gen": gen, "train": train, "sync": sync, "efficiency": (max(gen, train) + sync) / step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "default"])
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: 10 tiny, 6 default)")
    ap.add_argument("--out", default=str(RESULTS / "results_overlap.md"))
    args = ap.parse_args()
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            steps = args.steps or (10 if preset == "tiny" else 6)
            res = {}
            for mode in MODES:
                res[mode] = summarise(run(preset, mode, steps, cores, Path(tmp) / f"{preset}-{mode}"))
                print(preset, mode, {k: round(v, 3) for k, v in res[mode].items()}, flush=True)
            base = res["sync-colocated"]["step"]
            for mode, r in res.items():
                rows.append(
                    f"| {preset} | {mode} | {r['step']:.2f} | {r['gen']:.2f} | {r['train']:.2f} | {r['sync']:.2f} | "
                    f"{base / r['step']:.2f}x | {r['efficiency']:.2f} |"
                )
    table = "\n".join(
        [
            provenance(),
            "",
            f"Machine: {platform.machine()}, {cores} cores, {platform.python_version()}; medians over steps 2..N of one run each, "
            f"run one after another by `python -m benchmarks.overlap`.",
            "",
            "| preset | mode | step s | rollout busy s | trainer busy s | sync s | speed vs sync-colocated | overlap efficiency |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    Path(args.out).write_text(table + "\n")
    print(table)
    refresh("overlap", args.out)


if __name__ == "__main__":
    main()
