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

* ``rloo_advantage``: REINFORCE Leave-One-Out (Kool, van Hoof & Welling 2019, "Buy 4 REINFORCE
  Samples, Get a Baseline for Free!", ICLR DeepRLStructPred workshop; for LLMs Ahmadian et al.
  2024, "Back to Basics", arXiv:2402.14740): the baseline of a response is the mean score of the
  *other* responses of its group, ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean)``.
* ``reinforce_pp_advantage``: REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns of the
  token-level rewards (the outcome score at the last token, minus the per-token KL penalty when the
  KL is in the reward), normalised over the whole batch (global advantage normalisation).
* ``reinforce_pp_baseline_advantage``: REINFORCE++ with a group baseline (Hu 2025,
  arXiv:2501.03262, the "REINFORCE++-baseline" variant): the group mean is subtracted from each
  score, then the result is normalised over the whole batch rather than within the group.
* ``remax_advantage``: ReMax (Li et al. 2023, "ReMax", arXiv:2310.10505, Algorithm 1): the
  baseline is the reward of the greedy response to the same prompt; ``A_t = G_t - r_greedy`` with
  ``G_t`` the reward-to-go of token t (the score itself when the reward is outcome-only).

* ``opo_advantage``: OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
  arXiv:2505.23585): the baseline of a group is the length-weighted mean of its scores,
  ``b = sum_j |o_j| r_j / sum_j |o_j|`` (the variance-minimising baseline when the gradient's
  norm grows with the length), ``A_i = r_i - b``.
* ``gpg_advantage``: GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
  Baseline for Model Reasoning", arXiv:2504.02546): ``A_i = alpha * (r_i - group mean)`` with no
  std division, scaled by ``alpha = B / M`` to undo the dilution of the batch's gradient by
  responses that carry none. ``M`` is counted as verl's ``gpg`` estimator counts it, the responses
  of the batch with a non-zero score, so that the two frameworks' runs compare.
