"""DAPO dynamic sampling in the pipeline: which groups a batch keeps, how it is topped up, and a
tiny run that has to generate more than once per step."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINES

from offstep.batch import Sample
from offstep.launch.loader import load_config
from offstep.pipeline.dynamic_sampling import assemble, refill_indices


def _s(uid: int, score: float) -> Sample:
    return Sample(
        uid=uid, prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0], finish_reason="stop", score=score, version=0
    )


def test_assemble_keeps_unequal_groups_first_and_fills_with_equal_ones():
    # groups: 10 -> (1, 1) equal; 11 -> (0, 1) kept; 12 -> (0, 0) equal; 13 -> (1, 0) kept
    samples = [_s(10, 1), _s(10, 1), _s(11, 0), _s(11, 1), _s(12, 0), _s(12, 0), _s(13, 1), _s(13, 0)]
    out, kept, filled = assemble(samples, groups_needed=2)
    assert (kept, filled) == (2, 0) and [s.uid for s in out] == [11, 11, 13, 13]
    # Three groups needed, two have signal: the first equal-reward group (10) fills the batch.
    out, kept, filled = assemble(samples, groups_needed=3)
    assert (kept, filled) == (2, 1) and [s.uid for s in out] == [10, 10, 11, 11, 13, 13]
    # Only the first groups_needed of the kept groups are used.
    out, kept, filled = assemble(samples, groups_needed=1)
    assert (kept, filled) == (1, 0) and [s.uid for s in out] == [11, 11]


def test_refill_indices_are_a_pure_function_of_seed_batch_and_attempt():
    a = refill_indices(0, 5, 1, 100, 8)
    assert a == refill_indices(0, 5, 1, 100, 8) and len(set(a)) == 8 and all(0 <= i < 100 for i in a)
    assert a != refill_indices(0, 5, 2, 100, 8) and a != refill_indices(0, 6, 1, 100, 8)
    assert len(refill_indices(0, 1, 1, 3, 8)) == 3  # never more than the data set holds


# Half the groups of the tiny model get unequal rewards, half get all-zero ones.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str) % 2)
'''


@pytest.mark.ray
@pytest.mark.parametrize("engine", ENGINES)
def test_dynamic_sampling_run_fills_every_batch(tmp_path, ray_session, engine):
    from offstep.pipeline.controller import train

    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    history = train(
        load_config(
            [
                "preset=tiny",
                f"rollout.engine={engine}",
                f"trainer.output_dir={out}",
                "trainer.total_steps=3",
                "trainer.val_before_train=false",
                "trainer.progress=off",
                f"reward.custom_path={reward}",
                "algorithm.dynamic_sampling=true",
                "algorithm.dynamic_sampling_max_attempts=4",
                "rollout.n=4",
            ]
        )
    )
    steps = [m for m in history if "reward/mean" in m]
    assert len(steps) == 3
    for m in steps:
        assert 1 <= m["rollout/dynamic_sampling_attempts"] <= 4
        assert 0 <= m["rollout/dynamic_sampling_filled_groups"] <= 4
    # A batch with no filled groups holds only groups with unequal rewards: its mean reward is
    # strictly between 0 and 1, and every step trained on the full batch.
    events = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert any(e["stage"] == "gen" for e in events)
    full = [m for m in steps if m["rollout/dynamic_sampling_filled_groups"] == 0]
    assert all(0 < m["reward/mean"] < 1 for m in full)
