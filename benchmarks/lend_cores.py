"""Cores that never idle: the default preset, one-step, with the rollout's cores lent to the trainer
while the rollout idles (``pipeline.lend_cores=true``) against without, side by side in one run;
with ``--budgets 0 -1`` also the update's micro-batches padded (``actor.micro_token_budget=0``,
the old default) against cut to a token budget (-1, the default), each with and without lending;
with ``--share false true`` also each prompt computed once for its samples (``actor.share_prompts``,
the default) against a padded row per sample (the default preset before and after that change).

For each trainer compute dtype, the settings alternate (off, on, off, on, ...) so that a change
of the host's load falls on all of them. Reported per setting: the median step time over steps 2..N of
its runs, the median rollout-busy and trainer-busy seconds, the seconds the trainer held the
rollout's cores, and the step against the equal-cores limit of the unlent runs: (rollout busy +
trainer busy) / cores, the step if every core-second of work were spread evenly over the cores.

    python -m benchmarks.lend_cores                                # float32 and bfloat16, 2 rounds
    python -m benchmarks.lend_cores --dtypes float32 --rounds 1 --steps 5
    python -m benchmarks.lend_cores --dtypes float32 --rounds 1 --steps 5 --budgets 0 -1
    python -m benchmarks.lend_cores --rounds 1 --steps 5 --share false true
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, cpu_kind, provenance
from benchmarks.overlap import TRAINER_STAGES, rollout_busy
from benchmarks.readme import refresh


def run(dtype: str, budget: int, share: bool, lend: bool, steps: int, out: Path) -> list[dict]:
    overrides = [
        "preset=default",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.progress=off",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_last=false",
        f"model.compute_dtype={dtype}",
        f"pipeline.lend_cores={str(lend).lower()}",
        f"actor.micro_token_budget={budget}",
        f"actor.share_prompts={str(share).lower()}",
    ]
    subprocess.run([sys.executable, "-m", "offstep.cli", "train", *overrides], check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]


def summarise(runs: list[list[dict]]) -> dict:
    ms = [m for metrics in runs for m in metrics if m.get("step", 0) >= 2 and "timing_s/step" in m]
    med = lambda key: statistics.median(key(m) for m in ms)  # noqa: E731
    return {
        "step": med(lambda m: m["timing_s/step"]),
        "rollout": med(rollout_busy),
        "trainer": med(lambda m: sum(m.get(k, 0.0) for k in TRAINER_STAGES)),
        "update": med(lambda m: m["timing_s/update_actor"]),
        "lent": med(lambda m: m.get("perf/lent_cores_s", 0.0)),
        "steps": len(ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs per dtype")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (step 1, with warm-up, is not counted)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[-1], help="actor.micro_token_budget values to compare")
    ap.add_argument(
        "--share", nargs="+", choices=["false", "true"], default=["true"], help="actor.share_prompts values to compare"
    )
    ap.add_argument("--out", default=str(RESULTS / "results_lend.md"))
    args = ap.parse_args()
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            settings = [
                (budget, share == "true", lend)
                for budget in args.budgets
                for share in args.share
                for lend in (False, True)
            ]
            runs: dict[tuple, list] = {s: [] for s in settings}
            for r in range(args.rounds):
                for budget, share, lend in settings:
                    runs[budget, share, lend].append(
                        run(dtype, budget, share, lend, args.steps, Path(tmp) / f"{dtype}-{budget}-{share}-{lend}-{r}")
                    )
                    print(
                        dtype,
                        f"budget {budget}",
                        f"share_prompts {share}",
                        "lend" if lend else "own cores",
                        r,
                        flush=True,
                    )
            res = {s: summarise(v) for s, v in runs.items()}
            first = res[settings[0]]
            for (budget, share, lend), s in res.items():
                unlent = res[budget, share, False]  # the limit of this work: its unlent runs' busy seconds
                limit = (unlent["rollout"] + unlent["trainer"]) / cores
                rows.append(
                    f"| {dtype} | {budget} | {'on' if share else 'off'} | {'on' if lend else 'off'} | {s['step']:.2f} | "
                    f"{s['update']:.2f} | {s['rollout']:.2f} | {s['rollout'] / s['step']:.0%} | {s['trainer']:.2f} | "
                    f"{s['lent']:.2f} | {limit:.2f} | {s['step'] / limit:.2f} | {first['step'] / s['step']:.2f}x | {s['steps']} |"
                )
    table = "\n".join(
        [
            provenance(),
            "",
            f"Machine: {cores} cores ({cpu_kind()}); the default preset, one-step (`pipeline.ref_on_rollout=true`), "
            f"{args.rounds} alternating round(s) of {args.steps}-step runs per dtype and setting, medians over steps 2..N of a "
            f"setting's runs. Limit: (rollout busy + trainer busy) / cores of the unlent runs of the same "
            f"`actor.micro_token_budget` and `actor.share_prompts`. Rollout busy share: rollout busy / step. Speed: against "
            f"the dtype's first row.",
            "",
            "| compute dtype | micro_token_budget | share_prompts | lend_cores | step s | update s | rollout busy s | "
            "rollout busy share | trainer busy s | lent s | equal-cores limit s | step / limit | speed vs first row | steps |",
            "| --- " * 14 + "|",
            *rows,
        ]
    )
    Path(args.out).write_text(table + "\n")
    print(table)
    refresh("lend", args.out)


if __name__ == "__main__":
    main()
