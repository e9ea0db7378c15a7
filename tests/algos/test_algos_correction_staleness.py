"""Corrections for high staleness (issue 26): IcePop's two-sided token mask and M2PO's
second-moment mask, worked by hand; and offstep's correction keys pinned to verl's rollout
correction (docs/algo/rollout_corr.md) on random cases: Token-TIS, Seq-TIS, Seq-MIS, Geo-RS and
IcePop as verl's token IS + token_k1 rejection. verl is not imported: its formulas are written
out below from its documentation."""

import math

import pytest
import torch
from conftest import GARBAGE, pad

from offstep.algos.correction import (
    icepop_weights,
    m2po_mask,
    rejection_mask,
    second_moment_keep,
    truncated_importance_weights,
)
from offstep.launch.loader import load_config
from offstep.launch.verl.derive import verl_k1_bounds
from offstep.pipeline.compute_advantages import needs_old_logprobs

F64 = torch.float64


# ---------------------------------------------------------------- IcePop


def test_icepop_hand():
    # k = pi_old / pi_rollout: 0.4, 0.5, 1.3, 5, 6 (row 0); 2, pad (row 1); [low, high] = [0.5, 5]
    # M(k) = k inside the band (bounds included), 0 outside: 0, 0.5, 1.3, 5, 0 and 2, 0 (padding)
    # 2 of the 6 valid tokens are outside: rejected_frac 1/3
    rollout = torch.zeros(2, 5, dtype=F64)  # old - 0 = log k exactly, so the bounds compare exactly
    k = torch.tensor([[0.4, 0.5, 1.3, 5.0, 6.0], [2.0, 1.0, 1.0, 1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=F64)
    w, m = icepop_weights(k.log(), rollout, mask, low=0.5, high=5.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.3, 5.0, 0.0], [2.0, 0, 0, 0, 0]], dtype=F64))
    assert m["rejected_frac"].item() == pytest.approx(1 / 3)
    assert not w.requires_grad


def test_icepop_is_what_the_actor_applies():
    # the actor multiplies token TIS (cap = high) by the token rejection mask on [low, high]
    g = torch.Generator().manual_seed(3)
    rollout = torch.randn(4, 9, generator=g, dtype=F64) - 2
    old = rollout + torch.randn(4, 9, generator=g, dtype=F64)
    mask = (torch.rand(4, 9, generator=g) < 0.8).to(F64)
    w, _ = icepop_weights(old, rollout, mask, low=0.5, high=5.0)
    tis, _ = truncated_importance_weights(old, rollout, mask, cap=5.0, level="token")
    keep, _ = rejection_mask(old, rollout, mask, level="token", ratio_low=0.5, ratio_high=5.0)
    torch.testing.assert_close(w, tis * keep)
    ratio = (old - rollout).exp()
    inside = (ratio >= 0.5) & (ratio <= 5.0) & mask.bool()
    torch.testing.assert_close(w, torch.where(inside, ratio, torch.zeros_like(ratio)))
    assert 0 < inside.sum() < mask.sum()  # the case exercises both sides of the band


# ---------------------------------------------------------------- M2PO

# log-ratios log(pi_old / pi_rollout): row 0: 0.5, -0.1, 0.3, 0; row 1: 0.2, -0.4, (padding)
M2_LOG = torch.tensor([[0.5, -0.1, 0.3, 0.0], [0.2, -0.4, 9.0, 9.0]], dtype=F64)
M2_MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
M2_ROLLOUT = torch.full((2, 4), -1.0, dtype=F64)
M2_OLD = M2_ROLLOUT + M2_LOG


def test_m2po_all_tokens_hand():
    # second moments 0.25, 0.01, 0.09, 0 | 0.04, 0.16: sum 0.55, mean 0.55 / 6 = 0.0917 > 0.04
    # drop 0.25: 0.30 / 5 = 0.06 > 0.04; drop 0.16: 0.14 / 4 = 0.035 <= 0.04: stop
    # dropped: (0, 0) and (1, 1), 2 of 6 valid tokens
    keep, m = m2po_mask(M2_OLD, M2_ROLLOUT, M2_MASK, threshold=0.04)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1, 1, 1], [1, 0, 0, 0]], dtype=F64))
    assert m["m2po_masked_frac"].item() == pytest.approx(2 / 6)
    assert m["m2po_m2"].item() == pytest.approx(0.55 / 6)
    assert m["m2po_m2_kept"].item() == pytest.approx(0.035)
    # a threshold above the batch's mean drops nothing
    keep, m = m2po_mask(M2_OLD, M2_ROLLOUT, M2_MASK, threshold=0.1)
    torch.testing.assert_close(keep, M2_MASK)
    assert m["m2po_masked_frac"].item() == 0.0


