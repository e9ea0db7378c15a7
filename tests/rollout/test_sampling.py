"""The built-in engine's pure parts, no model: the sampler's inverse CDF (offstep.rollout.engines.sampling)
and the scheduler's shared prompt prefix (offstep.rollout.engines.schedule)."""

from __future__ import annotations

import pytest
import torch

from offstep.rollout.engines.sampling import sample_tokens
from offstep.rollout.types import SamplingParams


def test_sample_tokens_inverse_cdf():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    p = SamplingParams(temperature=1.0)
    us = (0.0, 0.15, 0.35, 0.65, 0.999)
    picks = [sample_tokens(logits, p, torch.tensor([u], dtype=torch.float64))[0].item() for u in us]
    assert picks == [0, 1, 2, 3, 3]
    tok, lp = sample_tokens(logits, SamplingParams(top_k=1), torch.tensor([0.5], dtype=torch.float64))
    assert tok.item() == 3 and lp.item() == 0.0
    tok, lp = sample_tokens(logits, SamplingParams(top_p=0.65), torch.tensor([0.0], dtype=torch.float64))
    assert tok.item() == 2 and abs(lp.item() - torch.log(torch.tensor(3 / 7)).item()) < 1e-6


@pytest.mark.heavy
def test_sample_tokens_quantiles_match_distribution():
    # Evenly spaced uniforms through the inverse CDF hit every token in proportion to its probability
    # (a vocabulary of 700: several CDF blocks, the last one partial).
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 700, generator=gen) * 2.0
    logits[0, 100:140] = float("-inf")  # a zero-mass stretch is never picked
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for t in (1.0, 0.5):
        tokens, lps = sample_tokens(logits.expand(n, -1), SamplingParams(temperature=t), u)
        probs = torch.softmax(logits[0] / t, -1)
        counts = torch.bincount(tokens, minlength=700).double()
        assert (counts - n * probs.double()).abs().max() <= 1.0 + 1e-6
        assert torch.allclose(lps, torch.log_softmax(logits[0] / t, -1)[tokens], atol=1e-5)
        assert tokens.diff().min() >= 0  # monotone in u: a true inverse CDF


def test_shared_prefix_length():
    from offstep.rollout.engines.schedule import shared_prefix

    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # each prompt keeps one token of its own
    assert shared_prefix([[7], [7, 8]]) == 0
    assert shared_prefix([[1, 2], [3, 2]]) == 0
