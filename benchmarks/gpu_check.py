"""GPU check: offstep's built-in rollout engine, the actor's update and LoRA on CUDA, in one
process, without Ray, at the shapes of Qwen2.5-0.5B and Qwen2.5-1.5B with random weights.

    python -m benchmarks.gpu_check                          # on a GPU: writes results_gpu.md and its section
    python3 -m benchmarks.gpu_check --json $OUT/gpu_check.json --out $OUT/results_gpu.md   # a lent GPU
    python -m benchmarks.gpu_check --device cpu --tiny      # the same checks at tiny shapes (CI, seconds)

For each shape, in order, until ``--budget-s`` (default 420 s) would be passed (a check whose
estimate, from the same check at the previous shape scaled by parameters, does not fit is skipped
with a line saying so):

* ``engine``: ``TorchEngine`` (``offstep/rollout/engines/torch_engine.py``) in bfloat16 on a GRPO-shaped batch
  (prompts x samples, temperature 1, every sample runs to ``max_new_tokens``: random weights
  almost never sample the eos token): generated tokens/s and peak memory (the engine's own: its
  weights plus the most its call allocated above what was resident before it). Then its log-probs
  against the trainer's teacher-forced ones (``ActorWorker.compute_logprobs``: float32 master
  weights, bfloat16 autocast, ``offstep/models/forward.py``) on the same tokens: max and mean
  absolute difference over the response tokens. Then its sleep (``rollout.sleep_during_update``):
  the device memory it frees, the sleep's and the wake's seconds, the same tokens after the wake.
* ``update``: ``ActorWorker.update`` (``offstep/train/actor.py``: the GRPO loss of
  ``offstep/algos``, FSDP2 over one rank, NCCL on CUDA, gloo on CPU, AdamW step) on a batch with
  lognormal response lengths (``benchmarks.update_throughput.make_batch``), float32 master
  weights and bfloat16 compute: real (non-pad) tokens/s over the timed updates after one
  warm-up, and ``torch.cuda.max_memory_allocated`` over them.
* ``lora``: the same update with rank-32 adapters on every linear layer (``offstep/models/lora.py``).

What the lent machine lacks. It has torch, transformers, peft and pytest, no Ray, Hydra,
OmegaConf or vLLM, and no network. ``offstep.train.actor`` imports ``ray`` at module level (it
uses it only to export weights, which this check never does), so when Ray is missing a stand-in
module that raises on any use takes its place; nothing imported here needs Hydra or OmegaConf.
``tests/project/test_gpu_check.py`` runs the CPU form with Ray, Hydra, OmegaConf and vLLM made
unimportable, so a new import of one of them fails CI.

Weights. The models are built in code from transformers' ``Qwen2Config`` with the published
shapes and random weights (seed 0): speed and memory are those of the real models, but the
next-token distributions are nearly uniform, so the log-prob difference is that of flat
distributions and understates what a trained model's peaked ones give. A real checkpoint
cannot be brought to the lent machine: the 0.5B model alone is about 1 GB in bfloat16, far over
what a call carries (64 MiB), and the machine reaches no network. Where a machine has one,
``--model PATH`` (a local Hugging Face folder) runs the checks on it instead of the shapes.

The Markdown table goes to stdout and, on CUDA by default or wherever ``--out`` says, into
``benchmarks/results/results_gpu.md`` (the command, device, torch/transformers/peft versions and date
with it; written into ``benchmarks/README.md`` when it is that file); ``--json PATH`` writes
the same figures as JSON, for a device run to bring back under ``$OUT``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from benchmarks.common import RESULTS
from benchmarks.gpu_report import Row, host_cpu, recorded_command, report

RESULTS_FILE = RESULTS / "results_gpu.md"


def ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


RAY_STAND_IN = not ray_installed()


class _RayMissing(types.ModuleType):
    """Stands in for ``ray`` while ``offstep.train.actor`` (which uses it for weight export only)
    imports: any use of it raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"ray.{name}: Ray is not installed; benchmarks/gpu_check.py runs without it")


