"""Tests for offstep.algos.correction: truncated importance weights for rollout/trainer mismatch."""

import math

import pytest
import torch

from offstep.algos.correction import truncated_importance_weights
from offstep.algos.losses import clipped_policy_loss

F64 = torch.float64
GARBAGE = [float("nan"), float("inf"), -1e30, 123.0]


def pad(x, k, fill):
    """Append ``k`` columns of ``fill`` to the last dim of ``x``."""
    return torch.cat([x, torch.full((*x.shape[:-1], k), fill, dtype=x.dtype)], dim=-1)


def test_token_level_hand():
    # old - rollout = log 0.5, log 1.5, log 3 -> raw weights 0.5, 1.5, 3 -> capped 0.5, 1.5, 2
    # mean (0.5 + 1.5 + 2) / 3 = 4/3; max 2; truncated 1 of 3
    # k1 = mean(rollout - old) = -log(0.5 * 1.5 * 3) / 3 = -log(2.25) / 3 = -0.27031
    # k3 = mean(r - log r - 1) = (0.19315 + 0.09453 + 0.90139) / 3 = 0.39636
    rollout = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    old = rollout + torch.tensor([[0.5, 1.5, 3.0]], dtype=F64).log()
    w, m = truncated_importance_weights(old, rollout, torch.ones(1, 3, dtype=F64), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0]], dtype=F64))
    assert m["is_weight_mean"].item() == pytest.approx(4 / 3)
    assert m["is_weight_max"].item() == pytest.approx(2.0)
    assert m["is_truncated_frac"].item() == pytest.approx(1 / 3)
    assert m["mismatch_kl_k1"].item() == pytest.approx(-math.log(2.25) / 3)
    k3 = sum(r - math.log(r) - 1 for r in (0.5, 1.5, 3.0)) / 3
    assert m["mismatch_kl_k3"].item() == pytest.approx(k3)
    assert k3 == pytest.approx(0.39636, abs=1e-5)


def test_sequence_level_hand():
    # seq 0: ratios 2 * 0.75 = 1.5 over its 2 valid tokens (3rd is padding) -> w = 1.5
    # seq 1: ratios 2 * 2 * 1 = 4 -> capped at 2
    # per-sequence metrics: mean (1.5 + 2) / 2 = 1.75, max 2, truncated 1 of 2
    ratios = torch.tensor([[2.0, 0.75, 1000.0], [2.0, 2.0, 1.0]], dtype=F64)
    rollout = torch.full((2, 3), -1.0, dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    w, m = truncated_importance_weights(rollout + ratios.log(), rollout, mask, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [2.0, 2.0, 2.0]], dtype=F64))
    assert m["is_weight_mean"].item() == pytest.approx(1.75)
    assert m["is_weight_max"].item() == pytest.approx(2.0)
    assert m["is_truncated_frac"].item() == pytest.approx(0.5)


def test_no_cap_overflow_detached_and_bad_level():
    rollout = torch.zeros(2, 2, dtype=F64)
    old = torch.tensor([[math.log(5.0), 0.0], [400.0, 400.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=F64)
    w, m = truncated_importance_weights(old, rollout, mask, cap=None)
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    assert w[0].tolist() == pytest.approx([5.0, 1.0])  # no truncation
    assert torch.isfinite(w).all() and m["is_truncated_frac"].item() == 0.0
    # a sequence log-ratio of 800 must not overflow: capped
    w, _ = truncated_importance_weights(old, rollout, mask, cap=3.0, level="sequence")
    assert w[1].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError):
        truncated_importance_weights(old, rollout, mask, level="geometric")


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_invariance(fill, level):
    g = torch.Generator().manual_seed(0)
    rollout = torch.randn(3, 4, generator=g, dtype=F64) - 1
    old = rollout + torch.randn(3, 4, generator=g, dtype=F64) * 0.5
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)
    w, m = truncated_importance_weights(old, rollout, mask, cap=1.5, level=level)

    def spoil(x):  # garbage under the existing padding, plus 3 padded columns of garbage
        return pad(torch.where(mask.bool(), x, torch.full_like(x, fill)), 3, fill)

    w_p, m_p = truncated_importance_weights(spoil(old), spoil(rollout), pad(mask, 3, 0.0),
                                            cap=1.5, level=level)
    torch.testing.assert_close(w_p[:, :4], w)
    assert (w_p[:, 4:] == 0).all() and (w[~mask.bool()] == 0).all()
    torch.testing.assert_close(m_p, m)


def test_weights_plug_into_policy_loss():
    # identical rollout and trainer log-probs -> all weights 1 -> loss unchanged
    g = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(2, 5, generator=g) for _ in range(3))
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    w, m = truncated_importance_weights(old, old.clone(), mask)
    assert m["mismatch_kl_k1"].item() == 0.0 and m["mismatch_kl_k3"].item() == 0.0
    torch.testing.assert_close(w, mask)
    torch.testing.assert_close(clipped_policy_loss(logp, old, adv, mask, is_weights=w)[0],
                               clipped_policy_loss(logp, old, adv, mask)[0])
