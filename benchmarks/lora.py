"""Full fine-tuning vs LoRA (actor.lora.rank 8 and 32) on the default model and preset.

    .venv/bin/python -m benchmarks.lora [--parts engine,memory,runs] [--preset default] [--steps 0]
        [--updates 3] [--runs 0::0+1+2,8:1e-4:0+1,32:1e-4:0+1] [--only NAME,...] [--list]

Three parts, each merged into ``benchmarks/results/results_lora.json`` (what was measured, per part and
per run) and rendered from it into ``benchmarks/results/results_lora.md``, so the runs can be made one at a
time (``--parts runs --only r0-lr1e-05-s0``, e.g. each under the shared CPU lock) and the table
still shows them side by side:

* ``engine``: the built-in rollout engine with rank-8 adapters applied as a low-rank term at every
  forward (``B(A x)``, the default) vs merged into the weights at each load (``merge_adapters``):
  generation time of one default-preset batch (8 prompts x 4 samples, 32 new tokens) and the time
  of one adapter load (with the merge). Merging is faster but not exact (see rollout/worker.py).
* ``memory``: one actor (``ActorWorker``, one rank, in a fresh process each) for full fine-tuning
  and each rank: peak resident memory over ``--updates`` updates (weights, gradients, AdamW
  moments) and update seconds per step (their median; one batch of 32 samples).
* ``runs``: the default preset for ``--steps`` steps (0: the preset's), validating at the preset's
  ``val_freq``, for each ``rank:lr:seeds`` of ``--runs`` (rank 0: full fine-tuning; an empty lr:
  the preset's; seeds joined by ``+``; each run is named ``r<rank>-lr<lr>-s<seed>``, ``--list``
  prints them): step time, actor update time, weight-sync bytes and seconds, the training reward
  of every step, validation accuracy at every validation, wall time, and the load average while
  it ran (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import AVX2_FLOAT32, RESULTS, command, cpu_kind_and_dtype
from benchmarks.readme import refresh
from benchmarks.training_runs import train_and_read

RANKS = (8, 32)


def _prompts(n: int, vocab: int, length: int = 40) -> list[list[int]]:
    return [[(37 * i + 11 * j) % (vocab - 100) + 50 for j in range(length)] for i in range(n)]


# ------------------------------------------------------------------ engine: delta vs merged
def part_engine(model: str) -> dict:
    import torch

    from offstep.config.schema import LoRAConfig
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
    from offstep.models.lora import adapter_parameters, add_adapters
    from offstep.rollout.engines.torch_engine import TorchEngine
    from offstep.rollout.types import SamplingParams

    torch.set_num_threads(1)
    path = resolve_model(model)
    tok = load_tokenizer(path)
    rows = []
    for merge in (False, True):
        torch.manual_seed(0)
        m = add_adapters(load_causal_lm(path), LoRAConfig(rank=8))
        engine = TorchEngine(m, tok, eos_token_ids(tok, path), max_batch_size=64, merge_adapters=merge)
        g = torch.Generator().manual_seed(1)
        adapters = {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in adapter_parameters(m)}
        loads, gens = [], []
        for v in (1, 2, 3):
            t0 = time.perf_counter()
            engine.load_adapters(adapters, v)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.generate(
                _prompts(8, engine.vocab_size), SamplingParams(n=4, temperature=1.0, max_new_tokens=32), seed=v
            )
            gens.append(time.perf_counter() - t0)
        rows.append(
            {
                "applied": "merged into the weights" if merge else "low-rank term B(A x) (default)",
                "generate_s": statistics.median(gens),
                "load_s": statistics.median(loads),
            }
        )
        print(rows[-1], flush=True)
    return {"model": model, "rows": rows}


def render_engine(part: dict) -> list[str]:
    lines = [
        "## Built-in engine: adapters as a low-rank term vs merged",
        "",
        _when(part),
        f"`{part['model']}`, rank 8 on the 7 projections, 1 thread; one batch of 8 prompts x 4 samples, 32 new tokens "
        "(no EOS stop forced); medians of 3.",
        "",
        "| adapters applied | generate s | load_adapters s |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['applied']} | {r['generate_s']:.2f} | {r['load_s']:.3f} |" for r in part["rows"]]
    return lines + [
        "",
        "Merged is faster per batch but not exact (unmerging rounds the base at every sync: the reference "
        "drifts and a resumed run differs from an uninterrupted one), so the engine keeps the low-rank term.",
    ]


# ------------------------------------------------------------------ memory: one actor per process
_MEMORY = r'''
import json, resource, statistics, sys, time, torch
from offstep.batch import Sample, collate
from offstep.config.schema import ActorConfig, AlgorithmConfig, LoRAConfig, OptimConfig
from offstep.models.loading import resolve_model
from offstep.train.actor import ActorWorker
from offstep.train.distributed import GroupSpec
rank, model, compute, updates = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
path = resolve_model(model)
g = torch.Generator().manual_seed(0)
vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
samples = [Sample(uid=i // 4, prompt_ids=torch.randint(50, vocab, (40,), generator=g).tolist(),
                  response_ids=torch.randint(50, vocab, (32,), generator=g).tolist(), rollout_logprobs=[-1.0] * 32,
                  finish_reason="length", score=0.0, version=0) for i in range(32)]
batch = collate(samples, 0)
batch.advantages = torch.randn(len(batch), 1, generator=g) * batch.response_mask
cfg = ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=1e-5), lora=LoRAConfig(rank=rank))
actor = ActorWorker(GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1), 0, path, "float32", compute, cfg, AlgorithmConfig(use_kl_loss=False), 1.0)
times = []
for _ in range(updates):
    t0 = time.perf_counter(); actor.update(batch); times.append(time.perf_counter() - t0)
trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
print(json.dumps({"rank": rank, "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "update_s": statistics.median(times), "trainable": trainable}))
'''


def part_memory(model: str, compute: str, updates: int) -> dict:
    rows = []
    for rank in (0, *RANKS):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY, str(rank), model, compute, str(updates)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return {"model": model, "compute": compute, "updates": updates, "rows": rows}


def render_memory(part: dict) -> list[str]:
    lines = [
        "## One actor: resident memory and update time",
        "",
        _when(part),
        f"`{part['model']}`, float32 master weights, {part['compute']} compute (the preset's), one rank (1 thread), a "
        f"fresh process each; peak resident set after {part['updates']} update(s) of one batch (32 samples, 40 prompt + "
        "32 response tokens, micro-batches of 8); update s: their median.",
        "",
        "| actor | trainable parameters | peak RSS GB | update s/step |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {_setting(r['rank'])} | {r['trainable'] / 1e6:.2f} M | {r['rss_gb']:.2f} | {r['update_s']:.2f} |"
        for r in part["rows"]
    ]
    return lines


# ------------------------------------------------------------------ runs: the default preset
def _sync_bytes(model: str, rank: int) -> int:
    import torch

    from offstep.config.schema import LoRAConfig
    from offstep.models.loading import resolve_model
    from offstep.models.lora import adapter_parameters, meta_model

    m = meta_model(resolve_model(model), LoRAConfig(rank=rank) if rank else None)
    params = [p for _, p in adapter_parameters(m)] if rank else list(m.parameters())
    return sum(p.numel() * torch.finfo(torch.float32).bits // 8 for p in params)


def plan_runs(runs: str, base_lr: float) -> dict[str, tuple[int, float, int]]:
    """``rank:lr:seeds`` items (empty lr: ``base_lr``; seeds joined by ``+``, empty: 0) -> run name ->
    (rank, lr, seed)."""
    plan = {}
    for item in runs.split(","):
        rank, lr, seeds = (item.split(":") + ["", ""])[:3]
        for seed in (seeds or "0").split("+"):
            r, x, s = int(rank), float(lr) if lr else base_lr, int(seed)
            plan[f"r{r}-lr{x:g}-s{s}"] = (r, x, s)
    return plan


def run_one(preset: str, rank: int, lr: float, seed: int, steps: int, val_freq: int, out: Path) -> dict:
    run = train_and_read(
        [f"preset={preset}", f"actor.lora.rank={rank}", f"actor.optim.lr={lr}", f"trainer.seed={seed}"],
        out,
        steps,
        val_freq,
    )
    return {
        "rank": rank,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "step_s": run.median("timing_s/step"),
        "update_s": run.median("timing_s/update_actor"),
        "sync_s": run.median("timing_s/sync_weights"),
        "sync_mb": _sync_bytes(run.cfg.model.path, rank) / 2**20,
        "rewards": run.rewards,
        "val": run.val_curve,
        "wall_s": run.wall_s,
    }


def _setting(rank: int) -> str:
    return "full fine-tuning" if rank == 0 else f"LoRA r={rank}"


def _when(part: dict) -> str:
    if "load_mean" not in part:  # kept from before the load average was recorded
        return f"Measured {part['started']} UTC; load average not recorded. {part.get('note', '')}".rstrip()
    return (
        f"Measured {part['started']} UTC; load average (1 min) while it ran: mean {part['load_mean']:.1f}, max "
        f"{part['load_max']:.1f} (2 cores; other engineers' jobs may share them)."
    )


def _spread(values: list[float], fmt: str) -> str:
    """Mean, with the range where there is more than one value."""
    mean = fmt.format(statistics.mean(values))
    return mean if len(values) == 1 else f"{mean} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _mean(values: list[float], n: int, first: bool) -> float:
    return statistics.mean(values[:n] if first else values[-n:])


def render_runs(runs: dict[str, dict], memory: dict | None, preset: str, cpu: str) -> list[str]:
    rss = {r["rank"]: r["rss_gb"] for r in (memory or {}).get("rows", [])}
    groups: dict[tuple[int, float], list[dict]] = {}
    for r in sorted(runs.values(), key=lambda r: (r["rank"], r["lr"], r["seed"])):
        groups.setdefault((r["rank"], r["lr"]), []).append(r)
    steps = sorted({r["steps"] for r in runs.values()})
    lines = [
        "## The default run: full fine-tuning vs LoRA, side by side",
        "",
        f"Preset `{preset}` (SmolLM2-135M-Instruct, GRPO, one-step off-policy, reference on the rollout core; CPU: "
        f"{cpu}), {'/'.join(map(str, steps))} steps. Mean over seeds, range in brackets. Step, update "
        "and sync s: each run's median over steps 2 and later. Sync MB: float32 bytes one sync carries (the whole "
        "model, or the adapters); sync s: export + the replica's load. Actor peak RSS: the memory part above (one "
        "actor alone). Reward: mean training reward of the first 5 / last 5 steps.",
        "",
        "| setting | lr | seeds | actor peak RSS GB | update s | sync MB | sync s | step s | reward first 5 / last 5 "
        "| val acc before | val acc at the end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (rank, lr), rs in groups.items():
        lines.append(
            f"| {_setting(rank)} | {lr:g} | {'+'.join(str(r['seed']) for r in rs)} | {rss[rank]:.2f} |"
            if rank in rss
            else f"| {_setting(rank)} | {lr:g} | {'+'.join(str(r['seed']) for r in rs)} | – |"
        )
        lines[-1] += (
            f" {_spread([r['update_s'] for r in rs], '{:.1f}')} | {rs[0]['sync_mb']:.1f} | "
            f"{_spread([r['sync_s'] for r in rs], '{:.2f}')} | {_spread([r['step_s'] for r in rs], '{:.1f}')} | "
            f"{_spread([_mean(r['rewards'], 5, True) for r in rs], '{:.3f}')} / "
            f"{_spread([_mean(r['rewards'], 5, False) for r in rs], '{:.3f}')} | "
            f"{_spread([r['val'][0][1] for r in rs], '{:.3f}')} | {_spread([r['val'][-1][1] for r in rs], '{:.3f}')} |"
        )
    lines += [
        "",
        "Each run:",
        "",
        "| run | setting | lr | seed | step s | update s | sync s | validation accuracy at steps | wall min | started "
        "(UTC) | load average mean / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(runs.items(), key=lambda kv: (kv[1]["rank"], kv[1]["lr"], kv[1]["seed"])):
        val = ", ".join(f"{s}: {a:.3f}" for s, a in r["val"])
        lines.append(
            f"| {name} | {_setting(r['rank'])} | {r['lr']:g} | {r['seed']} | {r['step_s']:.1f} | {r['update_s']:.1f} | "
            f"{r['sync_s']:.2f} | {val} | {r['wall_s'] / 60:.1f} | {r['started']} | {r['load_mean']:.1f} / "
            f"{r['load_max']:.1f} |"
        )
    full = [r for r in runs.values() if r["rank"] == 0]
    if full:
        base = min(r["lr"] for r in full)
        full = sorted((r for r in full if r["lr"] == base), key=lambda r: r["seed"])
        val_steps = [s for s, _ in full[0]["val"]]
        lines += [
            "",
            f"### The default run (full fine-tuning, lr {base:g}), per seed",
            "",
            "Validation accuracy (35 held-out problems, greedy) at every validation step, and the training reward "
            "(32 samples a step) of the first 5 and last 5 steps.",
            "",
            "| seed | " + " | ".join(f"val step {s}" for s in val_steps) + " | reward steps 1–5 | reward last 5 | "
            "median step s | wall min |",
            "| --- " * (len(val_steps) + 5) + "|",
        ]
        for r in full:
            acc = dict(r["val"])
            n = len(r["rewards"])
            lines.append(
                f"| {r['seed']} | "
                + " | ".join(f"{acc[s]:.3f}" if s in acc else "–" for s in val_steps)
                + f" | {' '.join(f'{x:.2f}' for x in r['rewards'][:5])} (mean {_mean(r['rewards'], 5, True):.3f}) | "
                f"steps {n - 4}–{n}: {' '.join(f'{x:.2f}' for x in r['rewards'][-5:])} (mean "
                f"{_mean(r['rewards'], 5, False):.3f}) | {r['step_s']:.1f} | {r['wall_s'] / 60:.1f} |"
            )
    return lines


# ------------------------------------------------------------------ measuring, merging, rendering
class LoadAverage:
    """Samples the 1-minute load average every ``every`` seconds while in the ``with`` block."""

    def __init__(self, every: float = 15.0):
        import threading

        self.every, self.samples, self._stop = every, [os.getloadavg()[0]], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadAverage:
        self.started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.samples.append(os.getloadavg()[0])

    def record(self) -> dict:
        return {
            "started": self.started,
            "load_mean": statistics.mean(self.samples),
            "load_max": max(self.samples),
            "cpu": cpu_kind_and_dtype(),
            "command": command(),
        }


def recorded_cpus(results: dict) -> str:
    parts = [results[k] for k in ("engine", "memory") if k in results] + list(results.get("runs", {}).values())
    return "; ".join(sorted({p.get("cpu", AVX2_FLOAT32) for p in parts})) or cpu_kind_and_dtype()


def measured(fn, *args) -> dict:
    with LoadAverage() as load:
        result = fn(*args)
    return {**result, **load.record()}


def _out_arg(out: Path) -> str:
    """The ``--out`` to name in a command, when it is not the default file."""
    return "" if out.resolve() == (RESULTS / "results_lora.md").resolve() else f" --out benchmarks/results/{out.name}"


def runs_arg(runs: dict) -> str:
    """The ``--runs`` that remakes every stored run (``rank:lr:seeds`` items, by rank, then lr)."""
    groups: dict[tuple[int, float], list[int]] = {}
    for r in runs.values():
        groups.setdefault((r["rank"], r["lr"]), []).append(r["seed"])
    return ",".join(
        f"{rank}:{lr:g}:{'+'.join(map(str, sorted(seeds)))}" for (rank, lr), seeds in sorted(groups.items())
    )


def render(results: dict, preset: str, regenerate: str, out: Path = RESULTS / "results_lora.md") -> str:
    import peft
    import torch

    lines = [
        "# Full fine-tuning vs LoRA",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores ({recorded_cpus(results)}), torch {torch.__version__}, "
        f"peft {peft.__version__}, Python {platform.python_version()}. Each part and run below says when it ran and "
        "the load average meanwhile: the 2 cores were shared with other engineers' jobs (tests, other benchmarks).",
        "",
        f"Regenerate: `{regenerate}` (every part, one run after another), or one run at a time: "
        f"`.venv/bin/python -m benchmarks.lora --parts runs --only r0-lr1e-05-s0{_out_arg(out)}` (`--list` names them); "
        f"each invocation merges into `benchmarks/results/{out.with_suffix('.json').name}` and rewrites this file from it.",
    ]
    if "engine" in results:
        lines += [""] + render_engine(results["engine"])
    if "memory" in results:
        lines += [""] + render_memory(results["memory"])
    if results.get("runs"):
        lines += [""] + render_runs(
            results["runs"], results.get("memory"), preset, recorded_cpus({"runs": results["runs"]})
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", help="tiny: a smoke run of this script")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0: the preset's)")
    ap.add_argument("--parts", default="engine,memory,runs", help="empty: only render the stored results")
    ap.add_argument("--updates", type=int, default=3, help="memory: updates per actor")
    ap.add_argument(
        "--runs",
        default="0::0+1+2,8:1e-4:0+1,32:1e-4:0+1",
        help="runs: rank:lr:seeds items (empty lr: the preset's; seeds joined by +)",
    )
    ap.add_argument("--only", default="", help="runs: only these run names (comma-separated; see --list)")
    ap.add_argument("--list", action="store_true", help="print the run names of --runs and exit")
    ap.add_argument(
        "--out", default=str(RESULTS / "results_lora.md"), help="the table; its .json beside it holds the results"
    )
    args = ap.parse_args()
    from offstep.launch.loader import load_config

    preset_cfg = load_config([f"preset={args.preset}"])
    steps = args.steps or preset_cfg.trainer.total_steps
    model = preset_cfg.model.path
    plan = plan_runs(args.runs, preset_cfg.actor.optim.lr)
    if args.list:
        print("\n".join(f"{name}: {_setting(r)}, lr {lr:g}, seed {s}" for name, (r, lr, s) in plan.items()))
        return
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(plan))
    if unknown:
        sys.exit(f"--only: {', '.join(unknown)} not in the plan of --runs (--list names them)")
    store = Path(args.out).with_suffix(".json")
    results = json.loads(store.read_text()) if store.exists() else {}

    def save() -> None:  # after every part and run: a stopped benchmark keeps what it measured
        store.write_text(json.dumps(results, indent=1) + "\n")
        out = Path(args.out)
        out.write_text(
            render(
                results,
                args.preset,
                f".venv/bin/python -m benchmarks.lora --preset {args.preset} --steps "
                f"{steps} --updates {args.updates} --runs {runs_arg(results.get('runs', {})) or args.runs}"
                f"{_out_arg(out)}",
                out,
            )
        )

    for part in (p for p in args.parts.split(",") if p):
        if part == "engine":
            results["engine"] = measured(part_engine, model)
        elif part == "memory":
            results["memory"] = measured(part_memory, model, preset_cfg.model.compute_dtype, args.updates)
        elif part == "runs":
            for name, (rank, lr, seed) in plan.items():
                if only and name not in only:
                    continue
                out = Path("runs") / "bench_lora" / name
                results.setdefault("runs", {})[name] = measured(
                    run_one, args.preset, rank, lr, seed, steps, preset_cfg.trainer.val_freq, out
                )
                print(name, json.dumps(results["runs"][name]), flush=True)
                save()
        else:
            sys.exit(f"--parts: unknown part {part!r} (engine, memory, runs)")
        save()
    save()
    print(Path(args.out).read_text())
    if args.parts:
        refresh("default-run", store)
        refresh("lora", args.out)


if __name__ == "__main__":
    main()
