"""Candidate recipes for the default preset, per seed: the held-out accuracy at every validation,
its peak and where the run ends against it, the entropy and the KL to the reference, the time.
What chose the default preset's recipe (issue: a run that ends where it peaked).

    .venv/bin/python -m benchmarks.recipe_runs --only t19_const,t19_cosine --seeds 0
    .venv/bin/python -m benchmarks.recipe_runs --seeds 0,1,2 --only t19_cosine
    .venv/bin/python -m benchmarks.recipe_runs --table        # the table from the rows so far

Each candidate is the default preset with its overrides, which name every knob it varies, so that a
row keeps its meaning when the preset changes. A run trains into ``runs/bench_presets/LABEL/seedN``
(``benchmarks.preset_runs``) and adds one row per (candidate, seed, CPU kind) to
``results/results_recipe.jsonl``; every call rewrites ``results/results_recipe.md`` and its section of
``benchmarks/README.md``. A seed draws its own split of the task, so the held-out set differs by seed.

A candidate holds when every seed gains at least 15 points held out at its last step and ends within 3
points of its own peak. The held-out accuracy is greedy over the task's validation set; its standard
error over prompts is ``val/acc_stderr``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import NOT_RECORDED, RESULTS, mean_range, provenance, rows_command
from benchmarks.preset_runs import run_choices, run_dir
from benchmarks.readme import refresh
from benchmarks.training_runs import read_jsonl

# operands 0..19, + and -: 610 problems, 200 held out
T19 = [
    "data.task_options.digits=2",
    "++data.task_options.max_value=19",
    "data.task_train_size=410",
    "data.task_val_size=200",
]
# operands 0..14: 345 problems, 200 held out
T14 = [
    "data.task_options.digits=2",
    "++data.task_options.max_value=14",
    "data.task_train_size=145",
    "data.task_val_size=200",
]
CONST = ["actor.optim.lr=1e-5", "actor.optim.lr_scheduler_type=constant", "algorithm.kl_coef=0.001"]
COSINE = ["actor.optim.lr=1e-5", "actor.optim.lr_scheduler_type=cosine", "algorithm.kl_coef=0.001"]

CANDIDATES: dict[str, tuple[str, list[str]]] = {
    "t19_const": ("operands 0-19; lr 1e-5 constant after 2 warm-up steps, KL 0.001; 25 steps", [*T19, *CONST]),
    "t14_const": ("operands 0-14; lr 1e-5 constant, KL 0.001; 25 steps", [*T14, *CONST]),
    "t19_cosine": ("operands 0-19; lr 1e-5 decaying to 0 (cosine), KL 0.001; 25 steps", [*T19, *COSINE]),
    "t19_cosine_kl": (
        "operands 0-19; lr 1e-5 cosine to 0, KL 0.01; 25 steps",
        [*T19, "actor.optim.lr=1e-5", "actor.optim.lr_scheduler_type=cosine", "algorithm.kl_coef=0.01"],
    ),
    "t19_cosine_2e5": (
        "operands 0-19; lr 2e-5 cosine to 0, KL 0.001; 25 steps",
        [*T19, "actor.optim.lr=2e-5", "actor.optim.lr_scheduler_type=cosine", "algorithm.kl_coef=0.001"],
    ),
}
GAIN, HOLD = 0.15, 0.03  # every seed: at least GAIN over step 0 at its last step, within HOLD of its peak
ROWS = RESULTS / "results_recipe.jsonl"
OUT = RESULTS / "results_recipe.md"


def curves(label: str, seed: int) -> dict:
    """What the row adds from the run's records: entropy and KL to the reference per step, and the
    held-out accuracy's standard error at each validation."""
    metrics = read_jsonl(run_dir(label, seed) / "metrics.jsonl")
    steps = [m for m in metrics if m["step"] >= 1]
    return {
        "entropy": [m.get("actor/entropy") for m in steps],
        "kl": [m.get("actor/kl") for m in steps],
        "val_stderr": [(m["step"], m.get("val/acc_stderr")) for m in metrics if "val/acc" in m],
    }


