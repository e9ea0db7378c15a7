"""Tests for offstep.algos.losses: PPO policy/value losses, KL penalties; and the log-prob helpers
(offstep.models.forward). The policy loss is per token; ``aggregate_loss`` reduces it."""

import math

import pytest
import torch
from conftest import GARBAGE, mini_batch_denom, pad

from offstep.algos.common import AGG_MODES, aggregate_loss
from offstep.algos.losses import clipped_policy_loss, kl_penalty, value_loss
from offstep.models.forward import entropy_from_logits, logprobs_from_logits

F64 = torch.float64


# ---------------------------------------------------------------- clipped_policy_loss

# ratios r = 1.5, 0.5, 1.1, 0.7 with advantages 1, 1, -1, -1, clip range [0.8, 1.2]:
#   tok0: max(-1.5, -1.2) = -1.2  (clipped branch active)
#   tok1: max(-0.5, -0.8) = -0.5
#   tok2: max( 1.1,  1.1) =  1.1  (tie: not counted as clipped)
#   tok3: max( 0.7,  0.8) =  0.8  (clipped branch active)
# token-mean = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05; clipfrac = 2/4
# ppo_kl = mean(-log r) = -log(1.5 * 0.5 * 1.1 * 0.7) / 4 = -log(0.5775) / 4 = 0.13724
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 0.7]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=F64)
LOGP = OLD + RATIOS.log()
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
MASK = torch.ones(1, 4, dtype=F64)