import peft  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

from benchmarks.readme import refresh  # noqa: E402
from offstep.batch import Sample, collate  # noqa: E402
from offstep.config.schema import ActorConfig, AlgorithmConfig, LoRAConfig  # noqa: E402
from offstep.models.forward import DTYPES  # noqa: E402
from offstep.models.loading import load_causal_lm  # noqa: E402
from offstep.rollout.engines.torch_engine import TorchEngine  # noqa: E402
from offstep.rollout.types import SamplingParams  # noqa: E402
from offstep.train.distributed import GroupSpec  # noqa: E402

if RAY_STAND_IN:  # only while these import: nothing else is led to believe Ray is there
    sys.modules["ray"] = _RayMissing("ray")
try:
    from benchmarks.update_throughput import make_batch  # noqa: E402
    from offstep.train.actor import ActorWorker  # noqa: E402
finally:
    if RAY_STAND_IN:
        del sys.modules["ray"]

# Qwen2.5-0.5B and -1.5B as published (config.json); "tiny" for the CPU check.
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


@dataclass(frozen=True)
class Work:
    """The batches: the engine's GRPO batch and the update's (``make_batch``'s arguments)."""

    prompts: int = 16
    group: int = 8
    prompt_len: int = 128
    new_tokens: int = 256
    update_samples: int = 128
    update_prompt: tuple[int, int] = (96, 160)
    update_response: tuple[float, float, int, int] = (160.0, 0.7, 8, 256)  # median, sigma, min, max
    micro_batch_size: int = 8
    updates: int = 2
    lora_rank: int = 32


FULL = Work()
TINY = Work(
    prompts=4,
    group=4,
    prompt_len=12,
    new_tokens=12,
    update_samples=16,
    update_prompt=(6, 12),
    update_response=(8.0, 0.7, 2, 16),
    micro_batch_size=4,
    updates=1,
    lora_rank=4,
)


class NoTokenizer:
    """What ``TorchEngine`` asks of a tokenizer, for a model with no vocabulary of words."""

    pad_token_id = 0

    @staticmethod
    def decode(ids, skip_special_tokens=True) -> str:
        return ""


# ------------------------------------------------------------------ device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s)"


# ------------------------------------------------------------------ models
def build_model(shape: str, device: torch.device, seed: int = 0):
    """The float32 causal LM of ``shape`` (a ``SHAPES`` key: random weights, built on ``device``;
    else a local model folder, loaded)."""
    torch.manual_seed(seed)
    if shape not in SHAPES:
        return load_causal_lm(shape, dtype=torch.float32).to(device)
    config = transformers.Qwen2Config(
        **SHAPES[shape],
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=SHAPES[shape]["vocab_size"] - 1,
        pad_token_id=0,
    )
    with device:
        return transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()


def make_actor(model, spec: GroupSpec, work: Work, lora_rank: int = 0) -> ActorWorker:
    """``ActorWorker`` over ``model`` (its own loader returns it): float32 master weights, bfloat16 compute."""
    cfg = ActorConfig(micro_batch_size=work.micro_batch_size, lora=LoRAConfig(rank=lora_rank))
    with mock.patch("offstep.train.actor.load_causal_lm", lambda path, dtype=None: model.to(dtype)):
        return ActorWorker(spec, 0, "built in code", "float32", "bfloat16", cfg, AlgorithmConfig(), 1.0)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ the checks
