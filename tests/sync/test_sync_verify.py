"""Syncs that prove they arrived (issue 17): the weight digest (hand-worked), the check of a load
against what was sent, and tiny runs where a dropped or corrupted load (injected by a test-only
rollout worker, ``tests/sync_faults.py``) stops the run at that step, naming the worker and the
version, while a normal run logs ``sync/verified == 1`` at every step."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINES
from sync_faults import faulty_class, faulty_start

from offstep.sync.digest import SyncNotVerified, WeightDigest, check_load, digest, digest_of, tensor_sums

MASK = (1 << 64) - 1


# ------------------------------------------------------------------ the checksum (pure)
def test_tensor_sums_hand_worked():
    # int32 rows [1, 2] and [3, 4]: row sums r = [3, 7]; s1 = 3 + 7 = 10, s2 = 1*3 + 2*7 = 17.
    assert tensor_sums(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)) == (10, 17)
    # float32 1.0 is the bit pattern 0x3F800000 = 1065353216; one row: s1 = s2 = that.
    assert tensor_sums(torch.tensor([1.0])) == (0x3F800000, 0x3F800000)
    # bfloat16 1.0 is 0x3F80; a row of two is 4 bytes, read as one little-endian int32 0x3F803F80.
    assert tensor_sums(torch.tensor([1.0, 1.0], dtype=torch.bfloat16)) == (0x3F803F80, 0x3F803F80)
    # a row of 3 bfloat16 (6 bytes) is read as three int16: 3 * 0x3F80 = 48768.
    assert tensor_sums(torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16)) == (48768, 48768)
    # row sums wrap mod 2^32: (2^31 - 1) + 1 = -2^31, which mod 2^64 is 2^64 - 2^31.
    assert tensor_sums(torch.tensor([2**31 - 1, 1], dtype=torch.int32)) == ((1 << 64) - 2**31,) * 2
    assert tensor_sums(torch.zeros(0)) == (0, 0)


def test_checksum_sees_one_bit_and_a_transpose():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    flipped = w.clone()
    flipped.view(-1).view(torch.int32)[1234] ^= 1  # the lowest mantissa bit of one element
    assert tensor_sums(flipped)[0] != tensor_sums(w)[0]
    # two rows swapped: the same row sums, so s1 is the same, but in other places: s2 differs
    swapped = w[[1, 0, *range(2, 64)]]
    assert tensor_sums(swapped)[0] == tensor_sums(w)[0] and tensor_sums(swapped)[1] != tensor_sums(w)[1]
    assert tensor_sums(w.t().contiguous()) != tensor_sums(w)  # a square matrix transposed


def test_checksum_does_not_depend_on_threads_or_chunking():
    """Integer sums are order-free: one thread or several give the same value."""
    w = torch.randn(3000, 577)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tensor_sums(w)
    finally:
        torch.set_num_threads(threads)
    assert tensor_sums(w) == one


def test_digest_of_casts_to_the_manifest():
    """The trainer digests its float32 weights as the rollout holds them (bfloat16 here): the
    same digest as the cast tensors'."""
    from offstep.sync.collective import TensorSpec

    w = {"a": torch.randn(4, 6), "b": torch.randn(5)}
    specs = [TensorSpec("b", (5,), "bfloat16"), TensorSpec("a", (4, 6), "bfloat16")]
    got = digest_of(specs, w.__getitem__)
    assert got == digest([("b", w["b"].to(torch.bfloat16)), ("a", w["a"].to(torch.bfloat16))])
    assert got.names == ("b", "a")


# ------------------------------------------------------------------ the check (pure)
def _d(*values: int) -> WeightDigest:
    return digest([(f"t{i}", torch.tensor([v], dtype=torch.int32)) for i, v in enumerate(values)])