* ``grpo_passk_advantage``: GRPO for pass@k (as verl's ``grpo_passk``, after arXiv:2503.19595):
  only the best response of a group is credited, with ``r_max - r_second_max`` (divided by the
  group's std + eps with ``norm_by_std``); every other response gets 0. A tie for the best gives 0.

All return ``(advantages, returns)``, zero on padding. ``group_ids`` are any integers; responses
with equal ids share a prompt. A group of one response has no baseline to compare with:
GRPO, RLOO, OPO, GPG and GRPO pass@k give it advantage 0 (verl gives GRPO's ``r / (1 + eps)``
and RLOO's and OPO's ``r``: ``alone="score"``, ``algorithm.one_response_groups``), and REINFORCE++-baseline keeps its raw score before the batch whitening (as
verl), after which it is ``(r - mu) / sigma`` of the batch. ``offstep.launch.validate`` asks for
``rollout.n >= 2`` for all of them.
"""

from __future__ import annotations

import torch

from offstep.algos.common import masked_whiten


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a floating dtype at least as wide as float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _groups(scores: torch.Tensor, group_ids: torch.Tensor):
    """``(inverse, counts, one_hot, mean)``: each response's group index, group sizes ``[G]``,
    ``one_hot[g, b] = 1`` if response b is in group g, and the group means of ``scores``. Matmuls
    with ``one_hot`` keep the sums deterministic on GPU."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    one_hot = inverse[None, :] == torch.arange(len(counts), device=scores.device)[:, None]
    one_hot = one_hot.to(scores.dtype)
    counts = counts.to(scores.dtype)
    return inverse, counts, one_hot, (one_hot @ scores) / counts


def _group_std(
    scores: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor, one_hot: torch.Tensor, mean: torch.Tensor
) -> torch.Tensor:
    """The unbiased std ``[G]`` of each group's scores (as ``torch.std``; 0 for a group of one)."""
    centered = scores - mean[inverse]
    return ((one_hot @ centered**2) / (counts - 1.0).clamp_min(1.0)).sqrt()


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response ``adv`` ``[B]`` on every valid token ``[B, R]``, 0 on padding."""
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    return torch.where(response_mask.bool(), adv[:, None], zero)


def grpo_outcome_advantage(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    alone: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: ``(score - group mean) / (group std + eps)`` on every valid token.

    ``scores`` ``[B]`` are per-response rewards, ``group_ids`` ``[B]`` (any integers) say which
    responses share a prompt. The std is the unbiased one (as ``torch.std``). A group of size 1
    has no baseline to compare with and gets advantage 0 (``alone="score"``: verl's mean 0 and std 1,
    ``score / (1 + eps)``, or the score without the std). Returns ``(advantages, returns)``, both
    ``[B, R]`` with the same values (outcome-only methods use the advantage as the return).
    """
    scores = _float(scores)
    inverse, counts, one_hot, mean = _groups(scores, group_ids)
    centered = scores - mean[inverse]
    std = _group_std(scores, inverse, counts, one_hot, mean)
    adv = centered / (std[inverse] + eps) if norm_by_std else centered
    single = scores / (1.0 + eps) if norm_by_std else scores
    adv = torch.where(counts[inverse] > 1, adv, _alone(single, alone))
    adv = _broadcast(adv, response_mask)
    return adv, adv.clone()


def _alone(scores: torch.Tensor, alone: str) -> torch.Tensor:
    """The advantage of a response alone in its group: 0 (``zero``) or verl's ``scores`` (``score``)."""
    if alone not in ("zero", "score"):
        raise ValueError(f"one_response_groups={alone!r}: expected zero or score")
    return scores if alone == "score" else torch.zeros_like(scores)


def rloo_advantage(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, alone: str = "zero"
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``A_i = r_i - (sum_{j in group, j != i} r_j) / (n - 1)`` on every valid token.

    Written as ``n / (n - 1) * (r_i - group mean)``, which is the same number. A group of size 1
    gets advantage 0 (``alone="score"``: its score, as verl). Returns ``(advantages, advantages)``.
    """
    scores = _float(scores)
    inverse, counts, _, mean = _groups(scores, group_ids)
    n = counts[inverse]
    adv = torch.where(n > 1, n / (n - 1.0).clamp_min(1.0) * (scores - mean[inverse]), _alone(scores, alone))
    adv = _broadcast(adv, response_mask)
    return adv, adv.clone()


def opo_advantage(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, alone: str = "zero"
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: ``A_i = r_i - sum_j |o_j| r_j / sum_j |o_j|`` over the group, with ``|o_j|`` the valid
    tokens of response j, on every valid token. A group of size 1 gets advantage 0 (``alone="score"``:
    its score, as verl; a group whose responses have no valid token gets 0). Returns
    ``(advantages, advantages)``."""
    scores = _float(scores)
    inverse, counts, one_hot, _ = _groups(scores, group_ids)
    lengths = response_mask.bool().sum(-1).to(scores.dtype)
    weight = one_hot @ lengths
    baseline = (one_hot @ (lengths * scores)) / weight.clamp_min(1.0)
    keep = (counts[inverse] > 1) & (weight[inverse] > 0)
    single = torch.where(
        (counts[inverse] == 1) & (weight[inverse] > 0), _alone(scores, alone), torch.zeros_like(scores)
    )
    adv = torch.where(keep, scores - baseline[inverse], single)
    adv = _broadcast(adv, response_mask)
    return adv, adv.clone()


def gpg_advantage(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``A_i = alpha * (r_i - group mean)`` on every valid token, ``alpha = B / max(1, M)``
    with ``B`` the responses of the batch and ``M`` those with a non-zero score. A group of size 1
    gets advantage 0. Returns ``(advantages, advantages)``."""
    scores = _float(scores)
    inverse, counts, _, mean = _groups(scores, group_ids)
    alpha = len(scores) / (scores != 0).sum().clamp_min(1).to(scores.dtype)
    adv = torch.where(counts[inverse] > 1, alpha * (scores - mean[inverse]), torch.zeros_like(scores))
    adv = _broadcast(adv, response_mask)
    return adv, adv.clone()


def grpo_passk_advantage(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO pass@k: the best response of each group (the first one, on a tie) gets
    ``r_max - r_second_max``, divided by ``group std + eps`` (unbiased, as ``torch.std``) when
    ``norm_by_std``; every other response, and a group of size 1, gets 0. Returns
    ``(advantages, advantages)``."""
    scores = _float(scores)
    inverse, counts, one_hot, mean = _groups(scores, group_ids)
    members = one_hot.bool()
    neg_inf = torch.tensor(-torch.inf, dtype=scores.dtype, device=scores.device)
    in_group = torch.where(members, scores[None, :], neg_inf)  # [G, B]
    best = in_group.argmax(dim=-1)  # the first maximum of each group
    is_best = torch.zeros_like(members).scatter_(1, best[:, None], True)
    second = torch.where(is_best, neg_inf, in_group).max(dim=-1).values
    gap = in_group.max(dim=-1).values - second
    if norm_by_std:
        gap = gap / (_group_std(scores, inverse, counts, one_hot, mean) + eps)
    credited = is_best.any(dim=0) & (counts[inverse] > 1)  # [B]: the best of a group of >= 2
    adv = torch.where(credited, gap[inverse], torch.zeros_like(scores))
    adv = _broadcast(adv, response_mask)
    return adv, adv.clone()


def _returns_to_go(token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` with ``t'`` the next *valid* token (0 after the last one);
    padded positions are skipped (their reward is ignored) and get 0."""
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=_float(token_rewards).dtype, device=token_rewards.device)
    rewards = torch.where(valid, _float(token_rewards), zero)
    running = torch.zeros_like(rewards[:, 0])
    cols = []
    for t in reversed(range(rewards.shape[1])):
        g = rewards[:, t] + gamma * running
        cols.append(torch.where(valid[:, t], g, zero))
        running = torch.where(valid[:, t], g, running)
    return torch.stack(cols[::-1], dim=1) if cols else torch.zeros_like(rewards)


def reinforce_pp_advantage(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: returns-to-go of ``token_rewards`` ``[B, R]`` (discount ``gamma``), whitened
    over every valid token of the batch (``masked_whiten``). Returns ``(advantages, returns)``."""
    returns = _returns_to_go(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def reinforce_pp_baseline_advantage(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``score - group mean`` on every valid token, then whitened over every
    valid token of the batch. A group of one response keeps its raw score before the whitening (its
    baseline is 0, as in verl), so it ends at ``(score - mu) / sigma`` of the batch. Returns
    ``(advantages, advantages)``."""
    scores = _float(scores)
    inverse, counts, _, mean = _groups(scores, group_ids)
    baseline = torch.where(counts[inverse] > 1, mean[inverse], torch.zeros_like(scores))
    centered = _broadcast(scores - baseline, response_mask)
    adv = masked_whiten(centered, response_mask)
    return adv, adv.clone()


def remax_advantage(
    token_rewards: torch.Tensor, baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``A_t = G_t - b`` with ``G_t`` the undiscounted reward-to-go of token t and ``b``
    ``[B]`` the reward of the greedy response to the same prompt. Returns ``(advantages, G)``."""
    returns = _returns_to_go(token_rewards, response_mask, 1.0)
    adv = returns - _float(baseline_scores)[:, None]
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    return torch.where(response_mask.bool(), adv, zero), returns


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``[B, R]`` of an outcome reward: ``scores[b]`` on the last valid token of
    response b, 0 elsewhere (a response without valid tokens gets none)."""
    valid = response_mask.bool()
    pos = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, pos, -1).max(dim=-1).values
    at_last = valid & (pos[None, :] == last[:, None])
    zero = torch.zeros((), dtype=_float(scores).dtype, device=scores.device)
    return torch.where(at_last, _float(scores)[:, None], zero)


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
