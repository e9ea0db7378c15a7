"""Staleness on a real model (SmolLM2-135M-Instruct): the synchronous loop, one-step, batch mode at
k = 4, and the fully asynchronous mode at k = 4 with the decoupled correction and without any (naive
PPO), per seed. Held-out accuracy, when each run first gains 10 points, and the samples that crossed
a weight load. AReaL's question: does the correction hold where naive PPO degrades?

    .venv/bin/python -m benchmarks.staleness_runs --only fully_async_k4,fully_async_k4_naive --seeds 0,1,2
    .venv/bin/python -m benchmarks.staleness_runs --seeds 0 --only sync
    .venv/bin/python -m benchmarks.staleness_runs --table        # the table from the rows so far

Loads land inside samples only where a sample outlasts the update. On CPUs the update is the longer
side (the trainer does about 4x the rollout's arithmetic per token), so the runs take the default
preset with room for long answers (``rollout.max_new_tokens=1024``): most answers are short, a few
ramble on for hundreds of tokens, and those are still decoding when the next weights load
(``rollout/partial_samples``). Half the default batch (4 prompts x 4 samples) keeps a run near ten
minutes. Each row runs into ``runs/bench_presets/LABEL/seedN`` (``benchmarks.preset_runs``) and adds one row per
(label, seed, CPU kind) to ``results/results_staleness.jsonl``; every call rewrites
``results/results_staleness.md`` and its section of ``benchmarks/README.md``. A seed draws its own
split of the task, so the held-out set differs by seed; rows compare on the same seeds.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import NOT_RECORDED, RESULTS, mean_range, provenance, rows_command
from benchmarks.preset_runs import run_choices, run_dir
from benchmarks.readme import refresh
from benchmarks.training_runs import read_jsonl

BASE = [
    "rollout.max_new_tokens=1024",
    "actor.micro_token_budget=2048",
    "data.train_batch_size=4",
    "trainer.total_steps=12",
    "trainer.val_freq=4",
]
ROWS: dict[str, tuple[str, list[str]]] = {
    "sync": ("batch mode, k = 0: the synchronous loop", ["pipeline.mode=batch", "pipeline.max_staleness=0"]),
    "one_step": ("batch mode, k = 1 (the default)", ["pipeline.mode=batch", "pipeline.max_staleness=1"]),
    "batch_k4": ("batch mode, k = 4", ["pipeline.mode=batch", "pipeline.max_staleness=4"]),
    "fully_async_k4": (
        "fully asynchronous, k = 4, decoupled correction (the default)",
        ["pipeline.mode=fully_async", "pipeline.max_staleness=4", "algorithm.correction_mode=decoupled"],
    ),
    "fully_async_k4_naive": (
        "fully asynchronous, k = 4, no correction (naive PPO)",
        ["pipeline.mode=fully_async", "pipeline.max_staleness=4", "algorithm.correction_mode=off"],
    ),
}
GAIN = 0.10  # "reaches it": the first validation at least this far above the run's step 0
STORE = RESULTS / "results_staleness.jsonl"
OUT = RESULTS / "results_staleness.md"


def per_step(label: str, seed: int) -> dict:
    """What the row adds from the run's records: samples that crossed a load, staleness and the
    training seconds, per step."""
    steps = [m for m in read_jsonl(run_dir(label, seed) / "metrics.jsonl") if m["step"] >= 1 and "reward/mean" in m]
    return {
        "partial": [int(m.get("rollout/partial_samples", 0)) for m in steps],
        "staleness": [m.get("rollout/staleness_mean", 0.0) for m in steps],
        "train_s": [m.get("timing_s/step", 0.0) for m in steps],
        "length_max": [m.get("response_length/max", 0.0) for m in steps],
    }


def reached(row: dict) -> tuple[int, float] | None:
    """(step, training seconds up to it) of the first validation at least GAIN above step 0."""
    curve = row["val_curve"]
    for step, acc in curve[1:]:
        if acc >= curve[0][1] + GAIN - 1e-9:
            return step, sum(row["train_s"][:step])
    return None


def write_table(rows: list[dict], out: Path) -> str:
    labels = [r for r in ROWS if any(x["label"] == r for x in rows)]
    lines = [
        "# Staleness on a real model",
        "",
        provenance(rows_command(__file__, sorted(rows, key=lambda r: labels.index(r["label"])))),
        "",
        f"`preset=default` with `{' '.join(BASE)}`, then each row's keys. Held-out accuracy in points (greedy, "
        "200 problems; the standard error of one is about 3.5 points at 50%): mean (range) over the seeds. "
        f"`reaches +{100 * GAIN:.0f}`: the first validation {100 * GAIN:.0f} points above the run's step 0, as "
        "the step and the training seconds up to it (steps summed, validations left out), for the seeds that "
        "reach it. Partial samples: trained samples whose tokens came from more than one policy version, "
        "summed over the run.",
        "",
        "| row | seeds | step 0 | last | peak | reaches +10: step | seconds | not reached | partial samples | "
        "staleness mean | step s | minutes | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in labels:
        for cpu in sorted({r.get("cpu", NOT_RECORDED) for r in rows if r["label"] == label}):
            rs = sorted(
                (r for r in rows if r["label"] == label and r.get("cpu", NOT_RECORDED) == cpu), key=lambda r: r["seed"]
            )
            hit = [h for h in map(reached, rs) if h is not None]
            lines.append(
                f"| {label} | {','.join(str(r['seed']) for r in rs)} | {mean_range([r['val_curve'][0][1] for r in rs])} | "
                f"{mean_range([r['val_curve'][-1][1] for r in rs])} | {mean_range([max(a for _, a in r['val_curve']) for r in rs])} | "
                f"{mean_range([s for s, _ in hit], 1, 0)} | {mean_range([t for _, t in hit], 1, 0)} | {len(rs) - len(hit)} | "
                f"{mean_range([sum(r['partial']) for r in rs], 1, 0)} | "
                f"{mean_range([statistics.mean(r['staleness']) for r in rs], 1, 2)} | "
                f"{statistics.median(r['step_s'] for r in rs):.1f} | {mean_range([r['wall_s'] for r in rs], 1 / 60)} | {cpu} |"
            )
    lines += ["", "Each seed (held-out points at each validation, step in brackets; partial samples per step):", ""]
    for r in sorted(rows, key=lambda r: (labels.index(r["label"]), r["seed"])):
        curve = ", ".join(f"{100 * a:.1f} ({s})" for s, a in r["val_curve"])
        lines.append(
            f"- {r['label']}, seed {r['seed']} ({r.get('cpu', NOT_RECORDED)}, load {r['load'][0]} / {r['load'][1]}): "
            f"{curve}; partial {r['partial']}"
        )
    lines += ["", "The rows (keys after the base):", ""]
    lines += [f"- `{label}`: {about}. `{' '.join(extra)}`" for label, (about, extra) in ROWS.items() if label in labels]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main() -> None:
    rows = run_choices(__doc__, ROWS, STORE, BASE, per_step, ("label", "seed", "val_curve", "partial", "wall_s"))
    print(write_table(rows, OUT))
    refresh("staleness", OUT)


if __name__ == "__main__":
    main()
