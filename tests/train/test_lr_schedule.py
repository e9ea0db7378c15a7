"""The learning rate's schedule, worked by hand (``offstep.train.lr_schedule``)."""

import math

import pytest

from offstep.train.lr_schedule import LrSchedule, lr_factor

R2 = math.sqrt(2) / 2  # cos(pi / 4)


@pytest.mark.parametrize(
    "warmup,kind,expected",
    [
        (0, "constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
        (2, "constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        # horizon 4, no warm-up: 0.5 (1 + cos(pi t / 4)) at t = 0..4
        (0, "cosine", [1.0, 0.5 * (1 + R2), 0.5, 0.5 * (1 - R2), 0.0]),
        # warm-up 2: 1/2, 1, then the decay over the 2 steps left: progress 0, 1/2, 1
        (2, "cosine", [0.5, 1.0, 1.0, 0.5, 0.0]),
    ],
)
def test_warm_up_then_constant_or_cosine(warmup, kind, expected):
    assert [lr_factor(t, warmup, 4, kind) for t in range(5)] == pytest.approx(expected)


def test_the_cosine_ends_at_min_ratio_and_stays_there():
    # 0.1 + 0.9 x 0.5 (1 + cos(pi t / 2)): 1, 0.55, 0.1, then 0.1 past the horizon
    assert [lr_factor(t, 0, 2, "cosine", 0.1) for t in range(5)] == pytest.approx([1.0, 0.55, 0.1, 0.1, 0.1])


def test_one_whole_cycle_comes_back_up():
    # num_cycles=1: cos(2 pi t / 4) -> 1, 0.5, 0, 0.5, 1
    assert [lr_factor(t, 0, 4, "cosine", 0.0, 1.0) for t in range(5)] == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0])


def test_before_the_horizon_is_known_the_cosine_does_not_decay():
    schedule = LrSchedule(warmup=2, kind="cosine", min_ratio=0.0, num_cycles=0.5)
    assert [schedule(t) for t in range(3)] == [0.5, 1.0, 1.0]  # horizon 0: not set yet
    schedule.horizon = 4
    assert schedule(3) == pytest.approx(0.5)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_scheduler_type='wsd'"):
        lr_factor(0, 0, 4, "wsd")
