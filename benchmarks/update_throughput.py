"""Update throughput: padded fixed-count micro-batches vs token-budget micro-batches with the
padding trimmed (``actor.micro_token_budget``), measured side by side in one process.

One batch of samples with a realistic spread of response lengths (lognormal, clipped to
``[--min-response, --max-response]`` like a rollout capped by ``max_new_tokens``) goes through one
forward + backward pass of the real actor (``ActorWorker._micro_batches`` + ``_micro_step``, the
functions ``ActorWorker.update`` runs; FSDP2 over one gloo rank, no Ray), once per setting and
repetition, settings interleaved. No optimizer step, so every repetition sees the same weights.

Reported per setting: micro-batches, computed token slots (rows x width summed over micro-batches),
the share of them that is padding, the median seconds per pass and update tokens/s (real, non-pad
prompt + response tokens per second), the speed-up over the padded baseline, and the relative
difference of the loss and gradient norm from the baseline (exactness check). Last, the default
budget planned by prompt with each prompt computed once for its responses (``actor.share_prompts``,
offstep's default: ``offstep.models.prompt_sharing``); its token slots are the packed rows'. With ``--packed``,
also the default budget's micro-batches packed: each micro-batch's real tokens in one sequence, the
positions restarting per sample (transformers then masks attention block-diagonally), the LM head
over only the positions that predict response tokens; a measurement of packing, done here by
swapping the actor's forward, not a path offstep's update takes. Then the AdamW step over the same
parameters: torch's per-tensor loop against the fused kernel offstep uses.

    python -m benchmarks.update_throughput                    # SmolLM2-135M, 32 samples, 1 thread
    python -m benchmarks.update_throughput --reps 5 --threads 2 --budgets 1024 2048
    python -m benchmarks.update_throughput --packed --out benchmarks/results/results_update_avx512.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

import offstep.train.actor as actor_module
from benchmarks.common import RESULTS, command, provenance
from benchmarks.readme import publish
from offstep.batch import Sample, collate, prompt_groups, sample_lengths
from offstep.config.schema import ActorConfig, AlgorithmConfig
from offstep.models.forward import autocast, entropy_from_logits, logprobs_from_logits
from offstep.models.loading import load_tokenizer, resolve_model
from offstep.models.prompt_sharing import shared_layout
from offstep.train.actor import ActorWorker
from offstep.train.distributed import GroupSpec


def make_batch(
    n: int,
    group: int,
    vocab: int,
    pad_id: int,
    seed: int,
    prompt_range,
    resp_median: float,
    resp_sigma: float,
    resp_range,
):
    """``n`` samples in groups of ``group`` sharing a prompt (length uniform in ``prompt_range``);
    response lengths lognormal (median, sigma), clipped to ``resp_range``."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = resp_range
    samples = []
    for i in range(n):
        if i % group == 0:  # GRPO: `group` samples answer the same prompt
            p = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=g))
            prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        z = float(torch.randn(1, generator=g))
        r = int(min(hi, max(lo, round(resp_median * math.exp(resp_sigma * z)))))
        samples.append(
            Sample(
                uid=i // group,
                prompt_ids=prompt,
                response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(),
                rollout_logprobs=(-torch.rand(r, generator=g) * 2).tolist(),
                finish_reason="stop",
                score=float(i % 2),
                version=0,
                ref_logprobs=(-torch.rand(r, generator=g) * 2).tolist(),
            )
        )
    batch = collate(samples, pad_id)
    batch.advantages = torch.randn(n, 1, generator=g) * batch.response_mask
    return batch


def packed_forward_response(
    model,
    mb,
    temperature: float,
    with_entropy: bool = False,
    compute_dtype: str = "float32",
    share_prompts: bool = False,
):
    """``forward_response`` with the micro-batch packed (``share_prompts``: off in the settings that
    use it): every row's real tokens (prompt and
    response, no padding) in one sequence, the positions restarting at each row, so transformers
    masks attention to each row's own tokens (block-diagonal causal); only the positions that
    predict a response token go through the LM head. Returns the same ``[B, R]`` log-probs (and
    entropy), zero where the response is padding. A measurement, not offstep's path."""
    B, R, P = mb.input_ids.shape[0], mb.response_mask.shape[1], mb.prompt_len
    real = mb.attention_mask.bool()
    packed_at = real.flatten().cumsum(0).view_as(real) - 1  # each real token's index in the packed row
    target = real[:, P:]  # response tokens (not padding)
    predict = packed_at[:, P - 1 : P + R - 1][target]  # the packed positions whose logits predict them
    with autocast(mb.input_ids.device, compute_dtype):
        out = model(
            input_ids=mb.input_ids[real][None],
            position_ids=mb.position_ids[real][None],
            use_cache=False,
            logits_to_keep=predict,
        )
    logits = out.logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logp = logits.new_zeros(B, R)
    logp[target] = logprobs_from_logits(logits, mb.responses[target])
    ent = None
    if with_entropy:
        ent = logits.new_zeros(B, R)
        ent[target] = entropy_from_logits(logits)
    return logp, ent


