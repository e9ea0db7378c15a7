"""reward/uniform_group_frac by hand: the share of groups whose samples all scored the same. No Ray."""

from offstep.batch import Sample
from offstep.pipeline.step_metrics import uniform_group_frac
from offstep.telemetry.names import Reward


def _samples(groups: dict[int, list[float]]) -> list[Sample]:
    return [Sample(uid, [1], [2], [0.0], "stop", score, 0) for uid, scores in groups.items() for score in scores]


def test_uniform_groups_by_hand():
    # group 0 all right, 1 all wrong, 2 mixed, 3 mixed by a hair: 2 of 4 carry no signal
    m = uniform_group_frac(
        _samples({0: [1.0, 1.0, 1.0], 1: [0.0, 0.0, 0.0], 2: [1.0, 0.0, 1.0], 3: [0.5, 0.5, 0.5001]})
    )
    assert m == {Reward.UNIFORM_GROUP_FRAC: 0.5}
    # groups of one sample count for nothing (with rollout.n=1 every group is "uniform": no metric)
    assert uniform_group_frac(_samples({0: [1.0], 1: [0.0, 0.0]})) == {Reward.UNIFORM_GROUP_FRAC: 1.0}
    assert uniform_group_frac(_samples({0: [1.0], 1: [0.0]})) == {}
    # samples of a group need not be next to each other
    mixed = _samples({0: [1.0, 0.0], 1: [1.0, 1.0]})
    assert uniform_group_frac([mixed[0], mixed[2], mixed[1], mixed[3]]) == {Reward.UNIFORM_GROUP_FRAC: 0.5}