def test_check_load_names_worker_version_and_tensor():
    check_load(0, 3, _d(1, 2), _d(1, 2), _d(0, 2), _d(0, 2))  # matched: nothing raised
    with pytest.raises(SyncNotVerified, match=r"version 3: rollout worker 1 holds weights that differ.*tensor: t1"):
        check_load(1, 3, _d(1, 2), _d(1, 5), _d(0, 2), _d(0, 2))
    # the previous load's digest again while the trainer's changed: a dropped load
    with pytest.raises(SyncNotVerified, match=r"version 4: rollout worker 0's weights did not change"):
        check_load(0, 4, _d(7, 7), _d(6, 6), _d(6, 6), _d(6, 6))
    # the trainer's did not change either (a skipped update): the same weights are right
    check_load(0, 4, _d(6, 6), _d(6, 6), _d(6, 6), _d(6, 6))


# ------------------------------------------------------------------ a rollout worker, in process
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_worker_digest_reads_back_what_the_engine_holds(dtype):
    """A float32 export loaded into a (bfloat16) engine: the worker's digest equals the trainer's
    digest of what it sent (cast to the manifest), and it reads the engine, not the message: a
    weight changed in the engine after the load changes it. The test's faulty worker
    (``sync_faults.py``): ``corrupt`` names the changed tensor, ``drop`` leaves the previous load's
    digest."""
    from offstep.models.loading import load_causal_lm
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.sync.weights import pack_state_dict

    worker = faulty_class("corrupt", 2)(RolloutSpec.local("tiny", RewardFunction(), 8, dtype=dtype))
    specs = worker.weight_sync_manifest()
    actor = load_causal_lm("tiny", dtype=torch.float32)

    def update():
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.01)
        sd = actor.state_dict()
        return pack_state_dict(sd), digest_of(specs, sd.__getitem__)

    packed, sent = update()
    loaded = worker.load_weights(packed, 1)
    assert loaded.digest == sent and loaded.span.version == 1 and 0 < loaded.digest_s < loaded.span.seconds
    with torch.no_grad():
        worker.engine.model.get_parameter(specs[3].name).view(-1)[0] += 1
    assert worker._loaded(0.0, 1).digest.first_difference(sent) == specs[3].name

    packed, sent = update()
    assert worker.load_weights(packed, 2).digest.first_difference(sent) == specs[-1].name
    worker.fault = None
    before = worker.load_weights(packed, 2).digest  # loaded again without the fault: right again
    assert before == sent
    worker.fault = ("drop", 3)
    packed3, sent3 = update()
    dropped = worker.load_weights(packed3, 3)
    assert worker.engine.version == 3 and dropped.digest == before != sent3


# ------------------------------------------------------------------ tiny runs
# Two replicas on a 2-core machine: colocated with the trainer (which needs k = 0).
TWO_REPLICAS = ("rollout.replicas=2", "pipeline.max_staleness=0", "pipeline.colocate=true")


def _run(tmp_path, *extra, start=None):
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    out = tmp_path / "run"
    cfg = load_config(
        [
            "preset=tiny",
            "trainer.total_steps=3",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            *extra,
        ]
    )
    try:
        train(cfg, start)
    finally:
        metrics = (
            [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1] if (out / "metrics.jsonl").exists() else []
        )
    return metrics, read_jsonl(out / "timeline.jsonl")


