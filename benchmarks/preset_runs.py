"""A preset (or a variant of one) trained per seed: held-out accuracy before and after, and the step split.

    .venv/bin/python benchmarks/preset_runs.py --preset code --seeds 0,1,2
    .venv/bin/python benchmarks/preset_runs.py --preset calculator_openai --seeds 0,1
    .venv/bin/python benchmarks/preset_runs.py --label judge_only --preset default --seeds 0 --extra reward.model.kind=generative ...
    .venv/bin/python benchmarks/preset_runs.py --table        # the tables from the rows so far

Each run trains the preset as it ships (its own steps and validation), with ``--extra`` overrides
under its ``--label``, and appends one row per (label, seed) to ``--rows`` (JSON lines; a rerun
replaces its row). Every call rewrites ``benchmarks/results_presets.md`` from all rows: per seed,
then the mean and range per label. The seed also draws the task's problems, so each seed has its own
held-out set; labels compare side by side only on the same seeds.

The step split: ``timing_s/gen`` is the rollout's time for the step's batch (rule rewards, sandbox
runs and tool calls included, as they run on the rollout worker), ``timing_s/wait_gen`` the trainer's
wait for it, ``timing_s/update_actor`` the update; ``score s`` is the step's scoring seconds summed
over its calls: the sandbox's executions (code rewards; ``sandbox.concurrency`` of them run at once,
beside the generation) or the reward model's batches (``timing_s/reward_model``). Medians over
steps 2 and later (step 1 includes the pipeline's fill).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from readme import NOT_RECORDED, cpu_kind, refresh  # noqa: E402
from training_runs import train_and_read  # noqa: E402

KEPT = ("timing_s/", "sandbox/", "reward/", "agent/", "val/", "rollout/")  # per-step metrics a row keeps (medians)


def _score_s(m: dict) -> float:
    """Seconds of scoring in one step record: sandbox executions or reward-model batches."""
    return m.get("sandbox/executions", 0) * m.get("sandbox/seconds_mean", 0.0) + m.get("timing_s/reward_model", 0.0)


def run_one(label: str, preset: str, seed: int, extra: list[str], steps: int | None) -> dict:
    from offstep.config.loader import load_config

    shipped = load_config([f"preset={preset}", *extra]).trainer  # the preset's own steps and validation
    steps = steps or shipped.total_steps
    out = Path("runs") / "bench_presets" / label / f"seed{seed}"
    load0 = os.getloadavg()[0]
    run = train_and_read([f"preset={preset}", f"trainer.seed={seed}", *extra], out, steps,
                         val_freq=min(shipped.val_freq, steps) if shipped.val_freq > 0 else 0)
    load1 = os.getloadavg()[0]
    val = [m for m in run.metrics if "val/acc" in m]
    later = run.steps[1:] or run.steps

    def med(key: str) -> float:
        vals = [m[key] for m in later if key in m]
        return statistics.median(vals) if vals else 0.0

    keys = sorted({k for m in later for k in m if k.startswith(KEPT) and isinstance(m[k], (int, float))})
    return {
        "label": label, "preset": preset, "seed": seed, "extra": extra, "steps": steps,
        "val_curve": [(m["step"], m["val/acc"]) for m in val],
        "val_first": {k: v for k, v in val[0].items() if k.startswith("val/")},
        "val_last": {k: v for k, v in val[-1].items() if k.startswith("val/")},
        "rewards": run.rewards, "reward_first3": run.reward(first=True), "reward_last3": run.reward(first=False),
        "medians": {k: med(k) for k in keys}, "score_s": statistics.median(_score_s(m) for m in later),
        "wall_s": run.wall_s, "step_s": run.median("timing_s/step"), "load": [round(load0, 1), round(load1, 1)],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpu": cpu_kind(),
    }


def _spread(values: list[float], pct: bool) -> str:
    f = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.2f}")
    return f"{f(statistics.mean(values))} ({f(min(values))}–{f(max(values))})" if len(values) > 1 else f(values[0])


def _partial(medians: dict) -> str:
    """The median step's samples that crossed a weight load (pipeline.mode=fully_async); "—" in batch mode."""
    key = "rollout/partial_samples"
    return f"{medians[key]:.0f}" if key in medians else "—"


