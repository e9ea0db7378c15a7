"""The model forward that the trainer roles and the rollout side share: the dtype names of the
configuration, autocast in a compute dtype, and the log-probs (and entropy) of a ``TrainBatch``'s
response tokens under a causal LM.

The rollout workers' in-engine reference scores with this same function as the trainer's
reference role, so both give the same numbers; it needs no FSDP (a sharded model is called the
same way)."""

from __future__ import annotations

import contextlib

import torch

from offstep.algos.losses import entropy_from_logits, logprobs_from_logits
from offstep.batch import TrainBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(device: torch.device, compute_dtype: str):
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[compute_dtype])


def forward_response(
    model, mb: TrainBatch, temperature: float, with_entropy: bool = False, compute_dtype: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of the response tokens (and their entropy) under ``model``.

    Logits are divided by the sampling temperature so that they match the distribution the
    rollout sampled from. Only the last R + 1 positions go through the LM head. Under a bfloat16
    ``compute_dtype`` the model runs in autocast; log-probs and entropy are taken in float32.
    """
    R = mb.response_mask.shape[1]
    with autocast(mb.input_ids.device, compute_dtype):
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            position_ids=mb.position_ids,
            use_cache=False,
            logits_to_keep=R + 1,
        )
    logits = out.logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, mb.responses)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent
