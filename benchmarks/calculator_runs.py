"""``preset=calculator`` per seed: does SmolLM2-135M learn to use the calculator tool?

    .venv/bin/python -m benchmarks.calculator_runs --seeds 0      # one run (10-20 min on 2 cores)
    .venv/bin/python -m benchmarks.calculator_runs --table        # the table from the runs so far

Trains the preset as it ships (12 steps, validation at steps 0, 6 and 12) once per seed; the seed
also draws the task's problems, so each seed has its own 32 held-out ones. Per run it records,
from the run's own validation (greedy, the tool loop, the task's scorer: a number counts only in a
plain final answer): accuracy, the share of samples with a well-formed call, the share of call
attempts that are well-formed, and the share of samples cut by the token budget, before and after
training; the training reward (first and last 3 steps) and budget-cut share; the wall time and
median step time; and the baseline: the untrained model on the same held-out problems as plain
questions without tools (task option ``tools=false``, greedy, the same token budget), through
``offstep eval``'s code path. Each run appends its row to ``--rows`` (JSON lines); every call
rewrites ``benchmarks/results/results_calculator.md`` from all rows there: per seed, then mean and range.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.common import NOT_RECORDED, RESULTS, cpu_kind
from benchmarks.readme import refresh
from benchmarks.training_runs import train_and_read

STEPS, VAL_FREQ = 12, 6  # the preset's own (offstep/config/preset/calculator.yaml)


def no_tool_baseline(cfg, out: Path) -> float:
    """Greedy accuracy of the untrained model on the run's held-out problems asked without tools."""
    from offstep.data.tasks import write_task
    from offstep.pipeline.evaluation import run_eval

    d = cfg.data
    _, val = write_task(
        d.task,
        str(out / "no_tools"),
        d.task_train_size,
        d.task_val_size,
        cfg.trainer.seed,
        **{**d.task_options, "tools": False},
    )
    metrics, _ = run_eval(cfg.model.path, val, max_new_tokens=cfg.rollout.max_new_tokens, threads=2)
    return metrics["acc"]


def run_one(seed: int, out: Path, steps: int = STEPS, val_freq: int = VAL_FREQ, extra: tuple[str, ...] = ()) -> dict:
    load0 = os.getloadavg()[0]
    run = train_and_read(["preset=calculator", f"trainer.seed={seed}", *extra], out, steps, val_freq=val_freq)
    load1 = os.getloadavg()[0]
    val = [m for m in run.metrics if "val/acc" in m]
    first, last = val[0], val[-1]

    def held_out(m: dict) -> dict:
        return {
            "acc": m["val/acc"],
            "tool_use": m.get("val/agent/tool_use_frac", 0.0),
            "well_formed": m.get("val/agent/well_formed_calls/frac", 0.0),
            "budget_cut": m.get("val/agent/budget_cut_frac", 0.0),
        }

    return {
        "seed": seed,
        "start": held_out(first),
        "end": held_out(last),
        "val_curve": [(m["step"], m["val/acc"]) for m in val],
        "no_tools": no_tool_baseline(run.cfg, out),
        "reward_first3": run.reward(first=True),
        "reward_last3": run.reward(first=False),
        "rewards": [m["reward/mean"] for m in run.steps],
        "train_budget_cut_first": run.steps[0].get("agent/budget_cut_frac", 0.0),
        "train_budget_cut_last": run.steps[-1].get("agent/budget_cut_frac", 0.0),
        "train_tool_use_first": run.steps[0].get("agent/tool_use_frac", 0.0),
        "train_tool_use_last": run.steps[-1].get("agent/tool_use_frac", 0.0),
        "calls_per_sample_last": run.steps[-1].get("agent/tool_calls/mean", 0.0),
        "wall_s": run.wall_s,
        "step_s": run.median("timing_s/step"),
        "load": [round(load0, 1), round(load1, 1)],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu": cpu_kind(),
    }


def _spread(values: list[float], pct: bool) -> str:
    f = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.2f}")
    return f"{f(statistics.mean(values))} ({f(min(values))}–{f(max(values))})"


