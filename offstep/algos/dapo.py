"""DAPO's reward shaping and batch filtering (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476).

* ``overlong_penalty``: soft overlong punishment (section 3.4, eq. 13). With ``L_max`` the
  maximum response length and ``L_cache`` the buffer, a response of length ``|y|`` gets
  ``0`` if ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer
  (from 0 down to -1), and ``-1`` beyond ``L_max``; multiplied by a penalty factor (as verl's
  ``overlong_penalty_factor``) and added to the task reward.
* ``dynamic_sampling_keep``: dynamic sampling (section 3.2, eq. 11) keeps only the groups whose
  rewards are not all equal (``0 < |{correct}| < G`` for 0/1 rewards): a group with equal rewards
  has all-zero group-relative advantages and contributes no gradient. The loop that keeps
  generating until the batch is full lives in the controller.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Per-response penalty (<= 0) of DAPO's soft overlong punishment; ``lengths`` ``[B]``."""
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_length={max_length}]")
    lengths = lengths.to(torch.promote_types(lengths.dtype, torch.float32))
    expected = max_length - buffer_len
    inside = (expected - lengths) / buffer_len
    pen = torch.where(
        lengths <= expected,
        torch.zeros_like(lengths),
        torch.where(lengths <= max_length, inside, -torch.ones_like(lengths)),
    )
    return pen * penalty_factor


def dynamic_sampling_keep(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """Boolean ``[B]``: True for the responses whose group's scores are not all equal
    (``max - min > eps``). A group of one response is never kept (nothing to compare)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    hi = torch.full((G,), -torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, inverse, s, "amax")
    lo = torch.full((G,), torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, inverse, s, "amin")
    return (hi - lo > eps)[inverse]