def test_policy_loss_hand():
    logp = LOGP.clone().requires_grad_()
    per_token, metrics = clipped_policy_loss(logp, OLD, ADV, MASK)
    torch.testing.assert_close(per_token, torch.tensor([[-1.2, -0.5, 1.1, 0.8]], dtype=F64))
    loss = aggregate_loss(per_token, MASK)
    assert loss.item() == pytest.approx(0.05)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(0.5775) / 4)
    loss.backward()
    # d/dlogp of -A * r / 4 is -A * r / 4 on unclipped tokens, 0 where the clip is active
    expect = torch.tensor([[0.0, -0.5 / 4, 1.1 / 4, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expect)


def test_policy_loss_asymmetric_clip_and_is_weights():
    # r = 1.25, A = 1: clip-high 0.2 caps at -1.2; clip-high 0.28 leaves -1.25
    logp, old = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    assert clipped_policy_loss(logp, old, adv, mask)[0].item() == pytest.approx(-1.2)
    high = clipped_policy_loss(logp, old, adv, mask, clip_ratio_high=0.28)[0]
    assert high.item() == pytest.approx(-1.25)
    # r = 0.7, A = -1: clip-low 0.2 gives max(0.7, 0.8) = 0.8; clip-low 0.4 gives max(0.7, 0.7)
    logp = torch.tensor([[math.log(0.7)]])
    low = clipped_policy_loss(logp, old, -adv, mask, clip_ratio_low=0.4)[0]
    assert low.item() == pytest.approx(0.7)
    # is_weights 2, 1, 0.5, 1 on the hand example: (-2.4 - 0.5 + 0.55 + 0.8) / 4 = -0.3875
    w = torch.tensor([[2.0, 1.0, 0.5, 1.0]], dtype=F64, requires_grad=True)
    loss = aggregate_loss(clipped_policy_loss(LOGP, OLD, ADV, MASK)[0], MASK, is_weights=w)
    assert loss.item() == pytest.approx(-0.3875)
    assert not loss.requires_grad  # the weights are constants (detached)


def test_policy_loss_log_ratio_clamp():
    # log-ratio 100 is clamped to 20 before exp: loss = -A * e^20 with A = -1, finite
    loss, _ = clipped_policy_loss(
        torch.tensor([[100.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)
    )  # one token: its loss is the reduced loss
    assert torch.isfinite(loss) and loss.item() == pytest.approx(math.exp(20), rel=1e-5)


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_padding_invariance(fill, mode):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=g, dtype=F64) * 0.3 - 1
    old = logp + torch.randn(3, 4, generator=g, dtype=F64) * 0.3
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    w = torch.rand(3, 4, generator=g, dtype=F64) * 2
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)

    def run(lp, old, adv, mask, *clip, is_weights=None):
        lp = lp.clone().requires_grad_()
        per_token, metrics = clipped_policy_loss(lp, old, adv, mask, *clip)
        loss = aggregate_loss(per_token, mask, mode, horizon=4, is_weights=is_weights)
        loss.backward()
        return loss, metrics, lp.grad

    def spoil(x):  # garbage under the existing padding, plus 3 padded columns of garbage
        return pad(torch.where(mask.bool(), x, torch.full_like(x, fill)), 3, fill)

    loss, metrics, grad = run(logp, old, adv, mask, 0.2, 0.28)
    loss_p, metrics_p, grad_p = run(spoil(logp), spoil(old), spoil(adv), pad(mask, 3, 0.0), 0.2, 0.28)
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(metrics_p, metrics)
    torch.testing.assert_close(grad_p[:, :4], grad)
    assert (grad_p[~pad(mask, 3, 0.0).bool()] == 0).all()  # no gradient leaks into padding
    # and with importance weights
    loss_w = run(logp, old, adv, mask, is_weights=w)[0]
    loss_wp = run(spoil(logp), spoil(old), spoil(adv), pad(mask, 3, 0.0), is_weights=spoil(w))[0]
    torch.testing.assert_close(loss_wp, loss_w)


def micro_batch_grads(loss_fn, params, mask, mode, n_micro):
    """Gradient of the summed micro-batch losses with ``denom`` = the mini-batch's count."""
    denom = mini_batch_denom(mask, mode)
    params = params.clone().requires_grad_()
    for idx in torch.arange(len(mask)).chunk(n_micro):
        loss_fn(params[idx], idx, denom).backward()
    return params.grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_policy_loss_micro_batch_invariance(mode, n_micro):
    g = torch.Generator().manual_seed(3)
    b, r = 8, 7
    logp = torch.randn(b, r, generator=g) * 0.3 - 1
    old = logp + torch.randn(b, r, generator=g) * 0.2
    adv = torch.randn(b, r, generator=g)
    w = torch.rand(b, r, generator=g) * 2
    mask = (torch.arange(r)[None] < torch.tensor([7, 1, 3, 5, 2, 7, 4, 6])[:, None]).float()

    full = logp.clone().requires_grad_()
    aggregate_loss(clipped_policy_loss(full, old, adv, mask)[0], mask, mode, is_weights=w).backward()

    def loss_fn(lp, idx, denom):
        per_token = clipped_policy_loss(lp, old[idx], adv[idx], mask[idx])[0]
        return aggregate_loss(per_token, mask[idx], mode, denom=denom, is_weights=w[idx])

    grad = micro_batch_grads(loss_fn, logp, mask, mode, n_micro)
    torch.testing.assert_close(grad, full.grad, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- value_loss


def test_value_loss_hand():
    # tok0: v=1.0, old=0.5, ret=1.0: (v-ret)^2 = 0; clipped v = 0.5 + 0.2 = 0.7 -> 0.09 (active)
    # tok1: v=0.5, old=0.5, ret=0.0: both 0.25 (tie, not clipped)
    # loss = 0.5 * (0.09 + 0.25) / 2 = 0.085; vf_clipfrac = 1/2
    v = torch.tensor([[1.0, 0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5]], dtype=F64)
    ret = torch.tensor([[1.0, 0.0]], dtype=F64)
    loss, metrics = value_loss(v, old, ret, torch.ones(1, 2, dtype=F64))
    assert loss.item() == pytest.approx(0.085)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # tok0's clipped branch is constant in v -> grad 0; tok1: d/dv 0.5 * (v - ret)^2 / 2 = 0.25
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.25]], dtype=F64))


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_padding_invariance(fill, mode):
    g = torch.Generator().manual_seed(4)
    v, old, ret = (torch.randn(3, 4, generator=g, dtype=F64) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)
    loss, metrics = value_loss(v, old, ret, mask, loss_agg_mode=mode, horizon=4)
    v_p = pad(v, 3, fill).requires_grad_()
    loss_p, metrics_p = value_loss(
        v_p, pad(old, 3, fill), pad(ret, 3, fill), pad(mask, 3, 0.0), loss_agg_mode=mode, horizon=4
    )
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(metrics_p, metrics)
    loss_p.backward()
    assert torch.isfinite(v_p.grad).all() and (v_p.grad[:, 4:] == 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_value_loss_micro_batch_invariance(mode, n_micro):
    g = torch.Generator().manual_seed(5)
    v, old, ret = (torch.randn(8, 5, generator=g) for _ in range(3))
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 5, 2, 4, 4, 1])[:, None]).float()
    full = v.clone().requires_grad_()
    value_loss(full, old, ret, mask, loss_agg_mode=mode)[0].backward()

    def loss_fn(vs, idx, denom):
        return value_loss(vs, old[idx], ret[idx], mask[idx], loss_agg_mode=mode, denom=denom)[0]

    grad = micro_batch_grads(loss_fn, v, mask, mode, n_micro)
    torch.testing.assert_close(grad, full.grad, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- kl_penalty


def test_kl_penalty_hand():
    # logprob - ref = 1, -1
    logp = torch.tensor([0.0, -1.0], dtype=F64)
    ref = torch.tensor([-1.0, 0.0], dtype=F64)
    assert kl_penalty(logp, ref, "k1").tolist() == [1.0, -1.0]
    assert kl_penalty(logp, ref, "abs").tolist() == [1.0, 1.0]
    assert kl_penalty(logp, ref, "mse").tolist() == [0.5, 0.5]
    assert kl_penalty(logp, ref, "k2").tolist() == [0.5, 0.5]
    # k3 with x = ref - logprob = -1, 1: e^-1 + 1 - 1 = 0.36788; e^1 - 1 - 1 = 0.71828
    expect = [math.exp(-1), math.e - 2]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(expect)
    assert kl_penalty(logp, ref).tolist() == pytest.approx(expect)  # default low_var_kl
    # huge gap: e^100 would overflow; clamped exponent then result clamped to 10
    assert kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0])).item() == 10.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_kl_alias_and_straight_through_hand():
    # logprob - ref = d = 1, -1, 0.5 (ref fixed, gradient taken w.r.t. logprob)
    # "kl" is verl's name for k1: values 1, -1, 0.5
    # straight-through "+": the value of the base estimator, the gradient of k2 = 0.5 d^2, i.e. d:
    #   k1+  values 1, -1, 0.5                          gradients 1, -1, 0.5 (k1's own would be 1, 1, 1)
    #   k3+  values e^-1 + 1 - 1 = 0.36788, e - 2 = 0.71828, e^-0.5 + 0.5 - 1 = 0.10653
    #        gradients 1, -1, 0.5 (k3's own 1 - e^-d = 0.63212, -1.71828, 0.39347)
    ref = torch.tensor([-1.0, 0.0, -1.0], dtype=F64)
    base = torch.tensor([0.0, -1.0, -0.5], dtype=F64)
    assert kl_penalty(base, ref, "kl").tolist() == [1.0, -1.0, 0.5]
    k3 = [math.exp(-1), math.e - 2, math.exp(-0.5) - 0.5]
    for kind, value in (("k1+", [1.0, -1.0, 0.5]), ("kl+", [1.0, -1.0, 0.5]), ("k3+", k3), ("low_var_kl+", k3)):
        logp = base.clone().requires_grad_()
        out = kl_penalty(logp, ref, kind)
        assert out.tolist() == pytest.approx(value), kind
        out.sum().backward()
        assert logp.grad.tolist() == pytest.approx([1.0, -1.0, 0.5]), kind
    logp = base.clone().requires_grad_()
    kl_penalty(logp, ref, "k3").sum().backward()  # the base estimator keeps its own gradient
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(-1), 1 - math.e, 1 - math.exp(-0.5)])
    with pytest.raises(ValueError):
        kl_penalty(base, ref, "k2++")


