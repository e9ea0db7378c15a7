"""A preset (or a variant of one) trained per seed: held-out accuracy before and after, and the step split.

    .venv/bin/python -m benchmarks.preset_runs --preset code --seeds 0,1,2
    .venv/bin/python -m benchmarks.preset_runs --preset calculator_openai --seeds 0,1
    .venv/bin/python -m benchmarks.preset_runs --label judge_only --preset default --seeds 0 --extra reward.model.kind=generative ...
    .venv/bin/python -m benchmarks.preset_runs --table        # the tables from the rows so far
    .venv/bin/python -m benchmarks.preset_runs --label long_tail --seeds 0 --reread   # a row again from its run folder

Each run trains the preset as it ships (its own steps and validation), with ``--extra`` overrides
under its ``--label``, and appends one row per (label, seed) to ``--rows`` (JSON lines; a rerun
on the same kind of CPU replaces its row). Every call rewrites ``benchmarks/results/results_presets.md`` from all rows: per seed,
then the mean and range per label. The seed also draws the task's problems, so each seed has its own
held-out set; labels compare side by side only on the same seeds.

The step split: ``timing_s/gen`` is the rollout's time for the step's batch (rule rewards, sandbox
runs and tool calls included, as they run on the rollout worker), ``timing_s/wait_gen`` the trainer's
wait for it, ``timing_s/update_actor`` the update; ``score s`` is the step's scoring seconds summed
over its calls: the sandbox's executions (code rewards; ``sandbox.concurrency`` of them run at once,
beside the generation) or the reward model's batches (``timing_s/reward_model``). Medians over
steps 2 and later (step 1 includes the pipeline's fill). The trainer's idle share is its waits
summed over those steps, over their step times summed: the median hides a long tail's few long waits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import NOT_RECORDED, RESULTS, cpu_kind
from benchmarks.readme import refresh
from benchmarks.training_runs import Run, read_jsonl, train_and_read

KEPT = ("timing_s/", "sandbox/", "reward/", "agent/", "val/", "rollout/")  # per-step metrics a row keeps (medians)


def _score_s(m: dict) -> float:
    """Seconds of scoring in one step record: sandbox executions or reward-model batches."""
    return m.get("sandbox/executions", 0) * m.get("sandbox/seconds_mean", 0.0) + m.get("timing_s/reward_model", 0.0)


def run_dir(label: str, seed: int) -> Path:
    return Path("runs") / "bench_presets" / label / f"seed{seed}"


def run_one(label: str, preset: str, seed: int, extra: list[str], steps: int | None) -> dict:
    from offstep.launch.loader import load_config

    shipped = load_config([f"preset={preset}", *extra]).trainer  # the preset's own steps and validation
    steps = steps or shipped.total_steps
    load0 = os.getloadavg()[0]
    run = train_and_read(
        [f"preset={preset}", f"trainer.seed={seed}", *extra],
        run_dir(label, seed),
        steps,
        val_freq=min(shipped.val_freq, steps) if shipped.val_freq > 0 else 0,
    )
    load1 = os.getloadavg()[0]
    return {
        **row_of(run, label, preset, seed, extra, steps),
        "wall_s": run.wall_s,
        "load": [round(load0, 1), round(load1, 1)],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu": cpu_kind(),
    }


def reread(row: dict) -> dict:
    """``row`` computed again from its run folder's ``metrics.jsonl`` (when the row's fields grew
    after the run); its wall time, load, finish time and CPU kind are kept."""
    path = run_dir(row["label"], row["seed"]) / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"--reread: {path} does not exist (run the benchmark from the folder that holds runs/)")
    run = Run(None, path.parent, row["wall_s"], read_jsonl(path))
    return {**row, **row_of(run, row["label"], row["preset"], row["seed"], row["extra"], row["steps"])}


def read_rows(path: Path) -> list[dict]:
    """The stored rows of ``path`` (JSON lines); none if it does not exist yet."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def store_row(rows: list[dict], row: dict, path: Path) -> list[dict]:
    """``rows`` with ``row`` in place of an earlier row of its label and seed on the same kind of CPU,
    sorted by label and seed, and written to ``path`` at once (a later run's crash keeps it)."""
    same = lambda r: (r["label"], r["seed"], r.get("cpu", NOT_RECORDED)) == (row["label"], row["seed"], row["cpu"])  # noqa: E731
    rows = sorted([r for r in rows if not same(r)] + [row], key=lambda r: (r["label"], r["seed"]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run_choices(
    doc: str,
    choices: dict[str, tuple[str, list[str]]],
    store: Path,
    base: list[str],
    add: Callable[[str, int], dict],
    shown: tuple[str, ...],
) -> list[dict]:
    """The command line of a script that compares named variants of the default preset
    (``--only``, ``--seeds``, ``--table``): trains each chosen variant on each seed, seed by seed,
    with ``base`` then the variant's overrides; adds ``add(label, seed)``'s fields to its row and
    stores it; prints the ``shown`` fields. Returns all stored rows."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds to run now")
    ap.add_argument("--table", action="store_true", help="only rewrite the table from the stored rows")
    args = ap.parse_args()
    rows = read_rows(store)
    chosen = [c for c in args.only.split(",") if c] or list(choices)
    unknown = [c for c in chosen if c not in choices]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; the variants: {list(choices)}")
    for seed in [] if args.table else [int(s) for s in args.seeds.split(",") if s]:
        for label in chosen:
            row = {**run_one(label, "default", seed, [*base, *choices[label][1]], None), **add(label, seed)}
            rows = store_row(rows, row, store)
            print(json.dumps({k: row[k] for k in shown}), flush=True)
    return rows


def row_of(run: Run, label: str, preset: str, seed: int, extra: list[str], steps: int) -> dict:
    """The row's figures that come from the run's records."""
    val = [m for m in run.metrics if "val/acc" in m]
    later = run.steps[1:] or run.steps

    def med(key: str) -> float:
        vals = [m[key] for m in later if key in m]
        return statistics.median(vals) if vals else 0.0

    keys = sorted({k for m in later for k in m if k.startswith(KEPT) and isinstance(m[k], (int, float))})
    return {
        "label": label,
        "preset": preset,
        "seed": seed,
        "extra": extra,
        "steps": steps,
        "val_curve": [(m["step"], m["val/acc"]) for m in val],
        "val_first": {k: v for k, v in val[0].items() if k.startswith("val/")},
        "val_last": {k: v for k, v in val[-1].items() if k.startswith("val/")},
        "rewards": run.rewards,
        "reward_first3": run.reward(first=True),
        "reward_last3": run.reward(first=False),
        "medians": {k: med(k) for k in keys},
        "score_s": statistics.median(_score_s(m) for m in later),
        "step_s": run.median("timing_s/step"),
        "step_s_each": [m.get("timing_s/step", 0.0) for m in run.steps],
        "wait_s_each": [m.get("timing_s/wait_gen", 0.0) for m in run.steps],
    }


def _idle(row: dict) -> float | None:
    """The trainer's idle share: its wait for generation over the step time, summed over steps 2
    and later (step 1 fills the pipeline); None for rows recorded without each step's wait."""
    if "wait_s_each" not in row:
        return None
    return sum(row["wait_s_each"][1:]) / max(sum(row["step_s_each"][1:]), 1e-9)


def _spread(values: list[float], pct: bool) -> str:
    f = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.2f}")
    return f"{f(statistics.mean(values))} ({f(min(values))}–{f(max(values))})" if len(values) > 1 else f(values[0])


def _partial(medians: dict) -> str:
    """The median step's samples that crossed a weight load (pipeline.mode=fully_async); "—" in batch mode."""
    key = "rollout/partial_samples"
    return f"{medians[key]:.0f}" if key in medians else "—"


def _staleness(medians: dict) -> str:
    """The median step's mean / max staleness (trainer version minus the oldest token's); "—" if not recorded."""
    mean, most = medians.get("rollout/staleness_mean"), medians.get("rollout/staleness_max")
    return "—" if mean is None else f"{mean:.2f} / {most:.0f}"


def _kept_remark(out: Path) -> str:
    """The remark an earlier call wrote into ``out`` (the paragraph after the machine line), kept when no new one is given."""
    paragraphs = out.read_text().split("\n\n") if out.exists() else []
    return paragraphs[2] if len(paragraphs) > 3 and not paragraphs[2].startswith("Per seed") else ""


def write_table(rows: list[dict], out: Path, remark: str) -> str:
    import torch

    remark = remark or _kept_remark(out)
    pct = lambda v: f"{100 * v:.0f}%"  # noqa: E731
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [
        "# Presets trained per seed: held-out accuracy before and after, and the step split",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python "
        f"{platform.python_version()}. Each preset as it ships (its steps, its validation: held-out problems, greedy), "
        "one run at a time; a label's overrides are listed below its table.",
        *(["", remark] if remark else []),
        "",
        "Per seed (val acc: held-out, at each validation; reward: the training batch's mean; seconds: medians over "
        "steps 2 and later; trainer idle: its wait for generation over the step time, summed over steps 2 and later):",
        "",
        "| label | seed | val acc, before → after | val acc by validation | reward, first 3 / last 3 steps | step s | gen s "
        "| trainer's wait s | trainer idle | update s | score s | partial samples | staleness, mean / max | wall min | CPU "
        "| load, start / end | finished (UTC) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["medians"]
        curve = " / ".join(pct(a) for _, a in r["val_curve"])
        lines.append(
            f"| {r['label']} | {r['seed']} | {pct(r['val_curve'][0][1])} → {pct(r['val_curve'][-1][1])} | {curve} | "
            f"{r['reward_first3']:.2f} / {r['reward_last3']:.2f} | {r['step_s']:.1f} | {m.get('timing_s/gen', 0):.1f} | "
            f"{m.get('timing_s/wait_gen', 0):.1f} | {_pct_or_dash(_idle(r))} | {m.get('timing_s/update_actor', 0):.1f} | {r['score_s']:.1f} | "
            f"{_partial(m)} | {_staleness(m)} | {r['wall_s'] / 60:.1f} | {r.get('cpu', NOT_RECORDED)} | {r['load'][0]} / {r['load'][1]} | {r['finished_utc']} |"
        )
    lines += [
        "",
        "Mean (range) per label over its seeds, per kind of CPU (the trainer's dtype and speed differ by kind):",
        "",
        "| label | CPU | seeds | val acc before | val acc after | reward first 3 | reward last 3 | step s | gen s | "
        "trainer's wait s | trainer idle | update s | score s | partial samples | staleness mean |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, cpu in dict.fromkeys((r["label"], r.get("cpu", NOT_RECORDED)) for r in rows):
        rs = [r for r in rows if r["label"] == label and r.get("cpu", NOT_RECORDED) == cpu]
        med = lambda key: _spread([r["medians"].get(key, 0.0) for r in rs], False)  # noqa: E731
        lines.append(
            f"| {label} | {cpu} | {', '.join(str(r['seed']) for r in rs)} | {_spread([r['val_curve'][0][1] for r in rs], True)} | "
            f"{_spread([r['val_curve'][-1][1] for r in rs], True)} | {_spread([r['reward_first3'] for r in rs], False)} | "
            f"{_spread([r['reward_last3'] for r in rs], False)} | {_spread([r['step_s'] for r in rs], False)} | "
            f"{med('timing_s/gen')} | {med('timing_s/wait_gen')} | {_idle_spread(rs)} | {med('timing_s/update_actor')} | "
            f"{_spread([r['score_s'] for r in rs], False)} | {_optional(rs, 'rollout/partial_samples')} | "
            f"{_optional(rs, 'rollout/staleness_mean')} |"
        )
    lines += ["", "Labels:", ""]
    for label in labels:
        r = next(r for r in rows if r["label"] == label)
        lines.append(
            f"- `{label}`: `preset={r['preset']}`"
            + "".join(f" `{e}`" for e in r["extra"])
            + f"; regenerate with `.venv/bin/python -m benchmarks.preset_runs --label {label} --preset "
            f"{r['preset']} --seeds {','.join(str(x['seed']) for x in rows if x['label'] == label)}"
            + (f" --extra {' '.join(r['extra'])}" if r["extra"] else "")
            + "`."
        )
    lines += ["", "Regenerate the tables from the stored rows: `.venv/bin/python -m benchmarks.preset_runs --table`."]
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def _pct_or_dash(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _idle_spread(rs: list[dict]) -> str:
    """Mean (range) of the seeds' trainer idle shares; "—" where a seed was recorded without it."""
    vals = [_idle(r) for r in rs]
    if any(v is None for v in vals):
        return "—"
    return (
        f"{100 * statistics.mean(vals):.1f}% ({100 * min(vals):.1f}–{100 * max(vals):.1f}%)"
        if len(vals) > 1
        else _pct_or_dash(vals[0])
    )


def _optional(rs: list[dict], key: str) -> str:
    """Mean (range) of a per-step median that only some modes record; "—" where a seed lacks it."""
    vals = [r["medians"].get(key) for r in rs]
    return "—" if None in vals else _spread(vals, False)


def _band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Mean, min and max per position over seeds (positions that every seed has)."""
    cols = list(zip(*series))
    return [statistics.mean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def plot_labels(rows: list[dict], labels: list[str], out: Path, cpu: str = "") -> Path:
    """Training reward and held-out accuracy per step for ``labels``: the mean over each label's seeds
    (those run on ``cpu``, a kind as the rows name it, if given), shaded from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label in labels:
        rs = [r for r in rows if r["label"] == label and (not cpu or r.get("cpu") == cpu)]
        if not rs:
            raise SystemExit(
                f"--plot: no rows labelled {label!r} in the results; labels: {sorted({r['label'] for r in rows})}"
            )
        seeds = ",".join(str(r["seed"]) for r in rs)
        mean, lo, hi = _band([r["rewards"] for r in rs])
        steps = list(range(1, len(mean) + 1))
        (line,) = ax_r.plot(steps, mean, label=f"{label} (seeds {seeds})")
        ax_r.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        vsteps = [s for s, _ in rs[0]["val_curve"]]
        mean, lo, hi = _band([[a for _, a in r["val_curve"]] for r in rs])
        ax_v.plot(vsteps[: len(mean)], mean, "o-", color=line.get_color(), label=label)
        ax_v.fill_between(vsteps[: len(mean)], lo, hi, color=line.get_color(), alpha=0.15)
    ax_r.set(xlabel="step", ylabel="training reward (batch mean)", title="training reward", ylim=(0, 1.02))
    ax_v.set(xlabel="step", ylabel="held-out accuracy (greedy)", title="validation", ylim=(0, 1.02))
    for ax in (ax_r, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--label", default="", help="the rows' name (default: the preset's)")
    ap.add_argument(
        "--seeds",
        default="",
        help="comma-separated seeds to run now (each replaces its earlier row on this kind of CPU)",
    )
    ap.add_argument("--extra", nargs="*", default=[], help="overrides on top of the preset (part of the label)")
    ap.add_argument("--steps", type=int, default=None, help="a smoke run: fewer steps (not for the results)")
    ap.add_argument("--table", action="store_true", help="only rewrite the results file from --rows")
    ap.add_argument(
        "--reread",
        action="store_true",
        help="recompute the rows of --label and --seeds from their run "
        "folders (runs/bench_presets/LABEL/seedN) without training, then rewrite the results file",
    )
    ap.add_argument("--rows", default=str(RESULTS / "results_presets.jsonl"))
    ap.add_argument("--remark", default="", help="a sentence for the results file (what else ran on the machine)")
    ap.add_argument("--out", default=str(RESULTS / "results_presets.md"))
    ap.add_argument(
        "--plot",
        default="",
        help="comma-separated labels: draw their curves (mean and range over seeds) into --plot-out, and nothing else",
    )
    ap.add_argument("--plot-out", default=str(RESULTS / "presets.png"))
    ap.add_argument("--plot-cpu", default="", help="only the seeds run on this kind of CPU (e.g. AVX2, 'AVX-512 BF16')")
    args = ap.parse_args()
    label = args.label or args.preset
    rows_path = Path(args.rows)
    rows = read_rows(rows_path)
    if args.plot:
        print(plot_labels(rows, args.plot.split(","), Path(args.plot_out), args.plot_cpu))
        return
    if args.reread:
        seeds = {int(s) for s in args.seeds.split(",") if s}
        mine = lambda r: r["label"] == label and r["seed"] in seeds and r.get("cpu") == cpu_kind()  # noqa: E731
        rows = [reread(r) if mine(r) else r for r in rows]
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed in [] if args.table or args.reread else [int(s) for s in args.seeds.split(",") if s]:
        row = run_one(label, args.preset, seed, args.extra, args.steps)
        rows = store_row(rows, row, rows_path)
        print(json.dumps(row), flush=True)
    print(write_table(rows, Path(args.out), args.remark))
    refresh("presets", args.out)


if __name__ == "__main__":
    main()
