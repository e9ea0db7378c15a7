"""The real controller loop with simulated (sleeping) workers (tests/fakes.py): pipeline invariants
for k = 0, 1, 2 in seconds, no model. No timing assertions: only the order of events on the
timeline and the versions the samples carry."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import fakes as sim
import pytest
import torch

from offstep.batch import Sample, collate
from offstep.pipeline.prepare import StalenessError, check_staleness
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Role, Rollout, Stage, Timing, replica


def _run(sim, tmp_path, k: int, steps: int, train_s: float = 0.05):
    cfg = sim.sim_config(tmp_path, k, steps)
    hist = sim.run_sim(cfg, gen_s=0.05, train_s=train_s, export_s=0.01, load_s=0.01)
    tl = read_jsonl(tmp_path / "timeline.jsonl")
    ev = {(e["role"], e["stage"], e["step"]): e for e in tl}
    return [m for m in hist if m["step"] >= 1], ev


def test_ideal_step():
    # k = 0: serial, 0.5 + 1.0 + 0.05 + 0.05 = 1.6; k >= 1: max(0.5 + 0.05, 1.0 + 0.05) = 1.05.
    assert sim.ideal_step(0, 0.5, 1.0, 0.05, 0.05) == pytest.approx(1.6)
    assert sim.ideal_step(1, 0.5, 1.0, 0.05, 0.05) == pytest.approx(1.05)
    assert sim.ideal_step(2, 1.0, 0.5, 0.05, 0.05) == pytest.approx(1.05)


@pytest.mark.ray
def test_one_step_off_policy_overlaps(tmp_path, ray_session):
    # An update ten times as long as generation: batch s+1's generation needs only v(s-1), so it
    # starts inside update s with a margin that a busy machine's Ray calls do not eat (at equal
    # lengths a slow weight load could start it just after update s ended).
    metrics, ev = _run(sim, tmp_path, 1, 4, train_s=0.5)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m[Rollout.STALENESS_MAX] for m in metrics] == [0, 1, 1, 1]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3, 4]
    # Batches 1 and 2 come from v0, batch s > 2 from v(s-2): one version behind the trainer (v(s-1)).
    assert [ev[(replica(0), Stage.GEN, s)]["version"] for s in range(1, 5)] == [0, 0, 1, 2]
    for s in range(1, 4):
        # Generation of batch s+1 starts before the update on batch s ends.
        assert ev[(replica(0), Stage.GEN, s + 1)]["start"] < ev[(Role.TRAINER, Stage.UPDATE_ACTOR, s)]["end"], s
        # Weights v(s) are loaded only after the update that made them.
        assert ev[(replica(0), Stage.LOAD_WEIGHTS, s)]["start"] >= ev[(Role.TRAINER, Stage.UPDATE_ACTOR, s)]["end"]
    assert all(Timing.SYNC_WEIGHTS in m and Timing.STEP in m for m in metrics)


@pytest.mark.ray
def test_next_batch_is_prepared_while_the_trainer_updates(tmp_path, ray_session):
    """k = 1, generation much shorter than training: the driver's work on batch s+1 (collate,
    metrics, advantages, the object-store copy) is done before the update on batch s ends, so the
    update on s+1 starts without waiting for it."""
    cfg = sim.sim_config(tmp_path, 1, 4)
    sim.run_sim(cfg, gen_s=0.02, train_s=0.4, export_s=0.01, load_s=0.01)
    ev = {(e["role"], e["stage"], e["step"]): e for e in read_jsonl(tmp_path / "timeline.jsonl")}
    for s in range(1, 4):
        assert ev[(Role.DRIVER, Stage.PREPARE, s + 1)]["end"] < ev[(Role.TRAINER, Stage.UPDATE_ACTOR, s)]["end"], s
        assert ev[(Role.DRIVER, Stage.PREPARE, s + 1)]["start"] >= ev[(replica(0), Stage.GEN, s + 1)]["end"], s


@pytest.mark.ray
def test_synchronous_does_not_overlap(tmp_path, ray_session):
    metrics, ev = _run(sim, tmp_path, 0, 3)
    assert [m[Rollout.STALENESS_MAX] for m in metrics] == [0, 0, 0]
    assert [ev[(replica(0), Stage.GEN, s)]["version"] for s in range(1, 4)] == [0, 1, 2]
    for s in range(1, 3):
        # The next generation starts after this step's weights are loaded.
        assert ev[(replica(0), Stage.GEN, s + 1)]["start"] >= ev[(replica(0), Stage.LOAD_WEIGHTS, s)]["end"], s


@pytest.mark.ray
def test_staleness_two_never_exceeded(tmp_path, ray_session):
    metrics, ev = _run(sim, tmp_path, 2, 5)
    assert [m[Rollout.STALENESS_MAX] for m in metrics] == [0, 1, 2, 2, 2]
    assert [ev[(replica(0), Stage.GEN, s)]["version"] for s in range(1, 6)] == [0, 0, 0, 1, 2]
    # The loop's schedule keeps to the bound; ``check_staleness``, where each batch is prepared, is
    # what enforces it: a batch one version staler than k is refused, not trained on.
    with pytest.raises(StalenessError, match="max_staleness=2"):
        check_staleness(torch.tensor([2, 1]), 4, 2)
    assert check_staleness(torch.tensor([4, 2]), 4, 2).tolist() == [0, 2]


def test_records_stay_in_step_order_when_a_validation_is_slow(tmp_path):
    """Step 2's validation is slow; step 3 (none) has its weights loaded long before. Step 3's
    record still comes after step 2's: a checkpoint relies on the metrics of the steps it covers
    being on disk first (``Controller._finish_step``). On one replica its call order alone would
    hide this; here the futures complete in the other order."""
    from types import SimpleNamespace

    from offstep.batch import GenTiming, Span
    from offstep.pipeline.controller import Controller, StepRecord
    from offstep.pipeline.weight_sync import SyncReport
    from offstep.sync.digest import Loaded, digest
    from offstep.telemetry.metrics import Timeline

    class Records(list):
        def log(self, m):
            self.append(m["step"])

        step = log

    async def later(result, s: float):
        await asyncio.sleep(s)
        return result

    async def steps():
        val = [
            (
                [
                    Sample(
                        uid=0,
                        prompt_ids=[1],
                        response_ids=[2],
                        rollout_logprobs=[-1.0],
                        finish_reason="stop",
                        score=1.0,
                        version=2,
                    )
                ],
                GenTiming(Span(0.0, 1.0, 2)),
            )
        ]
        loaded = SyncReport([Loaded(Span(0.0, 0.1, 2), digest([]), 0.0)], verified=True, collective=False)
        s2 = asyncio.ensure_future(
            ctl._finish_step(StepRecord(2, 2, {"step": 2}, 0.0, later(loaded, 0), True, later(val, 0.3)), None)
        )
        s3 = asyncio.ensure_future(ctl._finish_step(StepRecord(3, 3, {"step": 3}, 0.0, later(loaded, 0), False), s2))
        await s3

    ctl = Controller.__new__(Controller)
    ctl.history, ctl.loggers, ctl.console = [], Records(), Records()
    ctl.source = SimpleNamespace(loaded=lambda version: None)
    ctl.timeline = Timeline(tmp_path / "timeline.jsonl")
    asyncio.run(steps())
    assert [m["step"] for m in ctl.history] == [2, 3] and ctl.loggers == [2, 3]
    assert "val/reward/mean" in ctl.history[0] and "val/reward/mean" not in ctl.history[1]


def test_train_batch_pickles_exactly():
    """TrainBatch travels through Ray as numpy arrays (TrainBatch.__reduce__): exact round trip,
    including attributes set after collate and tensors numpy cannot hold (kept as tensors)."""
    samples = [
        Sample(
            uid=i,
            prompt_ids=[5, 6, 7][: i + 1],
            response_ids=[8, 9][:i],
            rollout_logprobs=[-0.5, -1.0][:i],
            finish_reason="stop",
            score=float(i),
            version=i,
        )
        for i in range(3)
    ]
    batch = collate(samples, pad_id=0)
    batch.advantages = torch.randn(3, batch.response_mask.shape[1])
    batch.values = torch.randn(3, batch.response_mask.shape[1]).to(torch.bfloat16)
    batch.note = "extra attribute"
    back = pickle.loads(pickle.dumps(batch))
    assert back.prompt_len == batch.prompt_len and back.note == "extra attribute"
    for f in dataclasses.fields(batch):
        a, b = getattr(batch, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    back.input_ids += 1  # its own, writable memory
    assert not torch.equal(back.input_ids, batch.input_ids)


def test_a_batch_is_submitted_to_the_replicas_before_its_launch_returns():
    """A replica runs its calls in submission order, and the collective path submits the weight
    receives as soon as the update is submitted. So a batch launched before an update must reach
    the replicas before the launch returns, not whenever the event loop next runs a task: else, when
    the trainer finds its batch ready and awaits nothing before the update (pipeline.ref_on_rollout),
    the receive overtakes the next generation, which then waits for the update (staleness 0, no
    overlap: seen as staleness 0, 1, 0, 1, ... on the default preset with weight_sync=collective)."""
    import asyncio
    from types import SimpleNamespace

    from offstep.config.schema import AlgorithmConfig, RolloutConfig
    from offstep.pipeline.dynamic_sampling import generate_batch
    from offstep.pipeline.fleet import RolloutFleet

    order = []

    class Replica:
        def __init__(self, i):
            self.generate = SimpleNamespace(
                remote=lambda *args: order.append(("generate", i)) or asyncio.sleep(0, ([], None))
            )
            self.receive_weights = SimpleNamespace(remote=lambda v: order.append(("receive", i)))

    async def main():
        replicas = [Replica(0), Replica(1)]
        fleet = RolloutFleet(SimpleNamespace(rollout=replicas), RolloutConfig(), reload=None, log=print)
        record = SimpleNamespace(data_source="s", ground_truth="1", extra_info={}, agent_name=None, messages=[])
        prompts = [SimpleNamespace(prompt_ids=[1, 2], images=(), record=record) for _ in range(4)]
        fut = generate_batch(fleet.submit, prompts, RolloutConfig(), AlgorithmConfig(), 0, 1, [0, 1, 2, 3])
        for r in replicas:  # what WeightSync.queue does on the collective path, with no await between
            r.receive_weights.remote(1)
        assert order == [("generate", 0), ("generate", 1), ("receive", 0), ("receive", 1)]
        await fut

    asyncio.run(main())


def test_calls_queued_on_a_lost_replica_all_fail_when_no_replacement_can_start(monkeypatch):
    """With k >= 1 two generations can be queued on a replica when its node leaves the cluster:
    both fail, and the first to fail makes the one replacement. When no node can take it, the
    call that made it fails after the placement wait, and so must the other, even when that other
    is the batch the trainer waits for. (It used to be sent to the replacement that never
    started, and waited for it forever: seen as a hung run in tests/pipeline/test_multinode.py when the
    later batch's call failed first.)"""
    import asyncio
    from types import SimpleNamespace

    import ray

    from offstep.config.schema import RolloutConfig
    from offstep.pipeline.fleet import RolloutFailed, RolloutFleet

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))

    async def main():
        loop = asyncio.get_running_loop()
        calls = []  # the old replica's generations, in submission order

        def old_generate(*args):
            calls.append(loop.create_future())
            return calls[-1]

        def never(*args):  # a replacement whose bundle no node can hold: nothing it is sent returns
            return loop.create_future()

        def pending_replica():
            return SimpleNamespace(generate=SimpleNamespace(remote=never), __ray_ready__=SimpleNamespace(remote=never))

        old = SimpleNamespace(generate=SimpleNamespace(remote=old_generate))
        made = []
        workers = SimpleNamespace(
            rollout=[old],
            make_rollout=lambda i: made.append(i) or pending_replica(),
            rollout_placed=lambda i: False,
            placement_wait_s=lambda: 0.5,
        )
        fleet = RolloutFleet(workers, RolloutConfig(), reload=None, log=print)
        record = SimpleNamespace(data_source="s", ground_truth="1", extra_info={}, agent_name=None, messages=[])
        prompts = [SimpleNamespace(prompt_ids=[1, 2], images=(), record=record)]
        params = SimpleNamespace()
        trained_next = fleet.submit(prompts, params, 0, 4, 0)  # the batch the trainer awaits
        later = fleet.submit(prompts, params, 0, 5, 1)
        lost = ray.exceptions.ActorUnavailableError("its node left the cluster", None)
        calls[1].set_exception(lost)  # the later batch's call fails first and makes the replacement
        await asyncio.sleep(0.05)
        calls[0].set_exception(lost)
        for fut in (trained_next, later):
            try:
                await asyncio.wait_for(fut, 10)
            except RolloutFailed as e:
                assert "no node of the Ray cluster had room for its replacement" in str(e)
            else:
                raise AssertionError("a generation succeeded on a replica that never started")
        assert made == [0], made  # one replacement for both calls
        assert killed == [old, workers.rollout[0]]  # the lost replica, then its replacement that never started

    asyncio.run(main())


