"""Tests for offstep.algos.dapo: soft overlong punishment and the dynamic-sampling group filter."""

import pytest
import torch

from offstep.algos.dapo import dynamic_sampling_keep, overlong_penalty


def test_overlong_penalty_hand():
    # L_max 20, buffer 4 -> no penalty up to 16; inside the buffer (16 - |y|) / 4; -1 beyond 20
    # lengths 10, 16, 17, 18, 20, 25 -> 0, 0, -0.25, -0.5, -1, -1
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    # factor 0.5 halves it
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 20, 0)


def test_dynamic_sampling_keep_hand_and_loop():
    # group 0: 1, 1 (all equal: drop); group 5: 0, 1 (keep); group 2: 0.5, 0.5, 0.5 (drop);
    # group 9: a single response (drop: nothing to compare)
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.5, 1.0, 0.5, 3.0])
    groups = torch.tensor([0, 5, 2, 0, 2, 5, 2, 9])
    keep = dynamic_sampling_keep(scores, groups)
    assert keep.tolist() == [False, True, False, False, False, True, False, False]
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (60,), generator=g).float()
    groups = torch.randint(0, 15, (60,), generator=g)
    ref = [len({scores[j].item() for j in range(60) if groups[j] == groups[i]}) > 1 for i in range(60)]
    assert dynamic_sampling_keep(scores, groups).tolist() == ref
    # eps: differences up to eps count as equal
    assert dynamic_sampling_keep(torch.tensor([0.0, 1e-9]), torch.tensor([1, 1]), eps=1e-6).tolist() == [False, False]