def test_kl_estimators_are_unbiased():
    # tokens sampled from p: the means of k1 and k3 estimate KL(p || q) exactly in expectation
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    exact = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    for kind in ("k1", "k3"):
        est = kl_penalty(p.log()[x], q.log()[x], kind).mean().item()
        assert est == pytest.approx(exact, abs=0.01), kind


def test_kl_penalty_padding_invariance():
    # elementwise: valid entries do not depend on what sits beside them
    logp, ref = torch.randn(2, 3), torch.randn(2, 3)
    for kind in ("k1", "abs", "mse", "low_var_kl"):
        out = kl_penalty(pad(logp, 2, float("nan")), pad(ref, 2, 1e30), kind)
        torch.testing.assert_close(out[:, :3], kl_penalty(logp, ref, kind))


# ---------------------------------------------------------------- logits helpers


def test_entropy_hand_and_stability():
    # uniform over 4 -> log 4; one dominant logit (1000 vs 0, 0) -> ~0, not nan
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([1000.0, 0.0, 0.0])).item() == pytest.approx(0.0)
    # seeded (the global generator's state depended on the tests before it in the process), against a
    # float64 reference: float32 rounding on logits of this size is a few 1e-6 nats
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 30
    expect = torch.distributions.Categorical(logits=logits.double()).entropy()
    torch.testing.assert_close(entropy_from_logits(logits).double(), expect, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        entropy_from_logits(logits.bfloat16()),
        torch.distributions.Categorical(logits=logits.bfloat16().float()).entropy(),
    )


def test_logprobs_hand_and_reference():
    # logits [0, log 3] -> softmax [0.25, 0.75]; label 1 -> log 0.75
    lp = logprobs_from_logits(torch.tensor([[[0.0, math.log(3)]]]), torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g) * 100  # large logits: stable
    labels = torch.randint(0, 50, (3, 4), generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(), ref)
    out = logprobs_from_logits(logits.bfloat16(), labels)
    ref_bf = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, labels[..., None])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_bf.squeeze(-1), atol=1e-4, rtol=1e-5)


def test_logprobs_gradient_matches_log_softmax():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3))
    logprobs_from_logits(logits, labels).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    torch.log_softmax(ref_logits, -1).gather(-1, labels[..., None]).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_logits_helpers_padding_invariance():
    # per position: padded positions (any labels/logits) leave the valid positions unchanged
    logits, labels = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    logits_p = torch.cat([logits, torch.full((2, 2, 5), 1e4)], dim=1)
    labels_p = torch.cat([labels, torch.zeros(2, 2, dtype=torch.long)], dim=1)
    torch.testing.assert_close(logprobs_from_logits(logits_p, labels_p)[:, :3], logprobs_from_logits(logits, labels))
    torch.testing.assert_close(entropy_from_logits(logits_p)[:, :3], entropy_from_logits(logits))
