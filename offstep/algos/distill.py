"""On-policy distillation: the student samples, a teacher scores each sampled token, and the
student learns to lower the reverse KL, KL(student || teacher), on its own samples.

Two forms (``distill.loss_mode``):

- ``k1``: the per-token advantage ``log pi_teacher(y_t) - log pi_student(y_t)``, the negated
  one-sample (k1) estimate of the reverse KL at the sampled token, trained with the policy
  gradient (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines' "On-Policy
  Distillation", 2025). Each token's advantage is its own: no discount, no sum over later tokens.
  Alone (``use_task_rewards=false``) or added, weighted by ``coef``, to the task reward's.
- ``forward_kl_topk``: a supervised loss beside the policy loss, the teacher's top-k at each
  position against the student's log-probs on the same ids: the forward KL between the two
  distributions renormalised over the teacher's k most likely tokens (the whole forward KL when
  they hold all the mass of both). Unlike the unnormalised sum ``sum_k p_t (log p_t - log p_s)``,
  which can be negative and whose gradient keeps sharpening a student already equal to its teacher,
  it is zero with a zero gradient at equality.

With ``k1``, log-probs below ``log_prob_min_clamp`` are raised to it first (a teacher that finds a
token all but impossible would otherwise give an advantage of -30 or less).
"""

from __future__ import annotations

import torch

from offstep.algos.common import masked_mean

_OUT = -1e30  # an empty slot's log-prob inside topk_forward_kl: exp() is 0, differences stay finite


def _clamped(logprobs: torch.Tensor, low: float | None) -> torch.Tensor:
    return logprobs if low is None else logprobs.clamp(min=low)


def reverse_kl_per_token(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, log_prob_min_clamp: float | None = None
) -> torch.Tensor:
    """The k1 estimate of KL(student || teacher) at each sampled token, ``log pi_s - log pi_t``
    ([B, R], zero outside ``mask``)."""
    diff = _clamped(student, log_prob_min_clamp) - _clamped(teacher, log_prob_min_clamp)
    return diff * mask.to(diff.dtype)


def distill_advantages(
    task: torch.Tensor | None,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
    log_prob_min_clamp: float | None = None,
) -> torch.Tensor:
    """``task + coef * (log pi_t - log pi_s)`` per token ([B, R], zero outside ``mask``);
    ``task`` None: pure distillation, the teacher's signal alone."""
    own = -coef * reverse_kl_per_token(student, teacher, mask, log_prob_min_clamp)
    return own if task is None else task * mask.to(own.dtype) + own


def topk_forward_kl(teacher_topk: torch.Tensor, student_topk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per position ([B, R], zero outside ``mask``): the KL from the teacher to the student over the
    teacher's top-k ids, each side renormalised over those ids: with ``t~ = t - logsumexp(t)`` and
    ``s~`` likewise, ``sum_k exp(t~_k) (t~_k - s~_k)``. ``t`` [B, R, k]: the teacher's log-probs;
    ``s``: the student's on the same ids. Non-negative, and zero (with a zero gradient) exactly
    where the student's distribution over those ids is the teacher's. A slot the teacher left
    empty (log-prob ``-inf``) counts on neither side."""
    t = teacher_topk.float()
    given = torch.isfinite(t)
    far = torch.full_like(t, _OUT)  # finite, so that a position with no id gives no NaN gradient
    t_in = torch.where(given, t, far)
    s_in = torch.where(given, student_topk.float(), far)
    t_norm = t_in - torch.logsumexp(t_in, -1, keepdim=True)
    s_norm = s_in - torch.logsumexp(s_in, -1, keepdim=True)
    zero = torch.zeros_like(t)
    per = torch.where(given, t_norm.exp() * (t_norm - s_norm), zero).sum(-1)
    return torch.where(mask.bool(), per, torch.zeros_like(per))


def distill_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """The batch's mean reverse KL per token (k1, unclamped) and mean teacher log-prob per token."""
    valid = mask.bool()
    if not valid.any():
        return 0.0, 0.0
    return float(masked_mean(student - teacher, valid)), float(masked_mean(teacher, valid))