@pytest.mark.ray
def test_checkpoints_by_time_lose_minutes_not_the_run(tmp_path, ray_session):
    """trainer.save_interval_s: a checkpoint after the first step that ends that long after the
    last one (or the start), none in between, with no save_freq and no save_last."""
    from offstep.pipeline.checkpoints import complete_checkpoints

    interval = 0.5
    cfg = sim.sim_config(tmp_path, 1, 10, f"trainer.save_interval_s={interval}", "trainer.keep_checkpoints=0")
    sim.run_sim(cfg, gen_s=0.1, train_s=0.15, export_s=0.01, load_s=0.01)
    saved = [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")]
    assert 1 <= len(saved) < 10, saved
    ev = {(e["stage"], e["step"]): e for e in read_jsonl(tmp_path / "timeline.jsonl") if e["role"] == Role.TRAINER}
    ends = [ev[(Stage.CHECKPOINT, s)]["end"] for s in saved]
    starts = [ev[(Stage.CHECKPOINT, s)]["start"] for s in saved]
    assert all(b - a >= interval for a, b in zip(ends, starts[1:])), (starts, ends)
    # The step before each checkpoint's step ended less than the interval after the previous one
    # (the first: after the loop began, when the trainer first waited; the workers' start is before it).
    steps = {s: e["end"] for (stage, s), e in ev.items() if stage == Stage.UPDATE_ACTOR}
    began = ev[(Stage.WAIT_GEN, 1)]["start"]
    for prev, s in zip([0, *saved], saved):
        if s - 1 > prev:
            assert steps[s - 1] - (ends[saved.index(prev)] if prev else began) < interval + 0.5
