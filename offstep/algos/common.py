"""Masked reductions and loss aggregation over right-padded ``[B, R]`` response tensors.

Every function takes a ``mask`` of the same shape as ``x`` (1.0 on real response tokens, 0.0 on
padding) and ignores padded entries completely: they are selected away with ``torch.where`` rather
than multiplied by 0, so even ``inf``/``nan`` garbage under the padding cannot change a result or
a gradient.

``masked_whiten`` is the usual advantage normalisation of PPO implementations (e.g. OpenAI
baselines, TRL, verl). The loss-aggregation modes of ``aggregate_loss`` follow verl's
``agg_loss``:

* ``"token-mean"``: every valid token of the mini-batch weighs the same (DAPO, Yu et al. 2025,
  arXiv:2503.14476, "token-level policy gradient loss").
* ``"token-sum"``: the plain sum over every valid token of the mini-batch, no normaliser (verl's
  ``token-sum``): the gradient grows with the batch's token count, so the learning rate carries
  the scale.
* ``"seq-mean-token-mean"``: mean over each sequence's tokens, then mean over sequences (the
  original GRPO objective, Shao et al. 2024, arXiv:2402.03300, eq. 3).
* ``"seq-mean-token-sum"``: sum over each sequence's tokens, then mean over sequences.
* ``"seq-mean-token-sum-norm"``: sum over each sequence's tokens divided by a constant horizon,
  then mean over sequences (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, which removes GRPO's
  length normalisation ``1/|o_i|`` in favour of a constant).
"""

from __future__ import annotations

import torch

from offstep.config.choices import LOSS_AGG_MODES as AGG_MODES


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool() if mask.dtype != torch.bool else mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``x`` over entries where ``mask`` is set (all dims if ``dim`` is None)."""
    zeroed = torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is set; 0 where there are none."""
    valid = _valid(mask)
    count = valid.sum() if dim is None else valid.sum(dim)
    return masked_sum(x, valid, dim) / count.clamp_min(1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all entries where ``mask`` is set (a scalar).

    With ``unbiased`` the Bessel correction ``n / (n - 1)`` is applied when ``n > 1`` valid
    entries exist; with ``n <= 1`` the (zero) biased variance is returned instead of ``nan``.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = _valid(mask).sum()
        var = var * n / (n - 1).clamp_min(1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (unbiased) variance over the valid entries.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised). Padded entries
    of the result are 0.
    """
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_valid(mask), out, torch.zeros((), dtype=out.dtype, device=out.device))


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    denom: float | torch.Tensor | None = None,
    horizon: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``loss_mat`` ``[B, R]`` to a scalar: the one reduction of every loss
    (the policy surrogates, the KL loss, the entropy bonus, the value loss).

    ``is_weights`` ``[B, R]`` (optional): per-token importance weights (``offstep.algos.correction``)
    that multiply ``l_it`` first; they are constants (detached) and their padded entries are ignored.

    Modes (``n_i`` = valid tokens of sequence ``i``, ``S`` = set of sequences with ``n_i > 0``):

    * ``"token-mean"``:              ``sum_{i,t} l_it / denom``, ``denom`` default ``sum_i n_i``
    * ``"token-sum"``:               ``sum_{i,t} l_it / denom``, ``denom`` default 1
    * ``"seq-mean-token-sum"``:      ``sum_{i in S} (sum_t l_it) / denom``
    * ``"seq-mean-token-mean"``:     ``sum_{i in S} (sum_t l_it / n_i) / denom``
    * ``"seq-mean-token-sum-norm"``: ``sum_{i in S} (sum_t l_it / horizon) / denom``

    where for the ``seq-mean-*`` modes ``denom`` defaults to ``|S|`` (sequences with no valid
    token, e.g. all-padding filler rows, are not counted).

    ``denom`` is for gradient accumulation: pass the count of the whole *mini-batch* (global
    number of valid tokens for ``token-mean``; global number of sequences with at least one valid
    token for the ``seq-mean-*`` modes; for ``token-sum`` only the data-parallel share, 1 / ranks,
    as gradients are averaged over ranks) when calling this on each micro-batch. The sum over the
    micro-batches of the returned losses then equals the mini-batch's loss, and so does the
    accumulated gradient. Leaving ``denom`` as None normalises by this call's own counts.

    ``horizon`` (only ``seq-mean-token-sum-norm``) is Dr. GRPO's constant length normaliser; it
    defaults to ``loss_mat.shape[-1]``, which depends on how far the batch is padded, so pass the
    configured maximum response length to get results independent of padding.
    """
    valid = _valid(mask)
    if is_weights is not None:
        zero = torch.zeros((), dtype=is_weights.dtype, device=is_weights.device)
        loss_mat = loss_mat * torch.where(valid, is_weights.detach(), zero)
    if mode in ("token-mean", "token-sum"):
        total = masked_sum(loss_mat, valid)
        n = (valid.sum() if mode == "token-mean" else 1.0) if denom is None else denom
        return total / torch.as_tensor(n, dtype=total.dtype, device=total.device).clamp_min(1e-12)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}")

    seq_sum = masked_sum(loss_mat, valid, dim=-1)
    seq_len = valid.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_len.clamp_min(1)
    else:  # seq-mean-token-sum-norm
        per_seq = seq_sum / (loss_mat.shape[-1] if horizon is None else horizon)
    n = (seq_len > 0).sum() if denom is None else denom
    total = per_seq.sum()
    return total / torch.as_tensor(n, dtype=total.dtype, device=total.device).clamp_min(1e-12)
