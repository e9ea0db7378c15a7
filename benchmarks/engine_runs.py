"""The default run with each rollout engine: step time, generation time, weight-load time and the
learning curve, one run after another on the same machine.

    .venv/bin/python -m benchmarks.engine_runs [--steps 10] [--seeds 0,1]

Runs the default preset (SmolLM2-135M, GRPO, one-step off-policy, 1 trainer core + 1 rollout core)
for ``--steps`` steps with ``rollout.engine=builtin`` and ``rollout.engine=vllm`` for every seed, and
once more with vLLM over the collective weight path (``pipeline.weight_sync=collective``, first
seed). Writes ``benchmarks/results/results_engine_runs.md``: per run the median step time, generation time
of a batch (``timing_s/gen``), how long the trainer waited for it, the rollout side's weight load
(median over updates, with the GB/s of the float32 weights), the training reward over the first and
last 3 steps, validation accuracy before and after, the largest mismatch KL, and the wall time; then
the vLLM-vs-builtin ratios of the medians, per seed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh
from benchmarks.training_runs import train_and_read


def _weight_bytes(model_path: str) -> int:
    from offstep.models.loading import resolve_model

    return sum(f.stat().st_size for f in Path(resolve_model(model_path)).glob("*.safetensors"))


def run_one(preset: str, engine: str, seed: int, steps: int, extra: list[str], out: Path) -> dict:
    run = train_and_read([f"preset={preset}", f"rollout.engine={engine}", f"trainer.seed={seed}", *extra], out, steps)
    loads = [e["end"] - e["start"] for e in run.timeline() if e["stage"] == "load_weights"]
    load_s = statistics.median(loads) if loads else float("nan")
    return {
        "engine": engine + (" (collective)" if "pipeline.weight_sync=collective" in extra else ""),
        "seed": seed,
        "step_s": run.median("timing_s/step"),
        "gen_s": run.median("timing_s/gen"),
        "wait_s": run.median("timing_s/wait_gen"),
        "load_s": load_s,
        "load_gbs": _weight_bytes(run.cfg.model.path) / load_s / 1e9,
        "r0": run.reward(first=True),
        "r1": run.reward(first=False),
        "v0": run.val[0],
        "v1": run.val[-1],
        "mismatch": max(abs(m.get("actor/mismatch_kl_k1") or 0.0) for m in run.steps),
        "wall_s": run.wall_s,
    }


def write_table(rows: list[dict], args, minutes: float, remark: str = "") -> str:
    import torch
    import vllm

    seeds = sorted({r["seed"] for r in rows})
    lines = [
        "# The default run with each rollout engine",
        "",
        provenance(),
        "",
        f"Machine: {platform.machine()}, {__import__('os').cpu_count()} cores, torch {torch.__version__}, "
        f"vllm {vllm.__version__}, Python {platform.python_version()}. Runs one after another; "
        f"{minutes:.1f} minutes in all.{(' ' + remark) if remark else ''}",
        "",
        f"Preset `{args.preset}` (default: SmolLM2-135M, GRPO, one-step off-policy, 1 trainer core + 1 rollout core), {args.steps} "
        "steps, validation before and after. Medians over steps 2 and later; the weight load is the rollout "
        "side's span per update (receive/deserialise, load into the engine, cache reset), GB/s of the float32 "
        "weights. vLLM runs eagerly (the engine's default).",
        "",
        "| engine | seed | step s | gen s | trainer wait s | weight load s (GB/s) | reward, first 3 / last 3 steps "
        "| val acc before / after | max mismatch KL | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['seed']} | {r['step_s']:.1f} | {r['gen_s']:.1f} | {r['wait_s']:.2f} | "
            f"{r['load_s']:.2f} ({r['load_gbs']:.2f}) | {r['r0']:.3f} / {r['r1']:.3f} | {r['v0']:.3f} / "
            f"{r['v1']:.3f} | {r['mismatch']:.4f} | {r['wall_s']:.0f} |"
        )
    lines += [
        "",
        "vLLM vs built-in, same seed (ratio of medians; below 1: vLLM takes less time):",
        "",
        "| seed | step time | generation time | weight load |",
        "| --- | --- | --- | --- |",
    ]
    for s in seeds:
        b = next((r for r in rows if r["engine"] == "builtin" and r["seed"] == s), None)
        v = next((r for r in rows if r["engine"] == "vllm" and r["seed"] == s), None)
        if b and v:
            lines.append(
                f"| {s} | {v['step_s'] / b['step_s']:.2f} | {v['gen_s'] / b['gen_s']:.2f} | "
                f"{v['load_s'] / b['load_s']:.1f} |"
            )
    lines += [
        "",
        f"Regenerate: `.venv/bin/python -m benchmarks.engine_runs --preset {args.preset} --steps {args.steps} "
        f"--seeds {args.seeds}`",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", help="tiny: a smoke run of this script")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument(
        "--only",
        choices=("all", "engines", "collective"),
        default="all",
        help="engines: the builtin and vllm runs only; collective: the vLLM collective run only",
    )
    ap.add_argument("--rows", help="also read earlier runs' rows (the JSON lines this script prints) from this file")
    ap.add_argument("--remark", default="", help="a sentence for the results file (what else ran, what was rerun)")
    ap.add_argument("--out", default=str(RESULTS / "results_engine_runs.md"))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = [(e, s, []) for s in seeds for e in ("builtin", "vllm")] if args.only != "collective" else []
    if args.only != "engines":
        plan.append(("vllm", seeds[0], ["pipeline.weight_sync=collective"]))
    t_start = time.time()
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines()] if args.rows else []
    for engine, seed, extra in plan:
        out = Path("runs") / "bench_engine_runs" / f"{engine}{'-coll' if extra else ''}-seed{seed}"
        rows.append(run_one(args.preset, engine, seed, args.steps, extra, out))
        print(json.dumps(rows[-1]), flush=True)
    print(write_table(rows, args, (time.time() - t_start) / 60, args.remark))
    refresh("engine-runs", args.out)


if __name__ == "__main__":
    main()