def check_engine_and_update(
    shape: str, spec: GroupSpec, device: torch.device, work: Work, log, rows: list[Row]
) -> None:
    """The engine's batch, then one actor: the engine's log-probs against its, and the full update.
    Each row goes into ``rows`` as soon as it is measured (a later failure keeps it)."""
    model = build_model(shape, device)
    params, vocab = n_params(model), model.config.vocab_size
    engine = TorchEngine(
        copy.deepcopy(model).to(DTYPES["bfloat16"]),
        NoTokenizer(),
        [vocab - 1],
        device=device,
        max_batch_size=work.prompts * work.group,
    )
    prompts = [[(37 * i + 11 * j) % (vocab - 2) + 1 for j in range(work.prompt_len)] for i in range(work.prompts)]
    warm = engine.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=4), seed=1)  # warm-up
    reset_peak(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    done = engine.generate(
        prompts, SamplingParams(n=work.group, temperature=1.0, max_new_tokens=work.new_tokens), seed=0
    )
    sync(device)
    dt = time.perf_counter() - t0
    # the engine alone: its bf16 weights and the most its call allocated (the float32 model is resident too)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    peak = None if device.type != "cuda" else peak_gib(device) - resident / 2**30 + weights
    gen = Row(
        shape,
        params,
        "engine",
        sum(len(c.response_ids) for c in done),
        dt,
        peak,
        note=f"{engine.runner} runner, bf16 weights, {work.prompts} prompts x {work.group} samples, "
        f"{work.prompt_len} + {work.new_tokens} tokens",
    )
    rows.append(gen)
    log(f"  engine: {gen.tokens} tokens in {dt:.2f} s, {gen.tokens_per_s:.0f} tokens/s")
    gen.note += sleep_and_wake(engine, device, prompts[:2], warm, log)
    del engine
    release(device)

    actor = make_actor(model, spec, work)
    samples = [
        Sample(
            uid=c.prompt_index,
            prompt_ids=prompts[c.prompt_index],
            response_ids=c.response_ids,
            rollout_logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            score=0.0,
            version=0,
        )
        for c in done
    ]
    batch = collate(samples, 0)
    trainer, _ = actor.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    diff = (trainer[mask].float() - batch.rollout_logprobs[mask].float()).abs()
    gen.diff_max, gen.diff_mean = float(diff.max()), float(diff.mean())
    log(f"  log-probs, engine against trainer: max {gen.diff_max:.3g}, mean {gen.diff_mean:.3g}")
    rows.append(time_update(actor, shape, params, "update", device, work, log))
    actor.model = actor.opt = None
    del actor, model
    release(device)


def sleep_and_wake(engine: TorchEngine, device: torch.device, prompts, warm, log) -> str:
    """``rollout.sleep_during_update``: the device memory the engine's sleep frees, the seconds of
    the sleep and of the wake, and the warm-up's tokens sampled again after the wake."""
    held = lambda: torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # noqa: E731
    before, t0 = held(), time.perf_counter()
    engine.sleep()
    freed, t1 = (before - held()) / 2**30, time.perf_counter()
    engine.wake_up()
    sync(device)
    t2 = time.perf_counter()
    again = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=4), seed=1)
    if [c.response_ids for c in again] != [c.response_ids for c in warm]:
        raise RuntimeError("the engine sampled other tokens after its sleep and wake")
    log(f"  sleep: {freed:.2f} GiB freed in {t1 - t0:.2f} s, wake {t2 - t1:.2f} s, same tokens after")
    return f"; sleep frees {freed:.2f} GiB in {t1 - t0:.2f} s, wake {t2 - t1:.2f} s"


def check_lora(shape: str, spec: GroupSpec, device: torch.device, work: Work, log, rows: list[Row]) -> None:
    model = build_model(shape, device)
    params = n_params(model)
    actor = make_actor(model, spec, work, lora_rank=work.lora_rank)
    row = time_update(actor, shape, params, "lora", device, work, log)
    row.note = f"rank {work.lora_rank}, all linear layers; " + row.note
    rows.append(row)
    actor.model = actor.opt = None
    del actor, model
    release(device)