def test_m2po_trust_region_hand():
    # advantages +1 on row 0, -1 on row 1. Trust-region tokens (A > 0 with ratio > 1, A < 0 with
    # ratio < 1): (0, 0) 0.25, (0, 2) 0.09, (1, 1) 0.16; the others are kept whatever their moment.
    # threshold 0.1: mean 0.5 / 3 = 0.1667 > 0.1; drop 0.25: 0.125 > 0.1; drop 0.16: 0.09 <= 0.1
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=F64)
    keep, m = m2po_mask(M2_OLD, M2_ROLLOUT, M2_MASK, threshold=0.1, advantages=adv)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1, 1, 1], [1, 0, 0, 0]], dtype=F64))
    assert m["m2po_m2"].item() == pytest.approx(0.5 / 3)
    assert m["m2po_m2_kept"].item() == pytest.approx(0.09)
    assert m["m2po_masked_frac"].item() == pytest.approx(2 / 6)
    # threshold 0.04: even 0.09 alone exceeds it, so every trust-region token is dropped
    keep, _ = m2po_mask(M2_OLD, M2_ROLLOUT, M2_MASK, threshold=0.04, advantages=adv)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1, 0, 1], [1, 0, 0, 0]], dtype=F64))


def test_second_moment_keep_ties_bounds_and_empty():
    # mean (0.5 + 0.5) / 4 = 0.25 <= 0.25: nothing dropped (the bound is inclusive)
    assert second_moment_keep(torch.tensor([0.5, 0.5, 0.0, 0.0]), 0.25).tolist() == [True] * 4
    # 0.25 > 0.2: drop one 0.5 (the first: a stable order), then 0.5 / 3 = 0.167 <= 0.2
    assert second_moment_keep(torch.tensor([0.5, 0.5, 0.0, 0.0]), 0.2).tolist() == [False, True, True, True]
    assert second_moment_keep(torch.tensor([0.3]), 0.2).tolist() == [False]
    assert second_moment_keep(torch.zeros(0), 0.04).shape == (0,)


def _algorithm_1(m2: list[float], threshold: float) -> list[bool]:
    """The M2PO paper's Algorithm 1, literally: while the mean over the set left exceeds the
    threshold, remove its largest element."""
    left = set(range(len(m2)))
    while left and sum(m2[i] for i in left) / len(left) > threshold:
        left.remove(max(left, key=lambda i: (m2[i], -i)))
    return [i in left for i in range(len(m2))]


@pytest.mark.parametrize("seed", range(5))
def test_second_moment_keep_equals_algorithm_1(seed):
    g = torch.Generator().manual_seed(seed)
    m2 = (torch.randn(200, generator=g, dtype=F64) * 0.3) ** 2
    for threshold in (0.0, 0.01, 0.04, 0.09, 1.0):
        assert second_moment_keep(m2, threshold).tolist() == _algorithm_1(m2.tolist(), threshold)


@pytest.mark.parametrize("trust_region", [False, True])
def test_m2po_split_over_ranks_equals_whole_batch(trust_region):
    # two data-parallel ranks holding rows 0-2 and 3-5 mask as the whole batch does, given the
    # gather of each rank's candidate values (in rank order) and its offset
    g = torch.Generator().manual_seed(7)
    rollout = torch.randn(6, 8, generator=g, dtype=F64) - 1
    old = rollout + torch.randn(6, 8, generator=g, dtype=F64) * 0.3
    mask = (torch.rand(6, 8, generator=g) < 0.75).to(F64)
    adv = torch.randn(6, 1, generator=g, dtype=F64).expand(6, 8) if trust_region else None
    whole, m_whole = m2po_mask(old, rollout, mask, 0.04, adv)
    assert 0 < (mask - whole).sum() < mask.sum()
    halves = [slice(0, 3), slice(3, 6)]
    seen = []
    for h in halves:  # what each rank would contribute
        m2po_mask(
            old[h],
            rollout[h],
            mask[h],
            0.04,
            None if adv is None else adv[h],
            gather=lambda v: (seen.append(v), (v, 0))[1],
        )
    every, offsets = torch.cat(seen), [0, seen[0].numel()]
    parts = [
        m2po_mask(old[h], rollout[h], mask[h], 0.04, None if adv is None else adv[h], gather=lambda v, o=o: (every, o))
        for h, o in zip(halves, offsets)
    ]
    torch.testing.assert_close(torch.cat([k for k, _ in parts]), whole)
    assert parts[1][1]["m2po_m2_kept"].item() == pytest.approx(m_whole["m2po_m2_kept"].item())


