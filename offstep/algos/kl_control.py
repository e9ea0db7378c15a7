"""KL to the reference policy as a penalty in the reward, with a fixed or adaptive coefficient.

The per-token reward becomes ``r_t - beta * kl_t`` with ``kl_t`` one of the estimators of
``offstep.algos.losses.kl_penalty`` (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", arXiv:1909.08593, eq. 2; Ouyang et al. 2022, InstructGPT, arXiv:2203.02155, eq. 2).

``AdaptiveKLController`` is the proportional controller of Ziegler et al. 2019 (section 2.2):
``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n / horizon)`` after each
batch of ``n`` samples, which steers the measured KL towards ``target``. ``FixedKLController``
keeps ``beta`` constant. Both expose ``value``, ``update(current_kl, n_steps)`` and
``state_dict()`` / ``load_state_dict()`` so a resumed run continues with the same coefficient.
"""

from __future__ import annotations

import torch

from offstep.algos.common import masked_mean
from offstep.algos.losses import kl_penalty
from offstep.config.choices import KL_CONTROLLERS


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    def __init__(self, kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target_kl > 0 and horizon > 0 (got {target_kl}, {horizon})")
        super().__init__(kl_coef)
        self.target, self.horizon = float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(kind: str, kl_coef: float, target_kl: float = 0.0, horizon: float = 0.0) -> FixedKLController:
    """``"fixed"`` or ``"adaptive"`` controller starting at ``kl_coef``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected one of {KL_CONTROLLERS}")


def kl_penalized_rewards(
    token_rewards: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_rewards - beta * kl`` on valid tokens (0 on padding), and the batch KL.

    ``kl`` is ``kl_penalty(logprob, ref_logprob, kind)`` per token; the returned batch KL is the
    mean over responses of each response's mean per-token KL (the quantity the adaptive
    controller steers; responses without valid tokens are left out).
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    kl = torch.where(valid, kl_penalty(logprob, ref_logprob, kind).to(token_rewards.dtype), zero)
    rewards = torch.where(valid, token_rewards - beta * kl, zero)
    has_tokens = valid.any(dim=-1)
    seq_kl = masked_mean(kl, valid, dim=-1)
    batch_kl = masked_mean(seq_kl, has_tokens)
    return rewards, batch_kl