def one_pass(
    actor: ActorWorker, batch, micro: int, budget: int, packed: bool = False, share: bool = False
) -> tuple[float, float, float, int, int]:
    """Forward + backward over ``batch`` (each micro-batch packed into one sequence if ``packed``;
    each prompt computed once for its responses if ``share``, offstep's ``actor.share_prompts``):
    (seconds, loss, grad norm, micro-batches, token slots)."""
    actor.opt.zero_grad(set_to_none=True)
    actor.cfg.share_prompts = share
    padded = actor_module.forward_response
    actor_module.forward_response = packed_forward_response if packed else padded
    try:
        t0 = time.perf_counter()
        denom = actor._denominator(batch, actor.algo.loss_agg_mode)
        micros = actor._micro_batches(batch, micro, budget, share)
        loss = sum(actor._micro_step(mb, denom)["pg_loss"] for _, mb in micros)
        dt = time.perf_counter() - t0
    finally:
        actor_module.forward_response = padded
    sq = 0.0
    for p in actor.model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            sq += float(g.float().pow(2).sum())
    actor.opt.zero_grad(set_to_none=True)
    slots = sum(
        int(mb.attention_mask.sum())
        if packed
        else shared_layout(mb).input_ids.numel()
        if share
        else mb.input_ids.numel()
        for _, mb in micros
    )
    computed = sum(_shared_real(mb) if share else int(mb.attention_mask.sum()) for _, mb in micros)
    return dt, loss, math.sqrt(sq), len(micros), slots, computed


def _shared_real(mb) -> int:
    """Real tokens of ``mb``'s packed rows: each distinct prompt once, every response."""
    prompts, responses = sample_lengths(mb)
    return sum(prompts[g[0]] + sum(responses[b] for b in g) for g in prompt_groups(mb))


