"""Policy, value and KL losses for LLM RL (the log-probs and entropy they take are
``offstep.models.forward``'s).

* ``clipped_policy_loss``: PPO's clipped surrogate objective (Schulman et al. 2017, "Proximal
  Policy Optimization Algorithms", arXiv:1707.06347, eq. 7), with the asymmetric clip range
  ``[1 - low, 1 + high]`` of DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476), written as a
  loss to minimise: ``max(-A * r, -A * clip(r, 1 - low, 1 + high))`` per token; the reduction
  (importance weights, ``loss_agg_mode``) is ``offstep.algos.common.aggregate_loss``'s. With
  ``clip_ratio_c`` the dual-clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games with
  Deep Reinforcement Learning", arXiv:1912.09729, eq. 5) also bounds the loss of negative-advantage
  tokens by ``-A * c``, so a huge ratio on a bad token cannot dominate the update. The other
  surrogates (GSPO, CISPO, plain policy gradient) are in ``offstep.algos.policy_losses``.
* ``value_loss``: PPO's clipped value loss, ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``
  (as in OpenAI baselines' ppo2, also described in Engstrom et al. 2020, arXiv:2005.12729).
* ``kl_penalty``: per-token estimators of KL(pi || pi_ref) from samples of pi: k1, k2 and k3 of
  J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html (k3 is the
  "low_var_kl" used as GRPO's KL loss, Shao et al. 2024, arXiv:2402.03300, eq. 4). A kind ending
  in ``+`` (``k1+``, ``k3+``, ...; verl's names) is straight-through: the base estimator's value
  with k2's gradient. k1's and k3's values are unbiased estimates of the KL, but their expected
  gradients are not the KL's gradient (k1's is 0 on samples of pi); k2's gradient,
  ``(logprob - ref) * grad logprob``, is (verl PR 2953's argument).
"""

from __future__ import annotations

import torch

from offstep.algos.common import aggregate_loss, masked_mean
from offstep.config.choices import KL_ESTIMATORS  # "kl" is verl's name for k1; "+": straight-through

LOG_RATIO_CLAMP = 20.0


def _where_valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with padded entries replaced by 0, so garbage there cannot reach values or grads."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def clipped_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate: the per-token loss ``[B, R]`` (reduce it with ``aggregate_loss``).

    ``r = exp(clamp(logprob - old_logprob, -20, 20))``; per-token loss
    ``max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; with ``clip_ratio_c``
    (dual-clip, > 1) the loss of tokens with ``A < 0`` is then ``min(that, -A * clip_ratio_c)``.
    Padded entries are 0. Metrics (detached scalars): ``clipfrac``, the fraction of valid tokens
    where the clipped branch is the larger (active) one, ``ppo_kl``, the masked mean of
    ``old_logprob - logprob``, and with ``clip_ratio_c`` ``dual_clipfrac``, the fraction of valid
    tokens where the dual clip is active.
    """
    advantages = _where_valid(advantages, response_mask)
    log_ratio = _where_valid(logprob - old_logprob, response_mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
        metrics["dual_clipfrac"] = masked_mean(dual.float(), response_mask).detach()
    return per_token, metrics


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (elementwise).

    ``kind``: ``"k1"``/``"kl"`` ``logprob - ref``; ``"abs"`` ``|logprob - ref|``; ``"mse"``/``"k2"``
    ``0.5 * (logprob - ref)^2``; ``"low_var_kl"``/``"k3"`` ``exp(ref - logprob) - (ref - logprob)
    - 1`` (unbiased and non-negative), with the exponent clamped to [-20, 20] and the result to
    [-10, 10] for numerical safety. ``kind + "+"`` (e.g. ``"k3+"``): the value of ``kind`` and the
    gradient of ``"k2"``, ``k2 - sg[k2] + sg[kind]``.
    """
    if kind.endswith("+") and kind in KL_ESTIMATORS:
        k2 = kl_penalty(logprob, ref_logprob, "k2")
        return k2 - k2.detach() + kl_penalty(logprob, ref_logprob, kind[:-1]).detach()
    diff = logprob - ref_logprob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff**2
    if kind in ("low_var_kl", "k3"):
        neg = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_penalty kind {kind!r}; expected one of {KL_ESTIMATORS}")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float = 0.2,
    loss_agg_mode: str = "token-mean",
    denom: float | torch.Tensor | None = None,
    horizon: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((v - ret)^2, (old + clip(v - old, -c, c) - ret)^2)``.

    Aggregated with ``aggregate_loss(loss_agg_mode, denom, horizon)``. Metric ``vf_clipfrac``: the
    fraction of valid tokens where the clipped term is the larger one.
    """
    values = _where_valid(values, response_mask)
    old_values = _where_valid(old_values, response_mask)
    returns = _where_valid(returns, response_mask)
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, denom=denom, horizon=horizon)
    metrics = {"vf_clipfrac": masked_mean((clipped_sq > unclipped_sq).float(), response_mask)}
    return loss, {k: v.detach() for k, v in metrics.items()}
