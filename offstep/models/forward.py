"""The model forward that the trainer roles and the rollout side share: the dtype names of the
configuration, autocast in a compute dtype, and the log-probs (and entropy) of a ``TrainBatch``'s
response tokens under a causal LM.

The rollout workers' in-engine reference scores with this same function as the trainer's
reference role, so both give the same numbers; it needs no FSDP (a sharded model is called the
same way).

``entropy_from_logits`` / ``logprobs_from_logits``: softmax entropy
``H = logsumexp(z) - sum_v softmax(z)_v z_v`` and label log-probs ``log p_y = z_y - logsumexp(z)``,
both stable for large logits; half-precision logits are upcast to float32 (row by row for the
log-probs, so no float32 copy of the whole tensor)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from offstep.batch import Sample, TrainBatch, collate, prompt_groups, prompt_units, sample_lengths
from offstep.models.lora import base_of
from offstep.models.prompt_sharing import shared_layout
from offstep.models.vision import (
    ban_vision_tokens,
    concat_images,
    mrope_positions,
    unused_tower_term,
    vision_token_ids,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., labels]``: ``logits`` ``[..., V]``, ``labels`` ``[...]``.

    float32/float64 logits use ``z_y - logsumexp(z)`` (no ``[..., V]`` log-softmax output). Half
    precision logits are processed one leading row at a time in float32, so only one row's upcast
    copy exists at once; the result is float32.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        for row, lab in zip(logits, labels)
    ]
    return torch.stack(rows) if rows else logits.new_zeros(labels.shape, dtype=torch.float32)


def autocast(device: torch.device, compute_dtype: str):
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[compute_dtype])


def forward_response(
    model,
    mb: TrainBatch,
    temperature: float,
    with_entropy: bool = False,
    compute_dtype: str = "float32",
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of the response tokens (and their entropy) under ``model``.

    Logits are divided by the sampling temperature so that they match the distribution the
    rollout sampled from. Only the last R + 1 positions go through the LM head. Under a bfloat16
    ``compute_dtype`` the model runs in autocast; log-probs and entropy are taken in float32.
    ``share_prompts``: rows with the same prompt run as one packed sequence, the prompt once
    (``offstep.models.prompt_sharing``); the result has the same layout, equal to rounding.
    """
    logits = response_logits(model, mb, temperature, compute_dtype, share_prompts)
    logp = logprobs_from_logits(logits, mb.responses)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def response_logits(
    model, mb: TrainBatch, temperature: float, compute_dtype: str = "float32", share_prompts: bool = False
) -> torch.Tensor:
    """The float32 logits [B, R, V] that predict each response token, divided by ``temperature``
    (> 0): ``forward_response``'s, for a loss over the vocabulary (``distill.loss_mode=forward_kl_topk``)."""
    R = mb.response_mask.shape[1]
    pics = None
    if mb.images:  # this micro-batch's rows' images, in row order; 3-D positions
        pics = concat_images([mb.images.get(u) for u in mb.group_ids.tolist()], mb.input_ids.device)
    share_prompts = share_prompts and pics is None  # the shared layout has 2-D positions only
    units = prompt_units(prompt_groups(mb), *sample_lengths(mb)) if share_prompts else None
    layout = shared_layout(mb, units) if units is not None and len(units) < len(mb) else None  # a prompt repeats
    with autocast(mb.input_ids.device, compute_dtype):
        if layout is None:
            extra, position_ids = {}, mb.position_ids
            if pics is not None:
                extra = {"pixel_values": pics.pixel_values, "image_grid_thw": pics.grid_thw}
                position_ids = mrope_positions(base_of(model), mb.input_ids, mb.attention_mask, pics.grid_thw)[0]
            out = model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=R + 1,
                **extra,
            )
            logits = out.logits[:, :-1]
        else:
            out = model(
                input_ids=layout.input_ids,
                attention_mask=layout.attention_mask,
                position_ids=layout.position_ids,
                use_cache=False,
                logits_to_keep=layout.keep,
            )
            logits = layout.logits(out.logits)
    logits = logits.float()
    if pics is None and torch.is_grad_enabled() and (term := unused_tower_term(base_of(model))) is not None:
        logits = logits + term  # a VL model's micro-batch without images: see unused_tower_term
    if temperature > 0:
        logits = logits / temperature
    return ban_vision_tokens(logits, vision_token_ids(getattr(base_of(model), "config", None)))


@torch.no_grad()
def sequence_logprobs(
    model,
    sequences,
    pad_id: int,
    device,
    temperature: float,
    compute_dtype: str = "float32",
    micro_batch_size: int = 8,
    share_prompts: bool = False,
    images: Sequence | None = None,
) -> list[list[float]]:
    """Teacher-forced log-probs of each ``(prompt_ids, response_ids)``'s response under ``model``,
    as the trainer computes them: one padded batch, ``forward_response`` by micro-batches of
    ``micro_batch_size`` rows (``share_prompts``: rows of one prompt packed after it). ``images``: per
    sequence, its prompt's ``offstep.models.vision.ImageInputs`` or None (a vision-language model)."""
    if not sequences:
        return []
    pictured = images is not None and any(x is not None for x in images)
    samples = [
        Sample(
            uid=i if pictured else 0,  # with images: a row's own, the key of batch.images
            prompt_ids=list(p),
            response_ids=list(r),
            rollout_logprobs=[0.0] * len(r),
            finish_reason="",
            score=0.0,
            version=0,
        )
        for i, (p, r) in enumerate(sequences)
    ]
    batch = collate(samples, pad_id).to(device)
    if pictured:
        batch.images = {i: x for i, x in enumerate(images) if x is not None}
    parts = [
        forward_response(model, mb, temperature, compute_dtype=compute_dtype, share_prompts=share_prompts)[0]
        for mb in batch.chunks(micro_batch_size)
    ]
    logp = torch.cat(parts).cpu()
    return [logp[i, : len(r)].tolist() for i, (_, r) in enumerate(sequences)]


@torch.no_grad()
def sequence_topk(
    model,
    sequences,
    pad_id: int,
    device,
    temperature: float,
    k: int,
    compute_dtype: str = "float32",
    micro_batch_size: int = 8,
) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
    """``sequence_logprobs`` with, at each response position, the ``k`` most likely ids and their
    log-probs (a distillation teacher's top-k: ``offstep.algos.distill.topk_forward_kl``)."""
    if not sequences:
        return []
    samples = [
        Sample(
            uid=0,
            prompt_ids=list(p),
            response_ids=list(r),
            rollout_logprobs=[0.0] * len(r),
            finish_reason="",
            score=0.0,
            version=0,
        )
        for p, r in sequences
    ]
    batch = collate(samples, pad_id).to(device)
    out = []
    for j, mb in enumerate(batch.chunks(micro_batch_size)):
        logits = response_logits(model, mb, temperature, compute_dtype)
        logp = logprobs_from_logits(logits, mb.responses).cpu()
        top = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
        values, ids = top.values.cpu(), top.indices.cpu()
        for i in range(len(mb)):
            n = len(sequences[j * micro_batch_size + i][1])
            out.append((logp[i, :n].tolist(), ids[i, :n].tolist(), values[i, :n].tolist()))
    return out
