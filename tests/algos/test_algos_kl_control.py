"""Tests for offstep.algos.kl_control: fixed and adaptive KL coefficients, KL-penalised rewards."""

import pytest
import torch

from offstep.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    kl_controller,
    kl_penalized_rewards,
)

F64 = torch.float64


def test_fixed_controller():
    c = kl_controller("fixed", 0.1)
    c.update(5.0, 100)
    assert isinstance(c, FixedKLController) and c.value == 0.1


def test_adaptive_controller_hand_and_state():
    # coef 0.1, target 0.05, horizon 100
    # KL 0.1: error clip(0.1 / 0.05 - 1 = 1, +-0.2) = 0.2; x (1 + 0.2 * 10 / 100) = 1.02 -> 0.102
    # KL 0.045: error -0.1; x (1 - 0.1 * 10 / 100) = 0.99 -> 0.10098
    c = kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    assert isinstance(c, AdaptiveKLController)
    c.update(0.1, 10)
    assert c.value == pytest.approx(0.102)
    c.update(0.045, 10)
    assert c.value == pytest.approx(0.10098)
    resumed = kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    resumed.load_state_dict(c.state_dict())
    assert resumed.value == c.value
    with pytest.raises(ValueError):
        kl_controller("adaptive", 0.1, target_kl=0.0, horizon=100)
    with pytest.raises(ValueError):
        kl_controller("pid", 0.1)


def test_kl_penalized_rewards_hand():
    # k1 = logprob - ref: row 0: 0.5, -0.5; row 1: 0.2, (padding)
    # beta 0.1: rewards row 0: 0 - 0.05, 1 + 0.05; row 1: 0 - 0.02, 0
    # per-response mean KL: 0 and 0.2 -> batch KL 0.1
    rewards = torch.tensor([[0.0, 1.0], [0.0, 5.0]], dtype=F64)
    ref = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[0.5, -0.5], [0.2, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    out, kl = kl_penalized_rewards(rewards, logp, ref, mask, beta=0.1, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.05], [-0.02, 0.0]], dtype=F64))
    assert kl.item() == pytest.approx(0.1)
    # k2 (mse): 0.125, 0.125, 0.02 -> means 0.125, 0.02 -> 0.0725
    _, kl2 = kl_penalized_rewards(rewards, logp, ref, mask, beta=0.1, kind="mse")
    assert kl2.item() == pytest.approx(0.0725)