def verdict(row: dict) -> dict:
    """A seed's figures: held out before, its peak (and step), its last, and whether it holds."""
    curve = row["val_curve"]
    first, last = curve[0][1], curve[-1][1]
    peak_step, peak = max(curve, key=lambda sa: (sa[1], -sa[0]))
    return {
        "first": first,
        "peak": peak,
        "peak_step": peak_step,
        "last": last,
        "gain": last - first,
        "below_peak": peak - last,
        "holds": last - first >= GAIN - 1e-9 and peak - last <= HOLD + 1e-9,
    }


def write_table(rows: list[dict], out: Path) -> str:
    labels = [c for c in CANDIDATES if any(r["label"] == c for r in rows)]
    labels += sorted({r["label"] for r in rows} - set(labels))
    lines = [
        "# Candidate recipes for the default preset, per seed",
        "",
        provenance(rows_command(__file__, sorted(rows, key=lambda r: labels.index(r["label"])))),
        "",
        "Held-out accuracy in points (greedy, 200 problems the run never trains on; the standard error of one is "
        "about 3.5 points at 50%). `gain`: last validation minus step 0; `below peak`: the run's best validation "
        f"minus its last. A candidate holds when every seed gains at least {100 * GAIN:.0f} and ends within "
        f"{100 * HOLD:.0f} of its peak. Entropy and KL: `actor/entropy` and `actor/kl`, mean of the first and last "
        "3 steps. Step: median seconds of steps 2 and later; minutes: the whole run, validations and start-up included.",
        "",
        "| candidate | seeds | step 0 | peak (step) | last | gain | below peak | holds | entropy | KL at the end | step s | minutes | CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in labels:
        for cpu in sorted({r.get("cpu", NOT_RECORDED) for r in rows if r["label"] == label}):
            rs = sorted(
                (r for r in rows if r["label"] == label and r.get("cpu", NOT_RECORDED) == cpu), key=lambda r: r["seed"]
            )
            vs = [verdict(r) for r in rs]
            ent = [statistics.mean(r["entropy"][:3]) for r in rs], [statistics.mean(r["entropy"][-3:]) for r in rs]
            kl = [statistics.mean(r["kl"][-3:]) for r in rs]
            peaks = ", ".join(f"{100 * v['peak']:.1f} ({v['peak_step']})" for v in vs)
            lines.append(
                f"| {label} | {','.join(str(r['seed']) for r in rs)} | {mean_range([v['first'] for v in vs])} | {peaks} | "
                f"{mean_range([v['last'] for v in vs])} | {mean_range([v['gain'] for v in vs])} | "
                f"{mean_range([v['below_peak'] for v in vs])} | {sum(v['holds'] for v in vs)} of {len(vs)} | "
                f"{mean_range(ent[0], 1, 2)} → {mean_range(ent[1], 1, 2)} | {mean_range(kl, 1, 3)} | "
                f"{statistics.median(r['step_s'] for r in rs):.1f} | {mean_range([r['wall_s'] for r in rs], 1 / 60)} | {cpu} |"
            )
    lines += ["", "Each seed's held-out accuracy at every validation (points, step in brackets):", ""]
    for r in sorted(rows, key=lambda r: (labels.index(r["label"]), r["seed"])):
        curve = ", ".join(f"{100 * a:.1f} ({s})" for s, a in r["val_curve"])
        lines.append(f"- {r['label']}, seed {r['seed']} ({r.get('cpu', NOT_RECORDED)}): {curve}")
    lines += ["", "The candidates (overrides on `preset=default`):", ""]
    for label in labels:
        about, extra = CANDIDATES.get(label, ("(no longer a candidate)", []))
        lines.append(f"- `{label}`: {about}. `{' '.join(extra)}`")
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main() -> None:
    rows = run_choices(__doc__, CANDIDATES, ROWS, [], curves, ("label", "seed", "val_curve", "wall_s"))
    print(write_table(rows, OUT))
    refresh("recipe", OUT)


if __name__ == "__main__":
    main()
