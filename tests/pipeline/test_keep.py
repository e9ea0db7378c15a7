"""Worker processes kept between runs (``tests/keep_workers.py``; the test session's Ray keeps
them): a run on kept workers equals one on fresh workers, in the same processes; a run of another
shape, a failed run and a kept worker that died each leave no stale worker behind."""

from __future__ import annotations

import os

import keep_workers as keep
import pytest
import ray

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train

pytestmark = pytest.mark.ray

# Timings and throughputs differ between any two runs; everything else a step reports must not.
_TIMED = ("timing_s/", "perf/", "/busy", "_s/", "wait")


def _run(tmp_path, name: str, *extra: str) -> list[dict]:
    cfg = load_config(
        [
            "preset=tiny",
            "pipeline.max_staleness=1",
            "trainer.total_steps=3",
            "trainer.progress=off",
            f"trainer.output_dir={tmp_path / name}",
            *extra,
        ]
    )
    return [{k: v for k, v in m.items() if not any(t in k for t in _TIMED)} for m in train(cfg)]


def _kept_pids() -> list[int]:
    kept = keep._kept
    assert kept is not None, "the run kept no workers"
    handles = [*(h for hs in kept.processes.roles.values() for h in hs), *kept.processes.rollout]
    return ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])


def test_a_run_on_kept_workers_equals_one_on_fresh_workers(tmp_path, ray_free):
    fresh = _run(tmp_path, "fresh")
    pids = _kept_pids()
    again = _run(tmp_path, "kept")
    assert _kept_pids() == pids  # the same processes ran the second run
    assert again == fresh
    trained = [m for m in fresh if m["step"] >= 1]
    assert len(trained) == 3 and all(m["actor/grad_norm"] > 0 for m in trained)


def test_a_run_of_another_shape_releases_the_kept_workers(tmp_path, ray_free):
    _run(tmp_path, "one")
    old = keep._kept
    _run(tmp_path, "critic", "algorithm.adv_estimator=gae")  # a critic role: another shape
    assert keep._kept is not old and "critic" in keep._kept.processes.roles and "critic" not in old.processes.roles
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.processes.rollout[0].__ray_ready__.remote(), timeout=30)


def test_a_failed_run_keeps_nothing(tmp_path, ray_free):
    _run(tmp_path, "ok")
    reward = tmp_path / "bad.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    raise ValueError('boom')\n"
    )
    with pytest.raises(Exception, match="boom"):
        _run(tmp_path, "bad", f"reward.custom_path={reward}")
    assert keep._kept is None


def test_a_kept_worker_that_died_is_replaced_by_a_fresh_start(tmp_path, ray_free):
    fresh = _run(tmp_path, "fresh")
    ray.kill(keep._kept.processes.rollout[0])
    assert _run(tmp_path, "after") == fresh


def test_runs_that_hold_more_than_their_objects_are_not_kept(tmp_path, ray_free):
    _run(tmp_path, "collective", "pipeline.weight_sync=collective")
    assert keep._kept is None
    _run(tmp_path, "fully_async", "pipeline.mode=fully_async")
    assert keep._kept is None


def test_a_pool_that_cannot_be_placed_leaves_no_pool_behind(tmp_path, ray_free, monkeypatch):
    """The rollout pool refused after the trainer's was placed: the trainer's is removed, else its
    cores and its name ('trainer') would stay taken and every later run in the process would fail."""
    from offstep.errors import PlacementFailed
    from offstep.pipeline.pools import Pool

    real = Pool.create.__func__

    def create(cls, name, *args, **kwargs):
        if name == "rollout":
            raise PlacementFailed("the rollout pool could not be placed (a test's refusal)")
        return real(cls, name, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Pool, "create", classmethod(create))
        with pytest.raises(PlacementFailed, match="a test's refusal"):
            _run(tmp_path, "refused")
    after = _run(tmp_path, "after")  # the trainer's pool placed again, by its name
    assert [m["step"] for m in after if m["step"] >= 1] == [1, 2, 3]
