"""Tests for the policy-gradient surrogates: PPO's dual-clip, GSPO, CISPO, the plain importance-
weighted policy gradient, and the ``policy_loss`` dispatch (padding and micro-batch invariance for
every surrogate under every aggregation mode). The surrogates return per-token losses; the
reduction is ``aggregate_loss``'s."""

import math

import pytest
import torch
from conftest import GARBAGE, mini_batch_denom, pad

from offstep.algos.common import AGG_MODES, aggregate_loss, masked_mean
from offstep.algos.losses import clipped_policy_loss
from offstep.algos.policy_losses import (
    POLICY_LOSSES,
    cispo_policy_loss,
    gspo_policy_loss,
    pg_policy_loss,
    policy_loss,
)

F64 = torch.float64


def ratios_to_logp(ratios, old=None):
    old = torch.zeros_like(ratios) if old is None else old
    return (old + ratios.log()).requires_grad_(), old


def test_dual_clip_hand():
    # clip range [0.8, 1.2], clip_ratio_c = 3:
    #   tok0: r=4,   A=-1: max(4, 1.2) = 4 > 3 -> dual clip: 3 (no gradient)
    #   tok1: r=0.5, A=-1: max(0.5, 0.8) = 0.8 (PPO clip active, no gradient)
    #   tok2: r=4,   A=+1: max(-4, -1.2) = -1.2 (clip active; A > 0: no dual clip)
    #   tok3: r=2,   A=-1: max(2, 1.2) = 2 < 3 -> 2, gradient d(-A r)/dlogp / 4 = 2 / 4 = 0.5
    # token-mean = (3 + 0.8 - 1.2 + 2) / 4 = 1.15; clipfrac 2/4 (tok1, tok2); dual_clipfrac 1/4
    logp, old = ratios_to_logp(torch.tensor([[4.0, 0.5, 4.0, 2.0]], dtype=F64))
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    per_token, m = clipped_policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(per_token, torch.tensor([[3.0, 0.8, -1.2, 2.0]], dtype=F64))
    loss = aggregate_loss(per_token, mask)
    assert loss.item() == pytest.approx(1.15)
    assert m["clipfrac"].item() == pytest.approx(0.5) and m["dual_clipfrac"].item() == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 0.5]], dtype=F64))
    # without dual clip tok0 costs 4: (4 + 0.8 - 1.2 + 2) / 4 = 1.4
    assert aggregate_loss(clipped_policy_loss(logp, old, adv, mask)[0], mask).item() == pytest.approx(1.4)


def test_gspo_hand():
    # seq 0: token ratios 2, 0.5 -> s = exp((ln 2 + ln 0.5) / 2) = 1; A = 1: -1 per token, and the
    #        gradient of each token is -A * s / 4 (token-mean over 4 tokens) = -0.25
    # seq 1: ratios 1.5, 1.5 -> s = 1.5 > 1.2: clipped branch -1.2 per token, no gradient
    # a third padded column holds garbage. loss = (-1 - 1 - 1.2 - 1.2) / 4 = -1.1; clipfrac 2/4
    # ppo_kl = mean(-ln r) = -(ln 2 + ln 0.5 + 2 ln 1.5) / 4 = -ln(1.5) / 2
    ratios = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 1.0]], dtype=F64)
    logp, old = ratios_to_logp(ratios)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 99.0], [1.0, 1.0, 99.0]], dtype=F64)
    per_token, m = gspo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss = aggregate_loss(per_token, mask, "token-mean")
    assert loss.item() == pytest.approx(-1.1)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == pytest.approx(-math.log(1.5) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]], dtype=F64))


def test_gspo_token_gradient_equals_sequence_objective():
    # GSPO's sequence objective: mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t log r_it);
    # the GSPO-token form with seq-mean-token-mean has the same gradient (paper, eq. 14-15).
    g = torch.Generator().manual_seed(0)
    old = torch.randn(5, 6, generator=g, dtype=F64) - 1
    logp = (old + torch.randn(5, 6, generator=g, dtype=F64) * 0.1).requires_grad_()
    adv_seq = torch.randn(5, generator=g, dtype=F64)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 1, 5])[:, None]).to(F64)
    adv = adv_seq[:, None] * mask
    loss = aggregate_loss(gspo_policy_loss(logp, old, adv, mask, 0.05, 0.05)[0], mask, "seq-mean-token-mean")
    loss.backward()
    ref_logp = logp.detach().clone().requires_grad_()
    s = torch.exp(masked_mean(ref_logp - old, mask, dim=-1))
    ref = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(0.95, 1.05)).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logp.grad, ref_logp.grad)