def time_update(actor: ActorWorker, shape: str, params: int, check: str, device, work: Work, log) -> Row:
    """``work.updates`` timed ``ActorWorker.update`` calls after one warm-up."""
    median, sigma, lo, hi = work.update_response
    batch = make_batch(
        work.update_samples,
        work.group,
        actor.model.config.vocab_size,
        0,
        0,
        work.update_prompt,
        median,
        sigma,
        (lo, hi),
    )
    real = int(batch.attention_mask.sum())
    actor.update(batch)  # warm-up: kernels, allocator, AdamW's moments
    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(work.updates):
        metrics, _ = actor.update(batch)
    sync(device)
    dt = time.perf_counter() - t0
    row = Row(
        shape,
        params,
        check,
        real * work.updates,
        dt,
        peak_gib(device),
        note=f"{work.update_samples} samples, micro-batches of {work.micro_batch_size}, {work.updates} updates",
        extra={"grad_norm": metrics.get("grad_norm"), "loss": metrics.get("loss")},
    )
    log(
        f"  {check}: {row.tokens_per_s:.0f} tokens/s, peak {row.peak_gib or 0:.2f} GiB, grad norm {row.extra['grad_norm']:.3g}"
    )
    return row


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and batches (the CPU check of CI)")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {sorted(SHAPES)} (default: the two Qwen2.5 shapes)")
    ap.add_argument("--model", default=None, help="a local Hugging Face model folder instead of the shapes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip what would end past this many seconds")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument(
        "--out",
        default=None,
        help="the results file (default on CUDA without --tiny: benchmarks/results/results_gpu.md)",
    )
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)

    work = TINY if args.tiny else FULL
    shapes = (
        [args.model] if args.model else args.shapes or (["tiny"] if args.tiny else ["qwen2.5-0.5b", "qwen2.5-1.5b"])
    )
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    spec = GroupSpec(0, 1, "127.0.0.1", 0, args.device, args.threads)
    log(
        f"device {device_name(device)}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"shapes {shapes}; budget {args.budget_s:.0f} s"
        + ("; Ray not installed: stand-in module" if RAY_STAND_IN else "")
    )

    rows: list[Row] = []
    skipped: list[str] = []
    failed: list[str] = []
    took: dict[str, tuple[float, float]] = {}  # check -> (parameters, seconds) of its last run
    for shape in shapes:
        for name, fn in (("engine and update", check_engine_and_update), ("lora", check_lora)):
            elapsed = time.monotonic() - start
            size = config_params(shape)
            estimate = took[name][1] * size / took[name][0] if name in took and size else 0.0
            if elapsed + estimate > args.budget_s:
                line = f"{shape} {name}: {elapsed:.0f} s of the budget of {args.budget_s:.0f} s used" + (
                    f", about {estimate:.0f} s more would pass it" if estimate else ""
                )
                log("skipping " + line)
                skipped.append(line)
                continue
            log(f"{shape}: {name}")
            t0 = time.monotonic()
            try:
                fn(shape, spec, device, work, log, rows)
            except Exception as e:  # the other checks' figures still come back
                traceback.print_exc()
                failed.append(f"{shape} {name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0].rstrip('.')}")
                log("failed: " + failed[-1])
                release(device)
                continue
            if size:
                took[name] = (size, time.monotonic() - t0)
    if dist.is_initialized():
        dist.destroy_process_group()
    meta = {
        "command": recorded_command(argv),
        "cpu": host_cpu(device),
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
        "ray_stand_in": RAY_STAND_IN,
        "budget_s": args.budget_s,
        "elapsed_s": time.monotonic() - start,
        "tiny": args.tiny,
    }
    text = report(rows, skipped, failed, meta)
    print(text, flush=True)
    out = args.out or (str(RESULTS_FILE) if device.type == "cuda" and not args.tiny else None)
    if out:
        Path(out).write_text(text, encoding="utf-8")
        log(f"wrote {out}")
        refresh("gpu-check", out)
    if args.json:
        data = {
            **meta,
            "rows": [{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in rows],
            "skipped": skipped,
            "failed": failed,
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        log(f"wrote {args.json}")
    return 1 if failed else 0


def config_params(shape: str) -> float:
    """About the parameters of a ``SHAPES`` model, from its config (0 for a model folder)."""
    if shape not in SHAPES:
        return 0.0
    c = SHAPES[shape]
    h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return float(v * h + n * (2 * h * h + 2 * h * kv + 3 * h * i))


if __name__ == "__main__":
    sys.exit(main())
