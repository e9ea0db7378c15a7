"""Off-policy correction for the rollout/trainer log-prob mismatch.

The rollout engine samples tokens from ``pi_rollout`` (its own kernels, precision, possibly an
older weight version), while the trainer's recomputed log-probs ``old_logprob`` define
``pi_old``, the policy PPO's ratio is taken against. The policy-gradient estimate is then off
policy; it is corrected by the importance weight ``pi_old / pi_rollout`` of each sampled token,
truncated at ``cap`` to bound its variance (truncated importance sampling, TIS), as proposed by
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(https://fengyao.notion.site/off-policy-rl), and by Ionides 2008 ("Truncated Importance
Sampling", J. Comput. Graph. Stat.) for the truncation itself; the sequence-level variant uses
the product of the token ratios of a response (as verl's ``rollout_is`` sequence level).

Mismatch diagnostics estimate KL(pi_rollout || pi_old) from the rollout's own samples with the
k1 and k3 estimators of J. Schulman, http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

import math

import torch

from offstep.algos.common import masked_mean

LOG_RATIO_CLAMP = 20.0


def truncated_importance_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float | None = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights ``pi_old / pi_rollout`` to multiply the per-token policy loss.

    ``level="token"``: ``w_t = min(exp(old_t - rollout_t), cap)``.
    ``level="sequence"``: ``w = min(exp(sum_t (old_t - rollout_t)), cap)`` over the valid tokens
    of each response, broadcast to its tokens. ``cap=None`` disables truncation (log-ratios are
    then capped at exp(20) to avoid overflow). Weights are detached, 0 on padding.

    Metrics (detached scalars): ``mismatch_kl_k1`` = masked mean of ``rollout - old`` and
    ``mismatch_kl_k3`` = masked mean of ``exp(d) - d - 1`` with ``d = old - rollout``, both
    estimates of KL(rollout || trainer) per token; ``is_weight_mean`` / ``is_weight_max`` of the
    returned weights and ``is_truncated_frac``, the fraction whose untruncated weight exceeds
    ``cap``, all taken over valid tokens (token level) or over sequences with at least one valid
    token (sequence level).
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    log_ratio = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    if level == "token":
        units, unit_mask = log_ratio, valid
    elif level == "sequence":
        units, unit_mask = log_ratio.sum(dim=-1), valid.any(dim=-1)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}; expected token or sequence")

    raw = torch.exp(units.clamp(max=LOG_RATIO_CLAMP))  # exp(20) ~ 5e8: no overflow
    weights = torch.where(unit_mask, raw if cap is None else raw.clamp(max=cap), zero)
    truncated = (units > math.log(cap)) if cap is not None else torch.zeros_like(unit_mask)

    d = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {
        "mismatch_kl_k1": masked_mean(-log_ratio, valid),
        "mismatch_kl_k3": masked_mean(torch.exp(d) - d - 1.0, valid),
        "is_weight_mean": masked_mean(weights, unit_mask),
        "is_weight_max": weights.max() if weights.numel() else zero,  # weights >= 0, 0 on padding
        "is_truncated_frac": masked_mean(truncated.to(weights.dtype), unit_mask),
    }
    if level == "sequence":
        weights = torch.where(valid, weights[:, None], zero)
    return weights, metrics
