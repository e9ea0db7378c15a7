"""Delta weight syncs (``pipeline.weight_sync_delta``; ``offstep.sync.delta``): only the elements
that changed in the rollout's dtype travel, and the replica applies them to the version it holds.

- a delta applied to the version it was made from gives the full sync's weights, bit for bit (the
  digest), on the object-store path (a rollout worker, no Ray) and the collective one (gloo
  groups, one thread per rank), float32 and bfloat16;
- one applied to another version is refused, the weights left as they were, and the controller's
  full sync (a full export) re-bases it;
- a delta cut short (a sync killed mid-transfer) or damaged is refused before any write: the replica
  stays on its old version, which still verifies against what was sent for it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_sync import _connect, _run_threads

from offstep.models.loading import load_causal_lm
from offstep.sync.collective import WeightReceiver, manifest
from offstep.sync.delta import (
    DENSE,
    SPARSE,
    Delta,
    DeltaRefused,
    DeltaSender,
    apply,
    encode,
    fingerprint,
)
from offstep.sync.digest import check_load, digest, digest_of
from offstep.sync.weights import pack_state_dict

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _step(model, seed, lr=1e-4, frac=0.01):
    """An update like one at RL learning rates: a few elements move a little (bfloat16 rounds most
    moves away), one tensor moves everywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            mask = (torch.rand(p.shape, generator=g) < (1.0 if i == 1 else frac)).to(p.dtype)
            p.add_(mask * lr * torch.randn(p.shape, generator=g).to(p.dtype) * p.abs().clamp_min(1e-3))
    return model


def test_encode_picks_nothing_sparse_or_dense_and_applies_bit_for_bit():
    from offstep.sync.collective import TensorSpec

    specs = [TensorSpec(n, (64, 32), "bfloat16") for n in "abc"]
    base = {n: torch.randn(64, 32).to(torch.bfloat16) for n in "abc"}
    new = {n: t.clone() for n, t in base.items()}
    new["b"].view(-1)[[3, 700]] += 1.0  # two elements: indices + values
    new["c"] += 1.0  # every element: the tensor
    fp = fingerprint(digest(base.items()))
    d = encode(specs, new, base, 2, 1, fp)
    assert [(i, kind, n) for i, kind, n, _ in d.table.tolist()] == [(1, SPARSE, 2), (2, DENSE, 64 * 32)]
    assert d.nbytes == d.table.nbytes + 8 + 8 + 64 * 32 * 2  # 2 indices, 2 values, each array padded to 8 bytes
    held = {n: t.clone() for n, t in base.items()}
    assert apply(d, specs, held.__getitem__, fp) == 2 + 64 * 32
    assert digest(held.items()) == digest(new.items())
    with pytest.raises(DeltaRefused, match="another|not that of"):  # held is now version 2, not the base
        apply(d, specs, held.__getitem__, fingerprint(digest(held.items())))


def test_truncated_or_damaged_delta_writes_nothing():
    from offstep.sync.collective import TensorSpec

    specs = [TensorSpec("a", (100,), "float32"), TensorSpec("b", (100,), "float32")]
    base = {"a": torch.randn(100), "b": torch.randn(100)}
    new = {"a": base["a"].clone(), "b": base["b"] + 1}
    new["a"][5] += 1
    fp = fingerprint(digest(base.items()))
    d = encode(specs, new, base, 2, 1, fp)
    cut = dataclasses.replace(d, payload=d.payload[: d.payload.nbytes - 8])  # the last entry's tail lost
    bad = d.payload.copy()
    bad[:4] = np.frombuffer(np.int32(10_000).tobytes(), np.uint8)  # an index out of range
    for broken in (cut, dataclasses.replace(d, payload=bad)):
        held = {k: v.clone() for k, v in base.items()}
        with pytest.raises(DeltaRefused):
            apply(broken, specs, held.__getitem__, fp)
        assert digest(held.items()) == digest(base.items())  # not even entry "a" was written


def _worker(dtype):
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.worker import RolloutWorker

    return RolloutWorker(RolloutSpec.local("tiny", RewardFunction(), 8, dtype=dtype))


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_object_store_delta_equals_full_sync(dtype):
    """The actor's side (``ActorWorker.export_weights`` with deltas: ``DeltaSender``) against a real
    rollout worker: versions 1 (full), 2 and 3 (deltas) each verify against the full digest, and the
    deltas are a small fraction of a full sync."""
    actor = load_causal_lm("tiny", dtype=torch.float32)
    worker = _worker(dtype)
    specs = worker.weight_sync_manifest()
    sender = DeltaSender(specs, full_every=10)
    full_bytes = sum(a.nbytes for a, _ in pack_state_dict(actor.state_dict()).values())
    for version in (1, 2, 3):
        _step(actor, version)
        sd = actor.state_dict()
        cast = sender.cast(sd.__getitem__)
        sent = digest_of(specs, cast.__getitem__)
        d = sender.next(version, cast, sent, keep=False)
        assert (d is None) == (version == 1)
        loaded = worker.load_weights(pack_state_dict(sd) if d is None else d, version)
        assert not loaded.refused
        check_load(0, version, sent, loaded.digest, None, None)
        assert worker.engine.version == version
        if d is not None:
            assert d.nbytes < 0.25 * full_bytes, (d.nbytes, full_bytes)


