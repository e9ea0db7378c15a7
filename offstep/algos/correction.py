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

Multiplying the PPO loss (taken against ``pi_old``, the "proximal" policy) by these weights is
the decoupled PPO objective of Hilton et al. 2022, "Batch size-invariance for policy
optimization", arXiv:2110.00641 (behaviour policy = the rollout, proximal policy = the trainer's
recomputation).

``rejection_mask`` drops (weight 0) tokens or whole responses whose ratio lies outside
``[low, high]`` — per token, for the product over a response ("sequence"), or for its geometric
mean ("geometric") — or whose mean per-token mismatch KL exceeds a threshold: the masked
importance sampling / rejection sampling of verl's rollout correction (after Yao et al. 2025 and
Liu et al. 2025, "When Speed Kills Stability", https://yingru.notion.site/When-Speed-Kills-Stability).
It departs from verl in one way: a rejected token keeps its place in the loss normaliser (its
weight is 0 rather than being removed from the mask), so the normaliser of a mini-batch can be
fixed before the forward pass that produces the trainer's log-probs.

``icepop_weights`` is IcePop's two-sided token mask (Ring-1T, "Every Step Evolves", arXiv:2510.18855):
the token ratio where it lies in ``[low, high]``, 0 elsewhere — the product of the token-level
truncated weights capped at ``high`` and the token-level rejection mask on ``[low, high]``.
``m2po_mask`` is the second-moment mask of M2PO (Zheng et al. 2025, "Prosperity before Collapse",
arXiv:2510.01161, Algorithm 1): drop the tokens with the largest squared log-ratio until the
mean over the rest is at most a threshold.

Mismatch diagnostics estimate KL(pi_rollout || pi_old) from the rollout's own samples with the
k1 and k3 estimators of J. Schulman, http://joschu.net/blog/kl-approx.html. ``GroupedTokenStats``
accumulates per-token diagnostics per group label (the staleness of each sample).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from offstep.algos.common import masked_mean
from offstep.algos.losses import LOG_RATIO_CLAMP
from offstep.config.choices import REJECTION_LEVELS, TIS_LEVELS


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
    estimates of KL(rollout || trainer) per token; ``is_weight_mean``, the mean of the returned
    weights over valid tokens at both levels (verl's ``rollout_is_mean``: a long response weighs
    more at sequence level); ``is_weight_max`` and ``is_truncated_frac``, the fraction whose
    untruncated weight exceeds ``cap``, over valid tokens (token level) or over sequences with at
    least one valid token (sequence level).
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    log_ratio = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    if level == "token":
        units, unit_mask = log_ratio, valid
    elif level == "sequence":
        units, unit_mask = log_ratio.sum(dim=-1), valid.any(dim=-1)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}; expected one of {TIS_LEVELS}")

    raw = torch.exp(units.clamp(max=LOG_RATIO_CLAMP))  # exp(20) ~ 5e8: no overflow
    weights = torch.where(unit_mask, raw if cap is None else raw.clamp(max=cap), zero)
    truncated = (units > math.log(cap)) if cap is not None else torch.zeros_like(unit_mask)

    max_weight = weights.max() if weights.numel() else zero  # weights >= 0, 0 on padding
    truncated_frac = masked_mean(truncated.to(weights.dtype), unit_mask)
    if level == "sequence":
        weights = torch.where(valid, weights[:, None], zero)
    k1, k3 = mismatch_kl_terms(old_logprob, rollout_logprob, response_mask)
    metrics = {
        "mismatch_kl_k1": masked_mean(k1, valid),
        "mismatch_kl_k3": masked_mean(k3, valid),
        "is_weight_mean": masked_mean(weights, valid),  # over tokens at both levels, as verl's rollout_is_mean
        "is_weight_max": max_weight,
        "is_truncated_frac": truncated_frac,
    }
    return weights, metrics