@pytest.mark.ray
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_every_sync_is_verified(tmp_path, ray_session, engine, transport):
    metrics, timeline = _run(tmp_path, f"rollout.engine={engine}", f"pipeline.weight_sync={transport}")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["sync/verified"] for m in metrics] == [1.0, 1.0, 1.0]
    assert all(m["sync/collective"] == float(transport == "collective") for m in metrics)
    assert all(0 <= m["timing_s/sync_verify"] < m["timing_s/sync_weights"] for m in metrics)
    loads = [e for e in timeline if e["stage"] == "load_weights"]
    assert sorted(e["version"] for e in loads) == [1, 2, 3] and {e["transport"] for e in loads} == {transport}


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["object_store", "collective"])
@pytest.mark.parametrize(
    "fault, message",
    [
        ("drop", r"version 2: rollout worker 1's weights did not change"),
        ("corrupt", r"version 2: rollout worker 1 holds weights that differ from what the trainer sent"),
    ],
)
def test_a_dropped_or_corrupted_sync_stops_the_run_at_that_step(tmp_path, ray_session, transport, fault, message):
    """Two replicas; replica 1 drops (or corrupts) its load of version 2. The run stops with an
    error naming replica 1 and version 2, before step 2's record (and before any batch generated
    with those weights is trained on): steps 1 is logged, verified; 2 and 3 are not."""
    with pytest.raises(SyncNotVerified, match=message):
        _run(
            tmp_path,
            f"pipeline.weight_sync={transport}",
            *TWO_REPLICAS,
            start=faulty_start(fault, replica=1, version=2),
        )
    from offstep.telemetry.metrics import read_jsonl

    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if m["step"] >= 1]
    assert [(m["step"], m["sync/verified"]) for m in metrics] == [(1, 1.0)]


@pytest.mark.ray
def test_lora_adapter_syncs_are_verified_and_a_corrupted_one_is_caught(tmp_path, ray_session):
    """LoRA: a sync carries the adapters only, and their digest is checked the same way."""
    lora = ("actor.lora.rank=4", "actor.optim.lr=1e-3")
    metrics, _ = _run(tmp_path / "ok", *lora, "pipeline.weight_sync=collective")
    assert [m["sync/verified"] for m in metrics] == [1.0, 1.0, 1.0]
    with pytest.raises(SyncNotVerified, match=r"version 3: rollout worker 0 holds weights that differ.*lora_"):
        _run(tmp_path / "bad", *lora, start=faulty_start("corrupt", replica=0, version=3))


def test_no_fault_key_in_the_configuration():
    """Faults are injected by the tests' own worker, not by a key of the user's configuration."""
    from offstep.launch.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match="unknown configuration key 'pipeline.sync_fault'"):
        load_config(["preset=tiny", "pipeline.sync_fault=drop:1:2"])


# ------------------------------------------------------------------ a replaced replica rejoins the group
REJOINING_REWARD = '''
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # solution_str "": the driver's dry call of the scorer, not a sample. After 16 samples (two
    # batches of 8), the first replica to score another dies, once, in the middle of a generation.
    if solution_str:
        fd = os.open(COUNTER, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, b"x")
        os.close(fd)
        if os.path.getsize(COUNTER) > 16:
            try:
                os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return 0.0
            os._exit(1)
    return 0.0
'''


@pytest.mark.ray
def test_a_replaced_replica_rejoins_a_rebuilt_collective_group(tmp_path, ray_session):
    """Two replicas over the collective path; one dies in the third batch's generation, after the
    first sync went over the group. It is replaced, every replica joins a new group, and the later
    syncs are broadcasts again (not the object store), each verified on both replicas."""
    reward = tmp_path / "rejoin.py"
    reward.write_text(
        REJOINING_REWARD.replace("COUNTER", repr(str(tmp_path / "count"))).replace(
            "MARKER", repr(str(tmp_path / "died"))
        )
    )
    metrics, timeline = _run(
        tmp_path,
        "pipeline.weight_sync=collective",
        *TWO_REPLICAS,
        "trainer.total_steps=4",
        f"reward.custom_path={reward}",
    )
    assert (tmp_path / "died").exists(), "a replica was meant to die once"
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["sync/collective"] for m in metrics] == [1.0] * 4
    assert [m["sync/verified"] for m in metrics[2:]] == [1.0, 1.0]  # after the restart: every replica, every sync
    later = sorted(
        (e["role"], e["version"], e["transport"])
        for e in timeline
        if e["stage"] == "load_weights" and e["version"] >= 3
    )
    assert later == [(f"rollout/{i}", v, "collective") for i in (0, 1) for v in (3, 4)]