def write_table(rows: list[dict], out: Path, remark: str) -> str:
    import torch

    pct = lambda v: f"{100 * v:.0f}%"  # noqa: E731
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [
        "# Presets trained per seed: held-out accuracy before and after, and the step split",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}. Each preset as it ships (its steps, its validation: held-out problems, greedy), "
        "one run at a time; a label's overrides are listed below its table.",
        *([f"", remark] if remark else []),
        "",
        "Per seed (val acc: held-out, at each validation; reward: the training batch's mean; seconds: medians over "
        "steps 2 and later):",
        "",
        "| label | seed | val acc, before → after | val acc by validation | reward, first 3 / last 3 steps | step s | gen s "
        "| trainer's wait s | update s | score s | partial samples | wall min | CPU | load, start / end | finished (UTC) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["medians"]
        curve = " / ".join(pct(a) for _, a in r["val_curve"])
        lines.append(
            f"| {r['label']} | {r['seed']} | {pct(r['val_curve'][0][1])} → {pct(r['val_curve'][-1][1])} | {curve} | "
            f"{r['reward_first3']:.2f} / {r['reward_last3']:.2f} | {r['step_s']:.1f} | {m.get('timing_s/gen', 0):.1f} | "
            f"{m.get('timing_s/wait_gen', 0):.1f} | {m.get('timing_s/update_actor', 0):.1f} | {r['score_s']:.1f} | "
            f"{_partial(m)} | {r['wall_s'] / 60:.1f} | {r.get('cpu', NOT_RECORDED)} | {r['load'][0]} / {r['load'][1]} | {r['finished_utc']} |")
    lines += ["", "Mean (range) per label over its seeds:", "",
              "| label | seeds | val acc before | val acc after | reward first 3 | reward last 3 | step s | gen s | "
              "trainer's wait s | update s | score s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label in labels:
        rs = [r for r in rows if r["label"] == label]
        med = lambda key: _spread([r["medians"].get(key, 0.0) for r in rs], False)  # noqa: E731
        lines.append(
            f"| {label} | {', '.join(str(r['seed']) for r in rs)} | {_spread([r['val_curve'][0][1] for r in rs], True)} | "
            f"{_spread([r['val_curve'][-1][1] for r in rs], True)} | {_spread([r['reward_first3'] for r in rs], False)} | "
            f"{_spread([r['reward_last3'] for r in rs], False)} | {_spread([r['step_s'] for r in rs], False)} | "
            f"{med('timing_s/gen')} | {med('timing_s/wait_gen')} | {med('timing_s/update_actor')} | "
            f"{_spread([r['score_s'] for r in rs], False)} |")
    lines += ["", "Labels:", ""]
    for label in labels:
        r = next(r for r in rows if r["label"] == label)
        lines.append(f"- `{label}`: `preset={r['preset']}`" + "".join(f" `{e}`" for e in r["extra"])
                     + f"; regenerate with `.venv/bin/python benchmarks/preset_runs.py --label {label} --preset "
                     f"{r['preset']} --seeds {','.join(str(x['seed']) for x in rows if x['label'] == label)}"
                     + (f" --extra {' '.join(r['extra'])}" if r["extra"] else "") + "`.")
    lines += ["", "Regenerate the tables from the stored rows: `.venv/bin/python benchmarks/preset_runs.py --table`."]
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--label", default="", help="the rows' name (default: the preset's)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds to run now (each replaces its earlier row)")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides on top of the preset (part of the label)")
    ap.add_argument("--steps", type=int, default=None, help="a smoke run: fewer steps (not for the results)")
    ap.add_argument("--table", action="store_true", help="only rewrite the results file from --rows")
    ap.add_argument("--rows", default=str(HERE / "results_presets.jsonl"))
    ap.add_argument("--remark", default="", help="a sentence for the results file (what else ran on the machine)")
    ap.add_argument("--out", default=str(HERE / "results_presets.md"))
    args = ap.parse_args()
    label = args.label or args.preset
    rows_path = Path(args.rows)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()] if rows_path.exists() else []
    for seed in ([] if args.table else [int(s) for s in args.seeds.split(",") if s]):
        row = run_one(label, args.preset, seed, args.extra, args.steps)
        rows = [r for r in rows if (r["label"], r["seed"]) != (label, seed)] + [row]
        rows.sort(key=lambda r: (r["label"], r["seed"]))
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(json.dumps(row), flush=True)
    print(write_table(rows, Path(args.out), args.remark))
    refresh("presets", args.out)


if __name__ == "__main__":
    main()