def summary_rows(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(what, start, end) with the mean and range over the seeds: the table in benchmarks/README.md."""

    def col(key: str, at: str) -> list[float]:
        return [r[at][key] for r in rows]

    return [
        ("held-out accuracy, no tools (untrained)", _spread([r["no_tools"] for r in rows], True), "–"),
        ("held-out accuracy, with tools", _spread(col("acc", "start"), True), _spread(col("acc", "end"), True)),
        (
            "held-out samples with a well-formed call",
            _spread(col("tool_use", "start"), True),
            _spread(col("tool_use", "end"), True),
        ),
        (
            "held-out call attempts well-formed",
            _spread(col("well_formed", "start"), True),
            _spread(col("well_formed", "end"), True),
        ),
        (
            "held-out samples cut by the token budget",
            _spread(col("budget_cut", "start"), True),
            _spread(col("budget_cut", "end"), True),
        ),
        (
            "training reward, first / last 3 steps",
            _spread([r["reward_first3"] for r in rows], False),
            _spread([r["reward_last3"] for r in rows], False),
        ),
        (
            "training samples with a well-formed call, step 1 / last",
            _spread([r["train_tool_use_first"] for r in rows], True),
            _spread([r["train_tool_use_last"] for r in rows], True),
        ),
    ]


def write_table(rows: list[dict], out: Path, remark: str) -> str:
    import torch

    pct = lambda v: f"{100 * v:.0f}%"  # noqa: E731
    lines = [
        "# preset=calculator: learning to use the calculator tool, per seed",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}. The preset as it ships ({STEPS} steps, validation at 0, {VAL_FREQ} and {STEPS}: "
        "32 held-out problems, greedy); one run at a time.",
        "CPU of each seed's run: " + "; ".join(f"{r['seed']}: {r.get('cpu', NOT_RECORDED)}" for r in rows) + ".",
        *(["", remark] if remark else []),
        "",
        "Held-out, before → after training (with tools; the scorer counts a number only in a plain final answer, "
        "not inside a call, not when the token budget cut the loop):",
        "",
        "| seed | no tools (untrained) | accuracy | samples with a well-formed call | attempts well-formed | cut by budget "
        "| val acc at 0 / 6 / 12 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        s, e = r["start"], r["end"]
        lines.append(
            f"| {r['seed']} | {pct(r['no_tools'])} | {pct(s['acc'])} → {pct(e['acc'])} | {pct(s['tool_use'])} → "
            f"{pct(e['tool_use'])} | {pct(s['well_formed'])} → {pct(e['well_formed'])} | {pct(s['budget_cut'])} → "
            f"{pct(e['budget_cut'])} | {' / '.join(pct(a) for _, a in r['val_curve'])} |"
        )
    lines += [
        "",
        "Training (T = 1, 8 prompts x 4 samples a step):",
        "",
        "| seed | reward, first 3 / last 3 steps | reward by step | samples with a well-formed call, step 1 → last "
        "| cut by budget, step 1 → last | calls per sample, last step | wall s | median step s "
        "| load average, start / end | finished (UTC) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['reward_first3']:.2f} / {r['reward_last3']:.2f} | "
            f"{' '.join(f'{v:.2f}' for v in r['rewards'])} | {pct(r['train_tool_use_first'])} → "
            f"{pct(r['train_tool_use_last'])} | {pct(r['train_budget_cut_first'])} → {pct(r['train_budget_cut_last'])} | "
            f"{r['calls_per_sample_last']:.2f} | {r['wall_s']:.0f} | "
            f"{r['step_s']:.0f} | {r['load'][0]} / {r['load'][1]} | {r['finished_utc']} |"
        )
    if len(rows) > 1:
        lines += [
            "",
            f"Mean (range) over seeds {', '.join(str(r['seed']) for r in rows)}:",
            "",
            "| | before | after |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {what} | {a} | {b} |" for what, a, b in summary_rows(rows)]
        lines += [
            "",
            f"Wall time {_spread([r['wall_s'] / 60 for r in rows], False)} min, median step "
            f"{_spread([r['step_s'] for r in rows], False)} s.",
        ]
    lines += [
        "",
        "Regenerate: `.venv/bin/python -m benchmarks.calculator_runs --seeds 0`, then `--seeds 1`, `--seeds 2` "
        "(each run under `flock /tmp/offstep-heavy.lock` on a shared machine), then `--table`.",
    ]
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="", help="comma-separated seeds to run now (each replaces its earlier row)")
    ap.add_argument("--table", action="store_true", help="only rewrite the results file from --rows")
    ap.add_argument("--rows", default=str(RESULTS / "results_calculator.jsonl"))
    ap.add_argument("--remark", default="", help="a sentence for the results file (what else ran on the machine)")
    ap.add_argument("--out", default=str(RESULTS / "results_calculator.md"))
    ap.add_argument("--steps", type=int, default=STEPS, help="a smoke run of this script: fewer steps (with --extra)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides, for a smoke run (not for the results)")
    args = ap.parse_args()
    rows_path = Path(args.rows)
    rows = (
        [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()] if rows_path.exists() else []
    )
    for seed in [] if args.table else [int(s) for s in args.seeds.split(",") if s]:
        row = run_one(
            seed,
            Path("runs") / "bench_calculator" / f"seed{seed}",
            args.steps,
            min(VAL_FREQ, args.steps),
            tuple(args.extra),
        )
        rows = [r for r in rows if r["seed"] != seed] + [row]
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["seed"])))
        print(json.dumps(row), flush=True)
    print(write_table(sorted(rows, key=lambda r: r["seed"]), Path(args.out), args.remark))
    refresh("calculator", args.out)


if __name__ == "__main__":
    main()
