"""Advantage estimators for right-padded ``[B, R]`` response tensors.

* ``grpo_outcome_advantage``: the group-relative outcome advantage of GRPO (Shao et al. 2024,
  "DeepSeekMath", arXiv:2402.03300, section 4.1.2): each response's scalar score minus the mean
  of the scores of its group (the responses sampled for the same prompt), divided by the group's
  standard deviation, given to every token of the response. ``norm_by_std=False`` drops the
  division, as Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) recommends.
* ``gae_advantage``: Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438, eq. 16):
  ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, with
  returns ``A_t + V_t`` as the value-function targets (as in PPO, Schulman et al. 2017).

Both return ``(advantages, returns)``, zero on padding.
"""

from __future__ import annotations

import torch

from offstep.algos.common import masked_whiten


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a floating dtype at least as wide as float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def grpo_outcome_advantage(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: ``(score - group mean) / (group std + eps)`` on every valid token.

    ``scores`` ``[B]`` are per-response rewards, ``group_ids`` ``[B]`` (any integers) say which
    responses share a prompt. The std is the unbiased one (as ``torch.std``). A group of size 1
    has no baseline to compare with and gets advantage 0. Returns ``(advantages, returns)``, both
    ``[B, R]`` with the same values (outcome-only methods use the advantage as the return).
    """
    scores = _float(scores)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    # one_hot[g, b] = 1 if response b is in group g; matmuls keep this deterministic on GPU.
    one_hot = (inverse[None, :] == torch.arange(len(counts), device=scores.device)[:, None])
    one_hot = one_hot.to(scores.dtype)
    counts = counts.to(scores.dtype)
    mean = (one_hot @ scores) / counts
    centered = scores - mean[inverse]
    std = ((one_hot @ centered**2) / (counts - 1.0).clamp_min(1.0)).sqrt()
    adv = centered / (std[inverse] + eps) if norm_by_std else centered
    adv = torch.where(counts[inverse] > 1, adv, torch.zeros_like(adv))
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    adv = torch.where(response_mask.bool(), adv[:, None], zero)
    return adv, adv.clone()


def gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the valid response tokens, computed backwards in time.

    Padded positions are skipped: the value and advantage carried into a valid token ``t`` are
    those of the next *valid* token, and 0 after the last one (the episode ends there). Padding in
    the middle of a response (e.g. masked tool output) is skipped the same way.

    Returns ``(advantages, returns)`` ``[B, R]``, zero on padding: ``returns = A + V`` with the raw
    advantages, and the advantages then whitened over the mask when ``whiten``.
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=_float(values).dtype, device=values.device)
    rewards = torch.where(valid, _float(token_rewards), zero)
    values = torch.where(valid, _float(values), zero)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv_cols = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # on padding: emit 0 and carry the next valid token's value/advantage through unchanged
        adv_cols.append(torch.where(valid[:, t], adv_t, zero))
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
    advantages = torch.stack(adv_cols[::-1], dim=1) if adv_cols else torch.zeros_like(values)
    returns = advantages + values  # both already 0 on padding
    if whiten:
        advantages = masked_whiten(advantages, valid)
    return advantages, returns