def mismatch_kl_terms(
    old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token k1 and k3 estimates of KL(pi_rollout || pi_old) from the rollout's samples.

    With ``d = old - rollout`` (clamped to [-20, 20] inside the exponential): ``k1 = -d`` and
    ``k3 = exp(d) - d - 1`` (non-negative). Both detached, 0 on padding.
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    d = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return -d, torch.where(valid, torch.exp(dc) - dc - 1.0, zero)


def rejection_mask(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    ratio_high: float = 2.0,
    ratio_low: float | None = None,
    kl_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Which tokens to keep (1.0) or reject (0.0) given the ratio ``pi_old / pi_rollout``.

    ``level``: ``"token"`` rejects a token whose ratio is outside ``[ratio_low, ratio_high]``;
    ``"sequence"`` rejects a whole response whose product of token ratios is outside it;
    ``"geometric"`` uses the geometric mean of the token ratios of a response (exp of the mean
    log-ratio) instead of the product; ``"off"`` applies no ratio test. ``ratio_low`` defaults to
    ``1 / ratio_high``. ``kl_threshold`` (optional, any level) also rejects a whole response whose
    mean per-token k3 mismatch KL exceeds it. Returns ``(keep [B, R], metrics)``, keep 0 on
    padding and detached; metric ``rejected_frac``: the fraction of valid tokens rejected.
    """
    if level not in REJECTION_LEVELS:
        raise ValueError(f"unknown rejection level {level!r}; expected one of {REJECTION_LEVELS}")
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    log_ratio = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    lo = math.log(ratio_low if ratio_low else 1.0 / ratio_high)
    hi = math.log(ratio_high)
    if level == "token":
        units = log_ratio
    elif level == "sequence":
        units = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        units = masked_mean(log_ratio, valid, dim=-1)[:, None].expand_as(log_ratio)
    keep = valid.clone()
    if level != "off":
        keep &= (units >= lo) & (units <= hi)
    if kl_threshold is not None:
        _, k3 = mismatch_kl_terms(old_logprob, rollout_logprob, response_mask)
        keep &= (masked_mean(k3, valid, dim=-1) <= kl_threshold)[:, None]
    rejected = (valid & ~keep).to(old_logprob.dtype)
    return keep.to(old_logprob.dtype), {"rejected_frac": masked_mean(rejected, valid)}


def truncated_flags(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float | None,
    level: str = "token",
) -> torch.Tensor:
    """1.0 on the valid tokens whose importance weight ``truncated_importance_weights`` truncated
    (the token's ratio, or its response's, above ``cap``), else 0.0."""
    valid = response_mask.bool()
    if cap is None:
        return torch.zeros_like(old_logprob).detach()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    log_ratio = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    units = log_ratio if level == "token" else log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    return (valid & (units > math.log(cap))).to(old_logprob.dtype)


def icepop_weights(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop's per-token weight ``M(k) = k if low <= k <= high else 0``, ``k = pi_old / pi_rollout``
    (the paper's defaults ``[0.5, 5]``); detached, 0 on padding. It equals
    ``truncated_importance_weights(cap=high) * rejection_mask(level="token", [low, high])``, which
    is how the actor applies it (``tis_level=token tis_cap=high rejection_level=token
    rejection_ratio_low=low rejection_ratio_high=high``); metrics: those of both."""
    weights, metrics = truncated_importance_weights(old_logprob, rollout_logprob, response_mask, cap=high)
    keep, rej = rejection_mask(old_logprob, rollout_logprob, response_mask, "token", ratio_high=high, ratio_low=low)
    return weights * keep, {**metrics, **rej}


def second_moment_keep(m2: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's masking on a flat tensor of per-token second moments ``m2 >= 0``: while the mean of
    the tokens left exceeds ``threshold``, drop the largest. Returns bool ``keep`` (same shape).
    Equal values are dropped in index order (a stable sort); if even the smallest value exceeds
    ``threshold`` every token is dropped."""
    keep = torch.ones(m2.shape, dtype=torch.bool, device=m2.device)
    n = m2.numel()
    if n == 0:
        return keep
    vals = m2.detach().reshape(-1).to(torch.float64)
    order = torch.sort(vals, descending=True, stable=True).indices
    # mean of the tokens left after dropping the i largest, i = 0 .. n-1 (non-increasing in i)
    left_mean = vals[order].flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64, device=m2.device)
    first_ok = torch.nonzero(left_mean <= threshold)
    dropped = int(first_ok[0]) if first_ok.numel() else n
    keep.view(-1)[order[:dropped]] = False
    return keep


def m2po_mask(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float = 0.04,
    advantages: torch.Tensor | None = None,
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO's second-moment mask: which tokens to keep (1.0) or drop (0.0).

    Each valid token's second moment is ``(log pi_old / pi_rollout)^2``; ``second_moment_keep``
    drops the largest until their mean over the candidates left is at most ``threshold`` (the
    paper's tau_M2 = 0.04). Candidates: every valid token (``advantages=None``, as AReaL's
    ``m2_threshold``), or, given per-token ``advantages``, the paper's trust-region tokens only
    (advantage > 0 with ratio > 1, or advantage < 0 with ratio < 1); other tokens are kept.
    ``gather`` (data parallelism) maps this rank's flat candidate values to every rank's, in rank
    order, and this rank's offset in them, so that each rank masks as the whole batch would.
    Returns ``(keep [B, R], metrics)``, keep 0 on padding and detached; metrics: ``m2po_masked_frac``
    (this rank's valid tokens dropped), ``m2po_m2`` and ``m2po_m2_kept`` (the candidates' mean
    second moment before and after, over every rank).
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    d = torch.where(valid, old_logprob - rollout_logprob, zero).detach()
    candidate = valid
    if advantages is not None:
        candidate = valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))
    local = (d * d)[candidate]
    values, offset = (local, 0) if gather is None else gather(local)
    kept_all = second_moment_keep(values, threshold)
    keep = valid.clone()
    keep[candidate] = kept_all[offset : offset + local.numel()].to(keep.device)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return x.to(old_logprob.dtype).mean() if x.numel() else zero

    metrics = {
        "m2po_masked_frac": masked_mean((valid & ~keep).to(old_logprob.dtype), valid),
        "m2po_m2": mean(values),
        "m2po_m2_kept": mean(values[kept_all]),
    }
    return keep.to(old_logprob.dtype), metrics


class GroupedTokenStats:
    """Sums and maxima of per-token statistics over valid tokens, kept apart per group label.

    ``add(stats, mask, labels)`` takes ``stats`` name -> ``[B, R]`` tensor, the ``[B, R]`` mask
    and one integer label per row (e.g. the staleness of each sample); ``levels`` fixes the
    labels reported (rows with other labels are ignored). ``totals()`` flattens the sums and
    counts (to be summed over data-parallel ranks) and the maxima (to be max-reduced);
    ``metrics(sums, maxes)`` turns them into ``{f"{name}/{prefix}_{level}": mean}`` plus, for the
    names in ``max_of``, ``{f"{max_of[name]}/{prefix}_{level}": max}``. A level without any valid
    token reports 0.
    """

    def __init__(self, levels: list[int], prefix: str = "staleness", max_of: dict[str, str] | None = None):
        self.levels, self.prefix, self.max_of = list(levels), prefix, dict(max_of or {})
        self.names: list[str] = []
        self._sums: dict[str, list[float]] = {}
        self._maxes: dict[str, list[float]] = {}
        self._counts = [0.0] * len(self.levels)

    def add(self, stats: dict[str, torch.Tensor], mask: torch.Tensor, labels: torch.Tensor) -> None:
        for name in stats:
            if name not in self._sums:
                self.names.append(name)
                self._sums[name] = [0.0] * len(self.levels)
                self._maxes[name] = [0.0] * len(self.levels)
        valid = mask.bool()
        for j, level in enumerate(self.levels):
            sel = valid & (labels == level)[:, None]
            self._counts[j] += float(sel.sum())
            for name, t in stats.items():
                picked = t.detach()[sel]
                self._sums[name][j] += float(picked.sum())
                if picked.numel():
                    self._maxes[name][j] = max(self._maxes[name][j], float(picked.max()))

    def totals(self) -> tuple[list[float], list[float]]:
        sums = [v for n in self.names for v in self._sums[n]] + list(self._counts)
        maxes = [v for n in self.names for v in self._maxes[n]]
        return sums, maxes

    def metrics(self, sums: list[float], maxes: list[float]) -> dict[str, float]:
        L = len(self.levels)
        counts = sums[len(self.names) * L :]
        out = {}
        for i, name in enumerate(self.names):
            for j, level in enumerate(self.levels):
                out[f"{name}/{self.prefix}_{level}"] = sums[i * L + j] / counts[j] if counts[j] else 0.0
                if name in self.max_of:
                    out[f"{self.max_of[name]}/{self.prefix}_{level}"] = maxes[i * L + j]
        return out