def optimizer_steps(params: list, reps: int) -> list[tuple[str, float, float]]:
    """torch's per-tensor AdamW loop against the fused AdamW that ``make_optimizer`` builds, over
    ``params`` with the same small gradients: (setting, median seconds per step, largest relative
    difference of a weight from the loop's after one step from the same state)."""
    torch.manual_seed(0)
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    start = [p.detach().clone() for p in params]  # same kind (DTensor or tensor) as the parameters
    out, after = [], {}
    for name, kw in (("AdamW, per-tensor loop", {"foreach": False}), ("AdamW, fused (offstep's)", {"fused": True})):
        for p, w, g in zip(params, start, grads):
            p.data.copy_(w)
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-5, **kw)
        opt.step()
        after[name] = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in params]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out.append((name, statistics.median(times)))
    base, fused = after.values()
    diff = max(float(((a - b).abs() / b.abs().clamp_min(1e-12)).max()) for a, b in zip(fused, base))
    for p, w in zip(params, start):
        p.data.copy_(w)
        p.grad = None
    return [(name, t, 0.0 if i == 0 else diff) for i, (name, t) in enumerate(out)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (rollout.n)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="the padded baseline's rows per micro-batch")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[28, 44])
    ap.add_argument("--response-median", type=float, default=16.0)
    ap.add_argument("--response-sigma", type=float, default=0.7)
    ap.add_argument("--response-range", type=int, nargs=2, default=[5, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--packed",
        action="store_true",
        help="also the default budget's micro-batches packed into one "
        "sequence each (block-diagonal attention, no padding): a measurement, not offstep's path",
    )
    ap.add_argument("--out", default=str(RESULTS / "results_update.md"))
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    spec = GroupSpec(0, 1, "127.0.0.1", 0, args.device, args.threads)
    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    actor = ActorWorker(
        spec,
        0,
        path,
        "float32",
        args.compute_dtype,
        ActorConfig(micro_batch_size=args.micro_batch_size),
        AlgorithmConfig(),
        1.0,
    )
    vocab = actor.model.config.vocab_size
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = make_batch(
        args.samples,
        args.group,
        vocab,
        pad,
        args.seed,
        args.prompt_range,
        args.response_median,
        args.response_sigma,
        args.response_range,
    ).to(actor.device)
    real = int(batch.attention_mask.sum())
    resp = batch.response_mask.sum(-1).long().tolist()

    auto = args.micro_batch_size * batch.input_ids.shape[1]  # actor.micro_token_budget=-1 on this batch's layout
    # (name, budget, packed, shared prompts)
    settings = [("padded, fixed count", 0, False, False)]
    settings += [(f"token budget {b}, trimmed", b, False, False) for b in args.budgets]
    settings.append(
        (f"token budget {auto} (the default -1: {args.micro_batch_size} x the longest), trimmed", auto, False, False)
    )
    if args.packed:  # the default budget's micro-batches, each packed into one sequence
        settings.append((f"token budget {auto}, packed (no padding)", auto, True, False))
    settings.append((f"token budget {auto}, each prompt once (`actor.share_prompts`, the default)", auto, False, True))
    one_pass(actor, batch, args.micro_batch_size, 0)  # warm-up (allocator, kernels)
    runs: dict[str, list] = {s[0]: [] for s in settings}
    for _ in range(args.reps):
        for name, budget, packed, share in settings:  # interleaved, so drift affects every setting alike
            runs[name].append(one_pass(actor, batch, args.micro_batch_size, budget, packed, share))
            print(name, f"{runs[name][-1][0]:.2f} s", flush=True)
    params = list(actor.model.parameters())  # FSDP2's DTensors over one rank, as the actor's optimizer sees them
    adam = optimizer_steps([p for p in params if p.requires_grad], args.reps)
    actor.shutdown()

    base_t = statistics.median(r[0] for r in runs[settings[0][0]])
    _, base_loss, base_norm, *_ = runs[settings[0][0]][0]
    device = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU, {args.threads} thread(s)"
    )
    lines = [
        "# Update throughput: padded fixed-count vs token-budget micro-batches (padding trimmed) vs each prompt once",
        "",
        provenance(),
        "",
        f"Machine: {device}, torch {torch.__version__}, Python {platform.python_version()}. Model {args.model}, "
        f"fp32 weights, {args.compute_dtype} compute. One forward + backward pass of the actor over {args.samples} samples "
        f"(no optimizer step); medians of {args.reps} repetitions, settings interleaved, in one process.",
        "",
        f"Batch: {args.samples // args.group} prompts x {args.group} samples; prompts uniform in {args.prompt_range[0]}..{args.prompt_range[1]} tokens; responses lognormal "
        f"(median {args.response_median:g}, sigma {args.response_sigma:g}) clipped to {args.response_range[0]}..{args.response_range[1]}: "
        f"min {min(resp)}, median {statistics.median(resp):g}, mean {sum(resp) / len(resp):.1f}, max {max(resp)}. Padded layout "
        f"{len(batch)} x {batch.input_ids.shape[1]} = {batch.input_ids.numel()} token slots, {real} real tokens.",
        "",
        "| setting | micro-batches | token slots computed | padding share | s / pass (median) | update tokens/s | speed-up | loss rel. diff | grad-norm rel. diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, *_ in settings:
        rs = runs[name]
        t = statistics.median(r[0] for r in rs)
        _, loss, norm, n_micro, slots, computed = rs[0]
        lines.append(
            f"| {name} | {n_micro} | {slots} | {1 - computed / slots:.0%} | {t:.2f} | {real / t:.0f} | {base_t / t:.2f}x | "
            f"{abs(loss - base_loss) / max(abs(base_loss), 1e-12):.1e} | {abs(norm - base_norm) / max(base_norm, 1e-12):.1e} |"
        )
    lines += [
        "",
        f"The optimizer step over the same model's {sum(p.numel() for p in params) / 1e6:.0f}M parameters (median of {args.reps}; "
        "relative difference: the largest of any weight after one step from the same state and gradients):",
        "",
        "| optimizer | s / step (median) | speed-up | weight rel. diff |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {name} | {t:.3f} | {adam[0][1] / t:.1f}x | {d:.1e} |" for name, t, d in adam]
    lines += [
        "",
        f"Regenerate: `{command()}`.",
    ]
    publish("update", args.out, lines)


if __name__ == "__main__":
    main()
