"""Tests for offstep.data.prompt_stream: the prompt stream (epochs, shuffling, resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from offstep.data.prompt_stream import PromptStream


def take(stream, n):
    return [stream.next_batch() for _ in range(n)]


def test_stream_epochs_cover_items_and_drop_last():
    s = PromptStream(num_items=10, batch_size=3, seed=0)
    assert s.batches_per_epoch == 3
    batches = take(s, 6)
    assert [e for e, _ in batches] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        seen = [i for e, b in batches if e == epoch for i in b]
        assert len(seen) == 9 and len(set(seen)) == 9  # no repeats, one item dropped
        assert seen == s.permutation(epoch)[:9]
    assert all(len(b) == 3 and all(type(i) is int for i in b) for _, b in batches)


def test_stream_epoch_permutations_differ_and_depend_on_seed_and_epoch():
    s = PromptStream(100, 10, seed=3)
    assert s.permutation(0) != s.permutation(1)
    assert sorted(s.permutation(1)) == list(range(100))
    assert s.permutation(4) == [int(i) for i in np.random.default_rng([3, 4]).permutation(100)]
    assert PromptStream(100, 10, seed=4).permutation(0) != s.permutation(0)


def test_stream_deterministic():
    a = take(PromptStream(17, 4, seed=11), 20)
    b = take(PromptStream(17, 4, seed=11), 20)
    assert a == b
    assert a != take(PromptStream(17, 4, seed=12), 20)


def test_stream_no_shuffle():
    s = PromptStream(5, 2, seed=0, shuffle=False)
    assert take(s, 3) == [(0, [0, 1]), (0, [2, 3]), (1, [0, 1])]


def test_stream_resume():
    original = PromptStream(23, 3, seed=7)
    take(original, 5)
    state = original.state_dict()
    assert state["epoch"] == 0 and state["position"] == 15
    state = json.loads(json.dumps(state))  # state survives serialization

    restored = PromptStream(23, 3, seed=7)
    restored.load_state_dict(state)
    assert take(restored, 12) == take(original, 12)


def test_stream_resume_at_epoch_boundary():
    original = PromptStream(8, 4, seed=1)
    take(original, 2)  # end of epoch 0
    assert original.epoch == 0 and original.peek_epoch() == 1
    restored = PromptStream(8, 4, seed=1)
    restored.load_state_dict(original.state_dict())
    assert restored.epoch == 0 and restored.peek_epoch() == 1
    assert take(restored, 5) == take(original, 5)


def test_stream_epoch_properties():
    s = PromptStream(6, 3, seed=0)
    assert s.epoch == 0 and s.peek_epoch() == 0 and s.batches_consumed == 0
    s.next_batch()
    assert s.epoch == 0 and s.peek_epoch() == 0
    s.next_batch()
    assert s.epoch == 0 and s.peek_epoch() == 1 and s.batches_consumed == 2
    epoch, _ = s.next_batch()
    assert epoch == 1 and s.epoch == 1


def test_stream_iter():
    s = PromptStream(4, 2, seed=0)
    it = iter(s)
    assert [next(it)[0] for _ in range(5)] == [0, 0, 1, 1, 2]


def test_stream_validation():
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptStream(3, 4, seed=0)
    with pytest.raises(ValueError):
        PromptStream(0, 1, seed=0)
    with pytest.raises(ValueError):
        PromptStream(3, 0, seed=0)
    with pytest.raises(ValueError):
        PromptStream(3, 1, seed=-1)
    PromptStream(4, 4, seed=0)  # batch_size == num_items is fine


def test_stream_load_state_mismatch():
    state = PromptStream(10, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_items"):
        PromptStream(11, 2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptStream(10, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch"):
        PromptStream(10, 2, seed=0).load_state_dict({"position": 0})
    # a minimal state dict works
    s = PromptStream(10, 2, seed=0)
    s.load_state_dict({"epoch": 2, "position": 4})
    assert s.next_batch() == (2, s.permutation(2)[4:6])