def test_cispo_hand():
    # clip range [0.8, 1.28]: r = 2, 0.5, 1.1 -> clipped weights 1.28, 0.8, 1.1; A = 1, -1, 1;
    # log pi = -1, -2, -0.5 (old = log pi - log r). verl's value -sg[clip(r)] * A * log pi:
    #   -1.28 * 1 * -1 = 1.28, -0.8 * -1 * -2 = -1.6, -1.1 * 1 * -0.5 = 0.55 -> mean 0.23 / 3
    # gradient -A * clip(r) / 3 (every token keeps one, unlike PPO); clipfrac 2/3
    ratios = torch.tensor([[2.0, 0.5, 1.1]], dtype=F64)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = logp.detach() - ratios.log()
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    per_token, m = cispo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(per_token, torch.tensor([[1.28, -1.6, 0.55]], dtype=F64))
    loss = aggregate_loss(per_token, mask)
    assert loss.item() == pytest.approx(0.23 / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28, 0.8, -1.1]], dtype=F64) / 3)


def test_pg_hand():
    # r = 2, 0.5; A = 1, -1: loss per token -2, 0.5 -> mean -0.75; gradient -A * r / 2 = -1, 0.25
    logp, old = ratios_to_logp(torch.tensor([[2.0, 0.5]], dtype=F64))
    mask = torch.ones(1, 2, dtype=F64)
    per_token, m = pg_policy_loss(logp, old, torch.tensor([[1.0, -1.0]], dtype=F64), mask)
    loss = aggregate_loss(per_token, mask)
    assert loss.item() == pytest.approx(-0.75) and m["clipfrac"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.25]], dtype=F64))
    # on policy (old = logp): the gradient is REINFORCE's -A * grad log pi / n
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    aggregate_loss(pg_policy_loss(lp, lp.detach(), torch.tensor([[1.0, -1.0]], dtype=F64), mask)[0], mask).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 0.5]], dtype=F64))


def test_dispatch_and_errors():
    logp, old = ratios_to_logp(torch.tensor([[4.0, 2.0]], dtype=F64))
    adv, mask = torch.tensor([[-1.0, -1.0]], dtype=F64), torch.ones(1, 2, dtype=F64)
    # ppo with dual clip through the dispatch equals the direct call: (3 + 2) / 2
    dual = policy_loss("ppo", logp, old, adv, mask, clip_ratio_c=3.0)[0]
    torch.testing.assert_close(dual, clipped_policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)[0])
    assert aggregate_loss(dual, mask).item() == pytest.approx(2.5)
    assert aggregate_loss(policy_loss("pg", logp, old, adv, mask)[0], mask).item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual-clip"):
        policy_loss("gspo", logp, old, adv, mask, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss("trpo", logp, old, adv, mask)


def inputs(b, r, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(b, r, generator=g, dtype=F64) * 0.3 - 1
    old = logp + torch.randn(b, r, generator=g, dtype=F64) * 0.3
    adv = torch.randn(b, r, generator=g, dtype=F64)
    w = torch.rand(b, r, generator=g, dtype=F64) * 2
    return logp, old, adv, w


KW = {"ppo": {"clip_ratio_c": 3.0}, "gspo": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05}, "cispo": {}, "pg": {}}


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", POLICY_LOSSES)
def test_padding_invariance(loss_name, mode, fill):
    logp, old, adv, w = inputs(3, 4, 0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)

    def run(lp, o, a, m, ww):
        lp = lp.clone().requires_grad_()
        per_token, metrics = policy_loss(loss_name, lp, o, a, m, **KW[loss_name])
        loss = aggregate_loss(per_token, m, mode, horizon=4, is_weights=ww)
        loss.backward()
        return loss, metrics, lp.grad

    def spoil(x):
        return pad(torch.where(mask.bool(), x, torch.full_like(x, fill)), 3, fill)

    loss, metrics, grad = run(logp, old, adv, mask, w)
    loss_p, metrics_p, grad_p = run(spoil(logp), spoil(old), spoil(adv), pad(mask, 3, 0.0), spoil(w))
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(metrics_p, metrics)
    torch.testing.assert_close(grad_p[:, :4], grad)
    assert (grad_p[~pad(mask, 3, 0.0).bool()] == 0).all()


@pytest.mark.parametrize("n_micro", [1, 2, 4])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_name", POLICY_LOSSES)
def test_micro_batch_invariance(loss_name, mode, n_micro):
    b, r = 8, 7
    logp, old, adv, w = inputs(b, r, 3)
    mask = (torch.arange(r)[None] < torch.tensor([7, 1, 3, 5, 2, 7, 4, 6])[:, None]).to(F64)

    def loss(lp, idx, denom=None):
        per_token = policy_loss(loss_name, lp, old[idx], adv[idx], mask[idx], **KW[loss_name])[0]
        return aggregate_loss(per_token, mask[idx], mode, denom=denom, horizon=r, is_weights=w[idx])

    full = logp.clone().requires_grad_()
    loss(full, torch.arange(b)).backward()
    denom = mini_batch_denom(mask, mode)
    part = logp.clone().requires_grad_()
    for idx in torch.arange(b).chunk(n_micro):
        loss(part[idx], idx, denom).backward()
    torch.testing.assert_close(part.grad, full.grad, atol=1e-12, rtol=0)