@pytest.mark.heavy
def test_delta_on_another_version_is_refused_then_a_full_sync_rebases():
    actor = load_causal_lm("tiny", dtype=torch.float32)
    worker = _worker("float32")
    specs = worker.weight_sync_manifest()
    sender = DeltaSender(specs, full_every=10)

    def export(version, full=False):
        cast = sender.cast(actor.state_dict().__getitem__)
        sent = digest_of(specs, cast.__getitem__)
        d = sender.next(version, cast, sent, full, keep=False)
        return (pack_state_dict(actor.state_dict()) if d is None else d), sent

    v1, sent1 = export(1)
    worker.load_weights(v1, 1)
    _step(actor, 2)
    export(2)  # version 2 never reaches the worker (another replica's, say)
    _step(actor, 3)
    d3, _ = export(3)  # made from version 2
    loaded = worker.load_weights(d3, 3)
    assert "needs a full sync" in loaded.refused
    assert worker.engine.version == 1
    check_load(0, 1, sent1, loaded.digest, None, None)  # still version 1, verified
    full, sent = export(3, full=True)  # what WeightSync._rebase sends
    assert not isinstance(full, Delta)
    check_load(0, 3, sent, worker.load_weights(full, 3).digest, None, None)
    _step(actor, 4)
    d4, sent4 = export(4)  # deltas fit again
    loaded = worker.load_weights(d4, 4)
    assert not loaded.refused and isinstance(d4, Delta)
    check_load(0, 4, sent4, loaded.digest, None, None)


@pytest.mark.heavy
def test_killed_delta_leaves_the_old_version_verified():
    """A delta that arrives cut short (the sender killed mid-transfer) is refused before any write:
    the worker keeps version 1, whose digest still equals what was sent for it."""
    actor = load_causal_lm("tiny", dtype=torch.float32)
    worker = _worker("bfloat16")
    specs = worker.weight_sync_manifest()
    sender = DeltaSender(specs, full_every=10)
    cast = sender.cast(actor.state_dict().__getitem__)
    sent1 = digest_of(specs, cast.__getitem__)
    sender.next(1, cast, sent1, keep=False)
    worker.load_weights(pack_state_dict(actor.state_dict()), 1)
    _step(actor, 2, lr=1e-2)
    cast = sender.cast(actor.state_dict().__getitem__)
    d = sender.next(2, cast, digest_of(specs, cast.__getitem__), keep=False)
    cut = dataclasses.replace(d, payload=d.payload[: d.payload.nbytes // 2])
    loaded = worker.load_weights(cut, 2)
    assert "truncated" in loaded.refused and worker.engine.version == 1
    check_load(0, 1, sent1, loaded.digest, None, None)


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_collective_delta_equals_full_and_refuses_another_base(rollout_dtype):
    """Over a gloo group: version 1 full, 2 a delta into the live weights (bit for bit the actor's,
    cast); a receiver that claims another base refuses version 3, its weights unchanged."""
    actor = load_causal_lm("tiny", dtype=torch.float32)
    model = load_causal_lm("tiny", dtype=DT[rollout_dtype])
    receiver = WeightReceiver(model, torch.device("cpu"))
    sender = _connect(actor, [receiver], bucket_bytes=10_000)
    specs = manifest(model)
    delta = DeltaSender(specs, full_every=10)
    held = None
    for version in (1, 2, 3):
        _step(actor, version)
        sender.send(actor.named_parameters(), version, delta)
        if version == 3:
            before = digest_of(specs, model.get_parameter)
            with pytest.raises(DeltaRefused):
                receiver.receive(version, held ^ 1)
            assert digest_of(specs, model.get_parameter) == before
            continue
        _run_threads([lambda v=version, h=held: receiver.receive(v, h)])
        want = digest_of(specs, {k: v.to(DT[rollout_dtype]) for k, v in actor.state_dict().items()}.__getitem__)
        got = digest_of(specs, model.get_parameter)
        assert got == want
        held = fingerprint(got)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_tiny_run_with_deltas_equals_full_syncs(tmp_path, ray_session, path):
    """k = 0, bfloat16 rollout weights: a run whose syncs are deltas (a full one every 2) gives the
    run of full syncs, step for step, every sync verified."""
    from test_sync import _run

    extra = ("pipeline.max_staleness=0", f"pipeline.weight_sync={path}", "rollout.dtype=bfloat16")
    a, _ = _run(tmp_path / "full", *extra)
    b, tl = _run(tmp_path / "delta", *extra, "pipeline.weight_sync_delta=true", "pipeline.weight_sync_full_every=2")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["sync/verified"] == 1
        for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert x[key] == y[key], (x["step"], key)
    assert sorted(e["version"] for e in tl if e["stage"] == "load_weights") == [1, 2, 3]