@pytest.mark.parametrize("fill", GARBAGE)
def test_m2po_padding_invariance(fill):
    def spoil(x):
        return pad(torch.where(M2_MASK.bool(), x, torch.full_like(x, fill)), 2, fill)

    keep, m = m2po_mask(M2_OLD, M2_ROLLOUT, M2_MASK, 0.04)
    keep_p, m_p = m2po_mask(spoil(M2_OLD), spoil(M2_ROLLOUT), pad(M2_MASK, 2, 0.0), 0.04)
    torch.testing.assert_close(keep_p[:, :4], keep)
    assert (keep_p[:, 4:] == 0).all()
    torch.testing.assert_close(m_p, m)


def test_m2po_asks_for_the_old_logprobs_first():
    # one epoch of one mini-batch takes the old log-probs from the update's own forward pass;
    # M2PO chooses its mask over the whole mini-batch before that pass, so it asks for them first
    one_pass = ["preset=tiny", "actor.ppo_epochs=1", "actor.mini_batch_size=0"]
    assert not needs_old_logprobs(load_config(one_pass), 8)
    assert needs_old_logprobs(load_config([*one_pass, "algorithm.m2po_threshold=0.04"]), 8)
    assert not needs_old_logprobs(load_config([*one_pass, "algorithm.m2po_threshold=0.04"]), 8, actor_frozen=True)


# ---------------------------------------------------------------- equal to verl's rollout correction

SAFETY = 20.0  # verl's bound on log-ratios before exp


def _masked_sum(x, mask):
    return (x * mask).sum(-1)


def verl_is_weights(log_ratio, mask, level, threshold):
    """verl's rollout_is weights: exp of the (token or summed-sequence) log-ratio, bounded to
    [-20, 20] before exp, zeroed on padding, then clamped at rollout_is_threshold."""
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY, SAFETY))
    else:
        w = torch.exp(_masked_sum(log_ratio, mask).clamp(-SAFETY, SAFETY))[:, None].expand_as(log_ratio)
    return (w * mask).clamp(max=threshold)


def verl_rs_mask(log_ratio, mask, option, threshold):
    """verl's rollout_rs k1 options: the statistic -log r (token, summed or averaged over the
    response) must lie in [log lower, log upper], threshold "lower_upper"."""
    lower, upper = (float(x) for x in threshold.split("_"))
    k1 = -log_ratio.clamp(-SAFETY, SAFETY)
    if option == "token_k1":
        stat = k1
    elif option == "seq_sum_k1":
        stat = _masked_sum(k1, mask)[:, None]
    else:  # seq_mean_k1
        stat = (_masked_sum(k1, mask) / mask.sum(-1))[:, None]
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    return keep.expand_as(log_ratio).to(mask.dtype) * mask


def _random_case(seed, scale, rows=64, cols=12):
    g = torch.Generator().manual_seed(seed)
    rollout = torch.randn(rows, cols, generator=g, dtype=F64) - 1.5
    old = rollout + torch.randn(rows, cols, generator=g, dtype=F64) * scale
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).to(F64)
    old[0, 0] += 2.0  # one ratio of e^2 = 7.4 at least, above every cap
    return old, rollout, mask


# (verl preset, verl rollout_is / threshold, verl rollout_rs / threshold, offstep tis_level or None,
#  offstep rejection_level, log-ratio scale of the random case)
VERL_PRESETS = [
    ("decoupled_token_is", ("token", 2.0), None, "token", "off", 0.5),
    ("decoupled_seq_is (Seq-TIS)", ("sequence", 2.0), None, "sequence", "off", 0.3),
    ("decoupled_seq_is_rs (Seq-MIS)", ("sequence", 2.0), ("seq_sum_k1", "0.5_2.0"), "sequence", "sequence", 0.3),
    ("Seq-MIS, asymmetric bounds", ("sequence", 3.0), ("seq_sum_k1", "0.7_1.2"), "sequence", "sequence", 0.2),
    ("decoupled_geo_rs (Geo-RS)", None, ("seq_mean_k1", "0.999_1.001"), None, "geometric", 0.004),
    ("decoupled_geo_rs_token_tis", ("token", 2.0), ("seq_mean_k1", "0.999_1.001"), "token", "geometric", 0.004),
    ("token IS + token_k1 RS", ("token", 2.0), ("token_k1", "0.6_1.5"), "token", "token", 0.5),
    (
        "IcePop [0.5, 5] as verl token IS 5 + token_k1 0.2_2",
        ("token", 5.0),
        ("token_k1", "0.2_2.0"),
        "token",
        "token",
        1.0,
    ),
]


