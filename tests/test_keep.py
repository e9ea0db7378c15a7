"""Worker processes kept between runs (``offstep.pipeline.keep``; the test session's Ray keeps
two shapes' sets): a run on kept workers equals one on fresh workers, in the same processes; a
third shape releases the least recently used set, and a run with no room releases kept sets until
its pools fit; a failed run and a kept worker that died leave no stale worker behind."""

from __future__ import annotations

import os

import pytest
import ray

from offstep.config.loader import load_config
from offstep.pipeline import keep
from offstep.pipeline.controller import train

pytestmark = pytest.mark.ray

# Timings and throughputs differ between any two runs; everything else a step reports must not.
_TIMED = ("timing_s/", "perf/", "/busy", "_s/", "wait")


def _run(tmp_path, name: str, *extra: str) -> list[dict]:
    cfg = load_config(["preset=tiny", "pipeline.max_staleness=1", "trainer.total_steps=3", "trainer.progress=off",
                       f"trainer.output_dir={tmp_path / name}", *extra])
    return [{k: v for k, v in m.items() if not any(t in k for t in _TIMED)} for m in train(cfg)]


def _newest() -> keep.Kept:
    sets = keep.kept_sets()
    assert sets, "the run kept no workers"
    return sets[-1]


def _pids(kept: keep.Kept) -> list[int]:
    handles = [*(h for hs in kept.roles.values() for h in hs), *kept.rollout]
    return ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])


def _dead(kept: keep.Kept) -> bool:
    try:
        ray.get(kept.rollout[0].__ray_ready__.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_a_run_on_kept_workers_equals_one_on_fresh_workers(tmp_path, ray_free):
    fresh = _run(tmp_path, "fresh")
    pids = _pids(_newest())
    again = _run(tmp_path, "kept")
    assert _pids(_newest()) == pids and len(keep.kept_sets()) == 1  # the same processes ran the second run
    assert again == fresh
    trained = [m for m in fresh if m["step"] >= 1]
    assert len(trained) == 3 and all(m["actor/grad_norm"] > 0 for m in trained)


def test_a_third_shape_releases_the_least_recently_used_set(tmp_path, ray_free):
    _run(tmp_path, "one")
    one = _newest()
    _run(tmp_path, "critic", "algorithm.adv_estimator=gae")  # a critic role: another shape
    critic = _newest()
    assert "critic" in critic.roles and "critic" not in one.roles
    assert keep.kept_sets() == [one, critic] and not _dead(one)  # both kept, side by side
    _run(tmp_path, "one again")  # takes its own set back: now the most recently used
    assert keep.kept_sets() == [critic, one]
    _run(tmp_path, "lending", "pipeline.lend_cores=true")  # a third shape, the same pools: it fits beside them
    assert keep.kept_sets()[0] == one and critic not in keep.kept_sets() and _dead(critic)
    assert not _dead(one)


def test_a_run_without_room_releases_kept_sets_until_it_fits(tmp_path, ray_free, monkeypatch):
    monkeypatch.setattr(keep, "_sets", 3)  # three sets kept: with the session's three times the cores, no room left
    cores = f"rollout.cpus_per_replica={max(1, (os.cpu_count() or 1) - 1)}"  # each run takes the machine's cores
    _run(tmp_path, "one", cores)
    one = _newest()
    _run(tmp_path, "critic", cores, "algorithm.adv_estimator=gae")
    critic = _newest()
    _run(tmp_path, "lending", cores, "pipeline.lend_cores=true")
    assert len(keep.kept_sets()) == 3
    free = ray.available_resources().get("CPU", 0)
    assert free < sum(one.holds().values()), free  # a fourth shape's pools do not fit beside them
    _run(tmp_path, "ref on rollout", cores, "pipeline.ref_on_rollout=true")
    assert _dead(one) and not _dead(critic)  # the least recently used set made room, the others stayed
    assert keep.kept_sets()[0] == critic and len(keep.kept_sets()) == 3


def test_a_failed_run_keeps_nothing(tmp_path, ray_free):
    _run(tmp_path, "ok")
    reward = tmp_path / "bad.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('boom')\n")
    with pytest.raises(Exception, match="boom"):
        _run(tmp_path, "bad", f"reward.custom_path={reward}")
    assert keep.kept_sets() == []  # the run took the set, and a failed run keeps nothing


def test_a_kept_worker_that_died_is_replaced_by_a_fresh_start(tmp_path, ray_free):
    fresh = _run(tmp_path, "fresh")
    ray.kill(_newest().rollout[0])
    assert _run(tmp_path, "after") == fresh


def test_runs_that_hold_more_than_their_objects_are_not_kept(tmp_path, ray_free):
    _run(tmp_path, "collective", "pipeline.weight_sync=collective")
    assert keep.kept_sets() == []
    _run(tmp_path, "fully_async", "pipeline.mode=fully_async")
    assert keep.kept_sets() == []
