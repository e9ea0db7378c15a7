"""The same GRPO work in TRL's GRPOTrainer and in offstep, one run after the other on this machine.

    .venv/bin/python -m benchmarks.trl_side_by_side                    # writes results_trl.md (AVX-512 BF16)
    .venv/bin/python -m benchmarks.trl_side_by_side --dtypes float32 --steps 6

The work (issue 28's): SmolLM2-135M-Instruct, 64 single-digit arithmetic prompts (the built-in task,
seed 0), 8 prompts x 4 samples a step, at most 48 new tokens, T = 1, lr 1e-6 constant, no KL, seed 0.
Per dtype: TRL with 2 threads (generation, then the update, in one process), offstep one-step (1 core
for the trainer, 1 for the rollout), the same with the rollout's core lent to the trainer while the
rollout idles (``pipeline.lend_cores=true``), and offstep synchronous and colocated (one core pool,
taking turns). Medians over steps 2 and later; the ratio is TRL's step over offstep's (above 1: offstep is
faster). bfloat16 runs only where the CPU has native bf16 (AVX-512 BF16, AMX): elsewhere both tools
emulate it, many times slower. Each kind of CPU keeps its own file: ``results_trl.md`` on AVX-512 BF16,
``results_trl_avx2.md`` on AVX2.

TRL runs in a virtual environment of its own, ``runs/bench_trl/venv`` (created here on the first
call, with this checkout's pins for torch, transformers and accelerate and ``--trl``'s version), and
the script records both tools' versions. What differs between the tools, so that the ratio is read
right: both skip the old-policy forward with one PPO epoch and one mini-batch (the ratio's old
log-probs are the update's own forward, detached); offstep computes each prompt once for its n
responses (``actor.share_prompts``, on by default; the row "one row per sample" turns it off), where
TRL runs every sample as a padded row of its own; the reward is the same rule (the reply's last number
against the answer) in both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT

WORK = ROOT / "runs" / "bench_trl"
VENV = WORK / "venv"
OUTS = {"AVX-512 BF16": RESULTS / "results_trl.md", "AVX2": RESULTS / "results_trl_avx2.md"}
PROMPTS, BATCH, N, NEW_TOKENS, LR = 64, 8, 4, 48, 1e-6


# --------------------------------------------------------------------------------------------------
# TRL's side: runs inside its own virtual environment, imports neither offstep nor Ray


def _last_number_reward(completions, answer, **_):
    out = []
    for completion, truth in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        out.append(1.0 if numbers and float(numbers[-1]) == float(truth) else 0.0)
    return out


def trl_child(spec: dict) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(spec["threads"])
    rows = spec["rows"]
    dataset = datasets.Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    cfg = trl.GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=BATCH * N,
        num_generations=N,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        max_steps=spec["steps"],
        seed=0,
        use_cpu=True,
        bf16=spec["dtype"] == "bfloat16",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=_last_number_reward, args=cfg, train_dataset=dataset, processing_class=tokenizer
    )
    steps: list[dict] = []
    gen = {"s": 0.0}
    generate = getattr(trainer, "_generate", None)
    if generate is not None:  # the generation's share of a step (TRL's private method, present in 1.x)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                gen["s"] += time.perf_counter() - t0

        trainer._generate = timed

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            gen["s"], self.t0 = 0.0, time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"step_s": time.perf_counter() - self.t0, "gen_s": gen["s"] if generate else None})

    trainer.add_callback(Clock())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "steps": steps,
        "rewards": rewards,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


# --------------------------------------------------------------------------------------------------
# the driver: offstep's runs in this process, TRL's in a child process


def ensure_venv(trl_version: str) -> Path:
    python = VENV / "bin" / "python"
    stamp = VENV / ".trl-version"
    if python.exists() and stamp.exists() and stamp.read_text() == trl_version:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pins = [
        line.strip()
        for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
        if line.split("==")[0].strip() in ("torch", "transformers", "accelerate", "tokenizers", "safetensors")
    ]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins, f"trl=={trl_version}", "datasets"], check=True)
    stamp.write_text(trl_version)
    return python


def task_rows(seed: int = 0) -> list[dict]:
    from offstep.data.tasks import arithmetic

    return [
        {"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"]}
        for r in arithmetic(PROMPTS, seed, digits=1)
    ]


def run_trl(python: Path, model: str, dtype: str, steps: int, threads: int) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": model,
        "dtype": dtype,
        "steps": steps,
        "threads": threads,
        "rows": task_rows(),
        "out": str(WORK / f"trl_{dtype}"),
    }
    spec_file, result_file = WORK / f"spec_{dtype}.json", WORK / f"trl_{dtype}.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    subprocess.run(
        [str(python), "-m", "benchmarks.trl_side_by_side", "--child", str(spec_file), str(result_file)],
        check=True,
        env=env,
        cwd=ROOT,
    )
    return json.loads(result_file.read_text())


def run_offstep(name: str, overrides: list[str], dtype: str, steps: int) -> dict:
    from benchmarks.training_runs import train_and_read

    out = WORK / f"offstep_{name}_{dtype}"
    run = train_and_read(
        [
            "preset=default",
            f"model.compute_dtype={dtype}",
            f"data.task_train_size={PROMPTS}",
            f"data.train_batch_size={BATCH}",
            f"rollout.n={N}",
            f"rollout.max_new_tokens={NEW_TOKENS}",
            f"actor.optim.lr={LR}",
            "actor.optim.warmup_steps=0",
            "algorithm.use_kl_loss=false",
            "trainer.seed=0",
            "trainer.save_last=false",
            *overrides,
        ],
        out,
        steps,
    )
    return {
        "steps": [
            {"step_s": m["timing_s/step"], "gen_s": m.get("timing_s/gen"), "update_s": m.get("timing_s/update_actor")}
            for m in run.steps
        ],
        "rewards": run.rewards,
    }


OFFSTEP_RUNS = {
    "one-step, 1 + 1 cores": ("onestep", ["pipeline.max_staleness=1"]),
    "one-step, 1 + 1 cores, one row per sample": (
        "onestep_rows",
        ["pipeline.max_staleness=1", "actor.share_prompts=false"],
    ),
    "one-step, 1 + 1 cores, rollout's core lent": (
        "onestep_lend",
        ["pipeline.max_staleness=1", "pipeline.lend_cores=true"],
    ),
    "synchronous, colocated": ("sync", ["pipeline.max_staleness=0", "pipeline.colocate=true"]),
}


def _median(steps: list[dict], key: str) -> float | None:
    vals = [s[key] for s in steps[1:] if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def write_results(rows: list[dict], versions: dict, steps: int, out: Path) -> str:
    from benchmarks.common import provenance

    f = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        "# offstep against TRL's GRPOTrainer, the same work on this machine",
        "",
        provenance(),
        f"Versions: TRL {versions.get('trl')}, its torch {versions.get('torch')} and transformers "
        f"{versions.get('transformers')}; offstep from this checkout. {steps} steps a run; seconds are medians over "
        "steps 2 and later; the runs went one after another, nothing else running.",
        "",
        "| dtype | run | step s | generation s | update s | TRL step ÷ this step | reward, mean over steps |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        step, gen = _median(r["steps"], "step_s"), _median(r["steps"], "gen_s")
        update = (
            _median(r["steps"], "update_s") if r["tool"] == "offstep" else (step - gen if gen is not None else None)
        )
        trl_step = next(_median(x["steps"], "step_s") for x in rows if x["tool"] == "TRL" and x["dtype"] == r["dtype"])
        lines.append(
            f"| {r['dtype']} | {r['tool']}: {r['run']} | {f(step)} | {f(gen)} | "
            f"{f(update)}{' (step − generation)' if r['tool'] == 'TRL' else ''} | **{trl_step / step:.2f}** | "
            f"{statistics.mean(r['rewards']):.2f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument(
        "--dtypes", default="", help="float32,bfloat16 (default: bfloat16 too where the CPU has native bf16)"
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trl", default="1.16.0", help="TRL's version for its virtual environment")
    ap.add_argument("--threads", type=int, default=2, help="TRL's torch threads (offstep uses one core a pool)")
    args = ap.parse_args()
    if args.child:
        result = trl_child(json.loads(Path(args.child[0]).read_text()))
        Path(args.child[1]).write_text(json.dumps(result))
        return
    from benchmarks.common import cpu_kind
    from benchmarks.readme import refresh
    from offstep.models.loading import resolve_model

    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + (["bfloat16"] if "BF16" in cpu_kind() else [])
    python = ensure_venv(args.trl)
    model = resolve_model("smollm2-135m-instruct")
    rows, versions = [], {}
    for dtype in dtypes:
        trl = run_trl(python, model, dtype, args.steps, args.threads)
        versions = trl["versions"]
        rows.append({"tool": "TRL", "run": f"GRPOTrainer, {args.threads} threads", "dtype": dtype, **trl})
        for label, (name, overrides) in OFFSTEP_RUNS.items():
            rows.append(
                {"tool": "offstep", "run": label, "dtype": dtype, **run_offstep(name, overrides, dtype, args.steps)}
            )
        print(write_results(rows, versions, args.steps, OUTS[cpu_kind()]), flush=True)
    refresh("trl", OUTS[cpu_kind()])


if __name__ == "__main__":
    main()
