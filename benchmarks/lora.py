"""Full fine-tuning vs LoRA (actor.lora.rank 8 and 32) on the default model and preset.

    .venv/bin/python benchmarks/lora.py [--steps 0] [--parts engine,memory,runs] [--preset default]
        [--updates 3] [--runs 0:,8:,8:1e-4,32:1e-4]

Three parts, one after another on the same machine, written to ``benchmarks/results_lora.md``:

* ``engine``: the built-in rollout engine with rank-8 adapters applied as a low-rank term at every
  forward (``B(A x)``, the default) vs merged into the weights at each load (``merge_adapters``):
  generation time of one default-preset batch (8 prompts x 4 samples, 32 new tokens) and the time
  of one adapter load (with the merge). Merging is faster but not exact (see rollout/worker.py).
* ``memory``: one actor (``ActorWorker``, one rank, in a fresh process each) for full fine-tuning
  and each rank: peak resident memory over ``--updates`` updates (weights, gradients, AdamW
  moments) and update seconds per step (their median; one batch of 32 samples).
* ``runs``: the default preset for ``--steps`` steps (0: the preset's) with each ``rank:lr`` of
  ``--runs`` (default: full and LoRA r=8 at the preset's lr, r=8 and r=32 at 10x): step time, actor
  update time, weight-sync bytes and seconds, training reward, validation accuracy before and after.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from training_runs import train_and_read  # noqa: E402

RANKS = (8, 32)

def _prompts(n: int, vocab: int, length: int = 40) -> list[list[int]]:
    return [[(37 * i + 11 * j) % (vocab - 100) + 50 for j in range(length)] for i in range(n)]


# ------------------------------------------------------------------ engine: delta vs merged
def part_engine(model: str) -> list[str]:
    import torch

    from offstep.config.schema import LoRAConfig
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
    from offstep.models.lora import adapter_parameters, add_adapters
    from offstep.rollout.engine import TorchEngine
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
            engine.generate(_prompts(8, engine.vocab_size), SamplingParams(n=4, temperature=1.0, max_new_tokens=32), seed=v)
            gens.append(time.perf_counter() - t0)
        rows.append(("merged into the weights" if merge else "low-rank term B(A x) (default)",
                     statistics.median(gens), statistics.median(loads)))
        print(rows[-1], flush=True)
    lines = ["## Built-in engine: adapters as a low-rank term vs merged", "",
             f"`{model}`, rank 8 on the 7 projections, 1 thread; one batch of 8 prompts x 4 samples, 32 new tokens "
             "(no EOS stop forced); medians of 3.", "",
             "| adapters applied | generate s | load_adapters s |", "| --- | --- | --- |"]
    lines += [f"| {name} | {g:.2f} | {ld:.3f} |" for name, g, ld in rows]
    return lines


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


def part_memory(model: str, compute: str, updates: int) -> list[str]:
    rows = []
    for rank in (0, *RANKS):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-c", _MEMORY, str(rank), model, compute, str(updates)], capture_output=True, text=True, env=env,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    lines = ["## One actor: resident memory and update time", "",
             f"`{model}`, float32 master weights, {compute} compute (the preset's), one rank (1 thread), a fresh process each; "
             f"peak resident set after {updates} update(s) of one batch (32 samples, 40 prompt + 32 response tokens, micro-batches "
             "of 8); update s: their median.", "",
             "| actor | trainable parameters | peak RSS GB | update s/step |", "| --- | --- | --- | --- |"]
    lines += [f"| {'full' if r['rank'] == 0 else 'LoRA r=' + str(r['rank'])} | {r['trainable'] / 1e6:.2f} M | "
              f"{r['rss_gb']:.2f} | {r['update_s']:.2f} |" for r in rows]
    return lines


# ------------------------------------------------------------------ runs: the default preset
def _sync_bytes(model: str, rank: int) -> int:
    import torch

    from offstep.config.schema import LoRAConfig
    from offstep.models.loading import resolve_model
    from offstep.models.lora import meta_model, adapter_parameters

    m = meta_model(resolve_model(model), LoRAConfig(rank=rank) if rank else None)
    params = [p for _, p in adapter_parameters(m)] if rank else list(m.parameters())
    return sum(p.numel() * torch.finfo(torch.float32).bits // 8 for p in params)


def run_one(preset: str, rank: int, lr: float | None, steps: int, out: Path) -> dict:
    extra = [f"actor.optim.lr={lr}"] if lr is not None else []
    run = train_and_read([f"preset={preset}", f"actor.lora.rank={rank}", *extra], out, steps)
    return {
        "setting": "full" if rank == 0 else f"LoRA r={rank}", "lr": run.cfg.actor.optim.lr,
        "step_s": run.median("timing_s/step"), "update_s": run.median("timing_s/update_actor"),
        "sync_s": run.median("timing_s/sync_weights"), "sync_mb": _sync_bytes(run.cfg.model.path, rank) / 2**20,
        "r0": run.reward(first=True), "r1": run.reward(first=False), "v0": run.val[0], "v1": run.val[-1],
        "wall_s": run.wall_s,
    }


def part_runs(preset: str, steps: int, runs: str) -> list[str]:
    from offstep.config.loader import load_config

    base_lr = load_config([f"preset={preset}"]).actor.optim.lr
    # "rank:lr" pairs; an empty lr is the preset's
    plan = [(int(r), float(lr) if lr else None) for r, lr in (item.split(":") for item in runs.split(","))]
    rows = []
    for rank, lr in plan:
        rows.append(run_one(preset, rank, lr, steps, Path("runs") / "bench_lora" / f"r{rank}-lr{lr or base_lr:g}"))
        print(json.dumps(rows[-1]), flush=True)
    lines = ["## The default run: full fine-tuning vs LoRA", "",
             f"Preset `{preset}` (SmolLM2-135M-Instruct, GRPO, one-step off-policy, reference on the rollout core), "
             f"{steps} steps, validation before and after. Medians over steps 2 and later. Sync MB: float32 bytes one "
             "sync carries (the whole model, or the adapters); sync s: export + the replica's load.", "",
             "| setting | lr | step s | update s | sync MB | sync s | reward first 3 / last 3 | val acc before / after "
             "| wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['lr']:g} | {r['step_s']:.1f} | {r['update_s']:.1f} | {r['sync_mb']:.1f} | "
              f"{r['sync_s']:.2f} | {r['r0']:.3f} / {r['r1']:.3f} | {r['v0']:.3f} / {r['v1']:.3f} | {r['wall_s']:.0f} |"
              for r in rows]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", help="tiny: a smoke run of this script")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0: the preset's)")
    ap.add_argument("--parts", default="engine,memory,runs")
    ap.add_argument("--updates", type=int, default=3, help="memory: updates per actor")
    ap.add_argument("--runs", default="0:,8:,8:1e-4,32:1e-4", help="runs: rank:lr pairs (empty lr: the preset's)")
    ap.add_argument("--out", default=str(HERE / "results_lora.md"))
    args = ap.parse_args()
    from offstep.config.loader import load_config

    preset_cfg = load_config([f"preset={args.preset}"])
    steps = args.steps or preset_cfg.trainer.total_steps
    model = preset_cfg.model.path
    t0 = time.time()
    import peft
    import torch

    sections = []
    for part in args.parts.split(","):
        sections += [""] + (part_engine(model) if part == "engine" else part_memory(model, preset_cfg.model.compute_dtype, args.updates) if part == "memory"
                            else part_runs(args.preset, steps, args.runs))
    lines = ["# Full fine-tuning vs LoRA", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, peft {peft.__version__}, "
             f"Python {platform.python_version()}; {(time.time() - t0) / 60:.1f} minutes in all.", *sections, "",
             f"Regenerate: `.venv/bin/python benchmarks/lora.py --preset {args.preset} --steps {steps} --parts {args.parts} "
             f"--updates {args.updates} --runs {args.runs}`"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
