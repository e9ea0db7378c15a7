"""torch.compile of the actor's forward and backward on the CPU, against eager, side by side in one
process: is inductor's C++ code worth its compile time for the update?

The batch is ``update_throughput.py``'s (32 samples, long-tailed response lengths), split as the
actor splits it by default (``actor.micro_token_budget=-1``: micro-batch size x the longest sample,
padding trimmed), so the micro-batches differ in shape and the compiled model runs with dynamic
shapes. Each pass is the actor's forward (``forward_response``) and a token-mean loss's backward over
every micro-batch. The model is the plain transformers model, without FSDP's one-rank wrapper.
Eager and compiled passes alternate after the compile, and the first compiled pass's seconds
(compile included, from an empty inductor cache) are reported apart.

    python -m benchmarks.compile_update                  # SmolLM2-135M, 1 thread, float32
    python -m benchmarks.compile_update --reps 5 --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import publish
from benchmarks.update_throughput import make_batch
from offstep.batch import micro_batches
from offstep.models.forward import forward_response
from offstep.models.loading import load_tokenizer, resolve_model

OUT = RESULTS / "results_compile.md"


def one_pass(model, params, micros, compute_dtype: str) -> tuple[float, float, float]:
    """Forward + backward over every micro-batch: (seconds, summed loss, gradient norm)."""
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    total = 0.0
    for mb in micros:
        logp, _ = forward_response(model, mb, 1.0, compute_dtype=compute_dtype)
        loss = -(logp * mb.response_mask).sum() / mb.response_mask.sum()
        loss.backward()
        total += float(loss.detach())
    dt = time.perf_counter() - t0
    norm = sum(float(p.grad.pow(2).sum()) for p in params if p.grad is not None) ** 0.5
    return dt, total, norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--note", default="", help="what else ran on the machine, for the results file")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = make_batch(32, 4, model.config.vocab_size, pad, 0, (28, 44), 16.0, 0.7, (5, 64))
    budget = args.micro_batch_size * batch.input_ids.shape[1]  # actor.micro_token_budget=-1 on this layout
    micros = [mb for _, mb in micro_batches(batch, args.micro_batch_size, budget)]

    one_pass(model, params, micros, args.compute_dtype)  # eager warm-up
    # a cache of its own, empty: the first pass pays the whole compile, as a fresh machine's run would
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="offstep-inductor-")
    compiled = torch.compile(model, dynamic=True)
    first = one_pass(compiled, params, micros, args.compute_dtype)
    eager, comp = [], []
    for _ in range(args.reps):  # alternating, so drift affects both alike
        eager.append(one_pass(model, params, micros, args.compute_dtype))
        comp.append(one_pass(compiled, params, micros, args.compute_dtype))
        print(f"eager {eager[-1][0]:.2f} s, compiled {comp[-1][0]:.2f} s", flush=True)
    e, c = (statistics.median(r[0] for r in rs) for rs in (eager, comp))
    saved = e - c
    lines = [
        "# torch.compile of the actor's forward and backward, against eager",
        "",
        provenance(),
        "",
        f"Machine: {platform.machine()} CPU, {args.threads} thread(s), torch {torch.__version__}. Model {args.model}, fp32 "
        f"weights, {args.compute_dtype} compute; `torch.compile(model, dynamic=True)` (inductor). One pass: forward and "
        f"backward over the {len(micros)} micro-batches ({', '.join(f'{m.input_ids.shape[0]} x {m.input_ids.shape[1]}' for m in micros)}) "
        f"of the default token budget ({budget}) on update_throughput.py's batch; medians of {args.reps} alternating "
        f"passes after the compile.{(' ' + args.note) if args.note else ''}",
        "",
        "| setting | s / pass (median) | speed-up | first pass s (compile included) | loss rel. diff | grad-norm rel. diff |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| eager | {e:.2f} | 1.00x | — | 0.0e+00 | 0.0e+00 |",
        f"| torch.compile | {c:.2f} | {e / c:.2f}x | {first[0]:.0f} | "
        f"{abs(comp[0][1] - eager[0][1]) / abs(eager[0][1]):.1e} | {abs(comp[0][2] - eager[0][2]) / eager[0][2]:.1e} |",
        "",
        (
            f"The compile pays for itself after about {first[0] / saved:.0f} passes (one pass a step at this batch)."
            if saved > 0
            else "The compiled pass is not faster: the compile never pays for itself."
        ),
    ]
    publish("update", args.out, lines)


if __name__ == "__main__":
    main()
