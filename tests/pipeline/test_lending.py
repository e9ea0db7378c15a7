"""Cores that never idle (``pipeline.lend_cores``): the trainer rank's thread count follows what the
driver lends it, taken by the compute thread at its next decoder layer; the driver lends once no
generation runs and takes the cores back before the next one; the combinations where nothing can
be lent are refused before start."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offstep.launch.loader import load_config
from offstep.launch.validate import problems
from offstep.pipeline.lending import CoreLending
from offstep.pipeline.pools import LEND_GROUP, RoleGroup
from offstep.train.threads import ThreadLease


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_compute_thread_takes_lent_cores_at_its_next_layer(tiny, threads):
    _, _, model, _ = tiny
    lease = ThreadLease(1)
    lease.follow(model.model.layers)
    seen: list[int] = []

    def lend_from_another_thread(*_):  # as the Ray actor's lend group does, while the rank computes
        t = threading.Thread(target=lease.lend, args=(1,))
        t.start()
        t.join()

    hooks = [
        model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads())),
        model.model.layers[0].register_forward_pre_hook(lend_from_another_thread),
        model.model.layers[1].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads())),
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        assert seen == [1, 2], "lent at layer 0 (from another thread), taken at layer 1"
        lease.lend(0)
        seen.clear()
        hooks[1].remove()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        assert seen == [1, 1], "given back: the first layer runs on the rank's own cores again"
    finally:
        for h in hooks:
            h.remove()


class _Handle:
    """A trainer rank's Ray handle, as far as CoreLending uses it: ``lend_threads.options(...).remote(n)``."""

    def __init__(self, sent: list):
        self.sent = sent

    @property
    def lend_threads(self):
        return self

    def options(self, concurrency_group: str):
        assert concurrency_group == LEND_GROUP
        return self

    def remote(self, cores: int):
        self.sent.append(cores)


def test_cores_are_lent_once_the_last_generation_ends_and_taken_back_at_the_next():
    sent: list[int] = []
    lending = CoreLending([RoleGroup("actor", [_Handle(sent), _Handle(sent)])], cores_per_rank=1)
    lending.busy()
    assert sent == [0, 0]
    lending.busy()  # a second batch generating ahead (k >= 2): nothing changes
    lending.idle()
    assert sent == [0, 0] and lending.take_seconds() == 0.0
    lending.idle()
    assert sent == [0, 0, 1, 1]
    time.sleep(0.05)
    lending.busy()
    assert sent[-2:] == [0, 0]
    lent = lending.take_seconds()
    assert 0.05 <= lent < 5.0
    assert lending.take_seconds() == 0.0, "each second is counted in one step only"


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["pipeline.mode=fully_async"], "the replicas never idle"),
        (["pipeline.max_staleness=0", "pipeline.colocate=true"], "colocated roles already take turns"),
        (["resources.gpus_per_trainer_worker=1"], "a GPU trainer"),
        (["resources.ray_address=auto"], "resources.ray_address"),
    ],
)
def test_nothing_to_lend_is_refused_before_start(extra, problem):
    found = [p for p in problems(load_config(["preset=tiny", "pipeline.lend_cores=true", *extra])) if "lend_cores" in p]
    assert len(found) == 1 and problem in found[0] and "pipeline.lend_cores=false" in found[0]
    assert not [
        p for p in problems(load_config(["preset=tiny", "pipeline.lend_cores=false", *extra])) if "lend_cores" in p
    ]


class _Rank:
    """A lendable role's rank: serves ``lend_threads`` while ``wait_for_cores`` runs."""

    def __init__(self, spec):
        self.threads = ThreadLease(spec.num_threads)

    def lend_threads(self, cores: int) -> None:
        self.threads.lend(cores)

    def wait_for_cores(self, timeout_s: float) -> int:
        t0 = time.monotonic()
        while self.threads.lent == 0 and time.monotonic() - t0 < timeout_s:
            time.sleep(0.01)
        return self.threads.lent


@pytest.mark.ray
def test_a_busy_rank_takes_the_lend_call_beside_its_running_call(ray_free):
    import sys

    import ray
    import ray.cloudpickle

    from offstep.pipeline.pools import Pool, Rendezvous

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    pool = Pool.create("lend-test", 1, 1, 0)
    try:
        group = RoleGroup.create("lend-test", _Rank, pool, 0.0, {}, Rendezvous("127.0.0.1"), lendable=True)
        running = group.submit(_Rank.wait_for_cores, 30.0)
        time.sleep(0.5)  # the rank is inside wait_for_cores: an ordinary call would queue behind it
        lending = CoreLending([group], cores_per_rank=1)
        lending.busy()  # a generation starts (the rank keeps its own cores) ...
        lending.idle()  # ... and ends: its cores are lent, to the rank that is busy meanwhile
        assert ray.get(running, timeout=60) == [1]
        group.kill()
    finally:
        pool.remove()


@pytest.mark.ray
def test_a_lending_run_trains_as_one_without(tmp_path, ray_session):
    """At the tiny model's sizes no kernel splits its work by thread count, so a run that lends must
    write the same numbers as one that does not: lending changes where the trainer computes, nothing
    else. Its last step holds the rollout's cores (no generation follows it)."""
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    runs = {}
    for lend in ("false", "true"):
        out = tmp_path / lend
        train(
            load_config(
                [
                    "preset=tiny",
                    "trainer.total_steps=3",
                    f"trainer.output_dir={out}",
                    "trainer.progress=off",
                    "trainer.val_before_train=false",
                    f"pipeline.lend_cores={lend}",
                ]
            )
        )
        runs[lend] = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert "perf/lent_cores_s" not in runs["false"][-1]
    assert runs["true"][-1]["perf/lent_cores_s"] > 0
    for a, b in zip(runs["false"], runs["true"], strict=True):
        same = [k for k in a if k.startswith(("actor/", "reward/", "adv/", "response_length/"))]
        assert same and {k: a[k] for k in same} == {k: b[k] for k in same}