@pytest.mark.parametrize(
    "name, verl_is, verl_rs, tis_level, rejection_level, scale", VERL_PRESETS, ids=[p[0] for p in VERL_PRESETS]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_equal_to_verl(name, verl_is, verl_rs, tis_level, rejection_level, scale, seed):
    old, rollout, mask = _random_case(seed, scale)
    log_ratio = old - rollout
    # verl: the loss weight of a token is its IS weight (1 without IS) where the RS mask keeps it
    ref_w = verl_is_weights(log_ratio, mask, *verl_is) if verl_is else mask
    ref_keep = verl_rs_mask(log_ratio, mask, *verl_rs) if verl_rs else mask
    # offstep, with the keys its verl translation sets (offstep.launch.verl)
    weights = mask
    if tis_level is not None:
        weights, _ = truncated_importance_weights(old, rollout, mask, cap=verl_is[1], level=tis_level)
    keep = mask
    if rejection_level != "off":
        low, high = verl_k1_bounds(verl_rs[1])
        keep, _ = rejection_mask(old, rollout, mask, level=rejection_level, ratio_low=low, ratio_high=high)
    torch.testing.assert_close(weights, ref_w)
    torch.testing.assert_close(keep, ref_keep)
    torch.testing.assert_close(weights * keep, ref_w * ref_keep)
    # the random case is not trivial: weights are truncated, and rejection both keeps and rejects
    if tis_level is not None:
        assert (ref_w[mask.bool()] == verl_is[1]).any() and (ref_w[mask.bool()] < verl_is[1]).any()
    if verl_rs:
        assert 0 < (mask - ref_keep).sum() < mask.sum()
    if name.startswith("IcePop"):
        w, _ = icepop_weights(old, rollout, mask, low=0.5, high=5.0)
        torch.testing.assert_close(w, ref_w * ref_keep)


# ---------------------------------------------------------------- M2PO through the actor (in-process, one gloo rank)


@pytest.fixture(scope="module")
def spec():
    from offstep.train.distributed import GroupSpec

    yield GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _actor_batch(spec, budget: int = 0, **algo):
    from offstep.batch import Sample, collate
    from offstep.config.schema import ActorConfig, AlgorithmConfig
    from offstep.models.loading import resolve_model
    from offstep.train.actor import ActorWorker

    g = torch.Generator().manual_seed(5)
    samples = [
        Sample(
            uid=i // 2,
            prompt_ids=torch.randint(3, 512, (p,), generator=g).tolist(),
            response_ids=torch.randint(3, 512, (r,), generator=g).tolist(),
            rollout_logprobs=(-torch.rand(r, generator=g) * 8).tolist(),
            finish_reason="stop",
            score=float(i % 2),
            version=0,
        )
        for i, (p, r) in enumerate(zip([7, 3, 12, 5, 9, 4, 6, 11], [2, 30, 5, 0, 17, 1, 9, 24]))
    ]
    batch = collate(samples, pad_id=0)
    batch.advantages = torch.randn(len(batch), 1, generator=g) * batch.response_mask
    cfg = AlgorithmConfig(tis=False, use_kl_loss=False, entropy_coeff=0.0, **algo)
    actor = ActorWorker(
        spec,
        0,
        str(resolve_model("tiny")),
        "float32",
        "float32",
        ActorConfig(micro_batch_size=3, micro_token_budget=budget),
        cfg,
        1.0,
    )
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    return actor, batch


def _params(actor):
    return [
        p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in actor.model.parameters()
    ]


def test_actor_m2po_mask_is_the_mini_batchs(spec):
    # the mask is chosen once over the whole mini-batch: the same tokens, metrics and update
    # whatever the micro-batch split (3 padded rows each, or a token budget that trims)
    _, batch = _actor_batch(spec)
    mask = batch.response_mask
    m2 = (batch.old_logprobs - batch.rollout_logprobs)[mask.bool()].pow(2).mean().item()
    threshold = m2 / 3
    keep, expected = m2po_mask(batch.old_logprobs, batch.rollout_logprobs, mask, threshold)
    assert 0 < (mask - keep).sum() < mask.sum()
    results = []
    for budget in (0, 80):
        actor, _ = _actor_batch(spec, budget, m2po_threshold=threshold)
        metrics, _ = actor.update(batch)
        for key in ("m2po_masked_frac", "m2po_m2", "m2po_m2_kept"):
            assert metrics[key] == pytest.approx(expected[key].item(), rel=1e-5), key
        results.append(_params(actor))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    # a dropped token weighs 0 and keeps its place in the normaliser: the same update as with its
    # advantage set to 0 and M2PO off
    actor, _ = _actor_batch(spec, m2po_threshold=0.0)
    zeroed = batch.select(slice(0, len(batch)))
    zeroed.advantages = batch.advantages * keep
    actor.update(zeroed)
    for a, b in zip(results[0], _params(actor)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
