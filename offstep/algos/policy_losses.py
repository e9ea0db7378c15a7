"""Policy-gradient surrogates besides PPO's clip (``offstep.algos.losses.clipped_policy_loss``),
and ``policy_loss``, the one place that picks a surrogate by name.

All take right-padded ``[B, R]`` log-probs of the current policy (``logprob``, with gradient) and
of the policy the ratio is taken against (``old_logprob``), per-token ``advantages`` and the
``response_mask``, and return ``(per_token_loss, metrics)``: the ``[B, R]`` loss (0 on padding)
and the detached scalar metrics ``clipfrac`` and ``ppo_kl`` (masked mean of ``old - logprob``).
The reduction to a scalar is a separate choice, made once by ``offstep.algos.common.aggregate_loss``
(per-token importance weights of ``offstep.algos.correction``, ``loss_agg_mode``, ``denom``,
``horizon``).

* ``gspo_policy_loss``: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
  arXiv:2507.18071, the GSPO-token form of eq. 13): the ratio of a response is the geometric mean
  of its token ratios, ``s_i = exp(mean_t (logprob - old))``; each token uses
  ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (value ``s_i``, gradient ``s_i * grad log pi(y_t)``)
  inside PPO's clipped objective, so whole responses are clipped together. The paper's clip
  ranges are small (3e-4 / 4e-4) because a sequence ratio moves less than a token ratio.
* ``cispo_policy_loss``: CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4): the
  importance weight itself is clipped and detached, ``-sg[clip(r, 1 - low, 1 + high)] * A *
  log pi``, so every token keeps a gradient (PPO's clip zeroes it). Written as the paper and
  verl write it, so the logged ``pg_loss`` is verl's value (``-clip(r) * A * log pi``, which grows
  with the response's surprisal rather than staying near ``-A``); its gradient is
  ``-A * clip(r) * grad log pi``.
* ``pg_policy_loss``: the unclipped importance-weighted policy gradient ``-A * r`` (Williams 1992's
  REINFORCE when ``old`` is the current policy, where ``grad r = grad log pi``).
"""

from __future__ import annotations

import torch

from offstep.algos.common import masked_mean
from offstep.algos.losses import LOG_RATIO_CLAMP, _where_valid, clipped_policy_loss
from offstep.config.choices import POLICY_LOSSES


def _ratio(logprob, old_logprob, response_mask):
    log_ratio = _where_valid(logprob - old_logprob, response_mask)
    return log_ratio, torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def gspo_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token loss ``max(-A * s_it, -A * clip(s_it, 1 - low, 1 + high))`` per token. The
    paper's objective is the ``seq-mean-token-mean`` reduction of it."""
    advantages = _where_valid(advantages, response_mask)
    log_ratio, _ = _ratio(logprob, old_logprob, response_mask)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # log of the geometric mean
    lp = _where_valid(logprob, response_mask)
    log_s = (seq_log_ratio.detach()[:, None] + lp - lp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(_where_valid(log_s, response_mask))
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return torch.maximum(unclipped, clipped), metrics


def cispo_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss ``-sg[clip(r, 1 - low, 1 + high)] * A * log pi`` per token (gradient
    ``-A * clip(r) * grad log pi``). ``clipfrac``: fraction of tokens whose weight was clipped."""
    advantages = _where_valid(advantages, response_mask)
    log_ratio, ratio = _ratio(logprob, old_logprob, response_mask)
    clipped_ratio = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    metrics = {
        "clipfrac": masked_mean((clipped_ratio != ratio).float(), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return -clipped_ratio.detach() * advantages * _where_valid(logprob, response_mask), metrics


def pg_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance-weighted policy gradient ``-A * r`` per token, no clipping (``clipfrac`` 0)."""
    advantages = _where_valid(advantages, response_mask)
    log_ratio, ratio = _ratio(logprob, old_logprob, response_mask)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    return -advantages * ratio, {"clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


def policy_loss(
    mode: str,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss and metrics of the surrogate named ``mode`` (one of ``POLICY_LOSSES``).
    ``clip_ratio_c`` (dual-clip) only exists for ``"ppo"``; the clip range is unused by ``"pg"``."""
    clip = {"clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high}
    if mode != "ppo" and clip_ratio_c is not None:
        raise ValueError(f"clip_ratio_c (dual-clip) applies to the ppo loss only, not {mode!r}")
    match mode:
        case "ppo":
            return clipped_policy_loss(
                logprob, old_logprob, advantages, response_mask, **clip, clip_ratio_c=clip_ratio_c
            )
        case "gspo":
            return gspo_policy_loss(logprob, old_logprob, advantages, response_mask, **clip)
        case "cispo":
            return cispo_policy_loss(logprob, old_logprob, advantages, response_mask, **clip)
        case "pg":
            return pg_policy_loss(logprob, old_logprob, advantages, response_mask)
    raise ValueError(f"unknown policy loss {mode!r}; expected one of {POLICY_LOSSES}")
