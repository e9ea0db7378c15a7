"""Weight sync: the bucket layout (hand-worked), the collective path between real gloo process
groups (one thread per rank), the Ray workers' methods against FSDP2, and a tiny run end to end
that must equal the object-store path step for step."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from offstep.models.loading import load_causal_lm
from offstep.sync.collective import (
    Bucket,
    Slot,
    TensorSpec,
    WeightReceiver,
    WeightSender,
    manifest,
    overlaps,
    plan,
)
from offstep.sync.weights import pack_state_dict, unpack_state_dict

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ layout (pure)
def test_plan_hand_worked():
    specs = [TensorSpec("a", (2, 3), "float32"), TensorSpec("b", (4,), "bfloat16"), TensorSpec("c", (5,), "float32")]
    slots, totals, buckets = plan(specs, bucket_bytes=16)
    # float32: a = elements 0..5, c = 6..10 -> 11 elements; bfloat16: b = 0..3 -> 4 elements.
    assert slots == {"a": Slot("float32", 0, 6), "b": Slot("bfloat16", 0, 4), "c": Slot("float32", 6, 5)}
    assert totals == {"float32": 11, "bfloat16": 4}
    # 16 bytes = 4 float32 elements or 8 bfloat16 elements per bucket:
    # float32 [0,4) [4,8) [8,11); bfloat16 [0,4) (all 4 fit in one bucket of 8).
    assert buckets == [
        Bucket("float32", 0, 4),
        Bucket("float32", 4, 8),
        Bucket("float32", 8, 11),
        Bucket("bfloat16", 0, 4),
    ]
    # a (0..5) touches bucket 0 with 4 elements and bucket 1 with 2; c (6..10) bucket 1 with 2, bucket 2 with 3.
    assert overlaps(slots["a"], buckets) == [(0, 4), (1, 2)]
    assert overlaps(slots["c"], buckets) == [(1, 2), (2, 3)]
    assert overlaps(slots["b"], buckets) == [(3, 4)]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="weight_sync_bucket_mb"):
        plan([TensorSpec("a", (1,), "float32")], 0)
    with pytest.raises(ValueError, match="twice"):
        plan([TensorSpec("a", (1,), "float32"), TensorSpec("a", (1,), "float32")], 64)


def test_manifest_lists_tied_weights_once():
    model = load_causal_lm("tiny", dtype=torch.float32)
    names = [s.name for s in manifest(model)]
    assert model.config.tie_word_embeddings
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert sum(s.numel for s in manifest(model)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pipeline.weight_sync=nccl"], "pipeline.weight_sync"),
        (["pipeline.weight_sync=collective", "pipeline.weight_sync_bucket_mb=0"], "pipeline.weight_sync_bucket_mb"),
        (["pipeline.weight_sync=collective", "pipeline.weight_sync_timeout_s=-1"], "pipeline.weight_sync_timeout_s"),
    ],
)
def test_invalid_weight_sync_config_names_the_key(overrides, key):
    from offstep.launch.loader import ConfigError, load_config
    from offstep.launch.preflight import validate

    validate(load_config(["preset=tiny", "pipeline.weight_sync=collective"]), cpu_count=2, gpu_count=0)
    with pytest.raises(ConfigError, match=key):
        validate(load_config(["preset=tiny", *overrides]), cpu_count=2, gpu_count=0)


# ------------------------------------------------------------------ gloo groups, one thread per rank
def _run_threads(fns):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def _connect(actor_model, receivers, bucket_bytes, max_in_flight=1):
    sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=60)
    host, port = sender.endpoint
    specs = manifest(receivers[0].model)
    world = 1 + len(receivers)
    _run_threads(
        [lambda: sender.connect(world, "gloo", specs, bucket_bytes, manifest(actor_model), max_in_flight)]
        + [
            lambda r=r, i=i: r.connect(host, port, i + 1, world, "gloo", specs, bucket_bytes, 60)
            for i, r in enumerate(receivers)
        ]
    )
    return sender


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_collective_sync_gives_the_actors_weights(rollout_dtype, replicas):
    actor = _perturbed(load_causal_lm("tiny", dtype=torch.float32), seed=1)
    rollouts = [load_causal_lm("tiny", dtype=DT[rollout_dtype]) for _ in range(replicas)]
    receivers = [WeightReceiver(m, torch.device("cpu")) for m in rollouts]
    # 10 kB buckets: many buckets, tensors straddling bucket borders.
    sender = _connect(actor, receivers, bucket_bytes=10_000)
    before = [p.data_ptr() for p in rollouts[0].parameters()]
    for version in (1, 2):
        if version == 2:
            _perturbed(actor, seed=2)
        sender.send(actor.named_parameters(), version)
        _run_threads([lambda r=r, v=version: r.receive(v) for r in receivers])
        # The object-store path: fp32 over the wire, cast on load. Same result, bit for bit.
        expected = {
            k: v.to(DT[rollout_dtype]) for k, v in unpack_state_dict(pack_state_dict(actor.state_dict())).items()
        }
        for m in rollouts:
            got = m.state_dict()
            assert got.keys() == expected.keys()
            for k, want in expected.items():
                assert got[k].dtype == DT[rollout_dtype]
                assert torch.equal(got[k], want), k
            # the tied head still shares the embedding's storage
            assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    # received in place: no parameter was reallocated after the set-up
    assert [p.data_ptr() for p in rollouts[0].parameters()] == before


def test_collective_sync_into_buffers_in_another_order():
    """A receiver with buffers of its own (the vLLM engine's path) laid out in another order than
    the actor sends in (vLLM's checkpoint order, here reversed): the sender still posts buckets in
    the receivers' order, so every tensor lands under its own name. (Before the fix, buckets went
    out in the order they filled and collectives paired them with the wrong ones.)"""
    actor = _perturbed(load_causal_lm("tiny", dtype=torch.float32), seed=3)
    specs = list(reversed(manifest(actor)))
    receiver = WeightReceiver(None, torch.device("cpu"), specs)
    sender = WeightSender("127.0.0.1", torch.device("cpu"), timeout_s=60)
    host, port = sender.endpoint
    _run_threads(
        [
            lambda: sender.connect(2, "gloo", specs, 10_000, manifest(actor)),
            lambda: receiver.connect(host, port, 1, 2, "gloo", specs, 10_000, 60),
        ]
    )
    for version in (1, 2):
        if version == 2:
            _perturbed(actor, seed=4)
        sender.send(actor.named_parameters(), version)
        _run_threads([lambda v=version: receiver.receive(v)])
        got = receiver.tensors()
        assert list(got) == [s.name for s in specs]
        for name, p in actor.named_parameters():
            assert torch.equal(got[name], p.detach()), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_collective_sync_on_gpus(backend):
    """The same transfer with CUDA tensors: gloo on one GPU; NCCL needs a GPU per rank (two here)."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the actor and the rollout worker on different GPUs")
    dev_a, dev_r = torch.device("cuda", 0), torch.device("cuda", 1 if backend == "nccl" else 0)
    actor = _perturbed(load_causal_lm("tiny", dtype=torch.float32), seed=1).to(dev_a)
    model = load_causal_lm("tiny", dtype=torch.bfloat16).to(dev_r)
    receiver = WeightReceiver(model, dev_r)
    sender = WeightSender("127.0.0.1", dev_a, timeout_s=60)
    host, port = sender.endpoint
    specs = manifest(model)

    def on(dev, fn):
        return lambda: (torch.cuda.set_device(dev), fn())

    _run_threads(
        [
            on(dev_a, lambda: sender.connect(2, backend, specs, 10_000, manifest(actor))),
            on(dev_r, lambda: receiver.connect(host, port, 1, 2, backend, specs, 10_000, 60)),
        ]
    )
    _run_threads([on(dev_a, lambda: sender.send(actor.named_parameters(), 1)), on(dev_r, lambda: receiver.receive(1))])
    for k, v in actor.state_dict().items():
        assert torch.equal(model.state_dict()[k].cpu(), v.to(torch.bfloat16).cpu()), k


def test_receiver_detects_an_out_of_step_version():
    actor = load_causal_lm("tiny", dtype=torch.float32)
    receiver = WeightReceiver(load_causal_lm("tiny", dtype=torch.float32), torch.device("cpu"))
    sender = _connect(actor, [receiver], bucket_bytes=2**20)
    sender.send(actor.named_parameters(), 3)
    with pytest.raises(RuntimeError, match="expected version 2.*sent version 3"):
        receiver.receive(2)


def test_sender_does_not_wait_for_a_busy_receiver():
    """The actor posts version 1 and 2 while the rollout worker is still busy (as with k = 2);
    a second snapshot holds version 2, and the worker then receives both, in order."""
    actor = load_causal_lm("tiny", dtype=torch.float32)
    model = load_causal_lm("tiny", dtype=torch.float32)
    receiver = WeightReceiver(model, torch.device("cpu"))
    sender = _connect(actor, [receiver], bucket_bytes=2**16, max_in_flight=2)
    sender.send(actor.named_parameters(), 1)
    v1 = {k: v.clone() for k, v in actor.state_dict().items()}
    _perturbed(actor, seed=3)
    sender.send(actor.named_parameters(), 2)  # returns although nobody has received version 1
    assert len(sender.snapshots) == 2
    receiver.receive(1)
    assert all(torch.equal(model.state_dict()[k], v1[k]) for k in v1)
    receiver.receive(2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in actor.state_dict().items())


def test_mismatched_models_fail_with_a_message():
    from offstep.sync.collective import check_manifest

    specs = manifest(load_causal_lm("tiny", dtype=torch.float32))
    other = [TensorSpec(s.name, (s.shape[0] + 1, *s.shape[1:]), s.dtype) if i == 0 else s for i, s in enumerate(specs)]
    with pytest.raises(ValueError, match="model.path"):
        check_manifest(specs, other[:-1], "actor")


# ------------------------------------------------------------------ Ray workers, FSDP2 actor
def _rollout_state(w):
    import ray

    return ray.get(
        w.__ray_call__.remote(lambda self: {k: v.clone() for k, v in self.engine.model.state_dict().items()})
    )


@pytest.mark.ray
def test_ray_workers_collective_and_object_store_agree(ray_free, tmp_path):
    """ActorWorker (FSDP2 over gloo) -> two RolloutWorkers, collective and object-store syncs
    interleaved: after each, both engines hold exactly the actor's full weights and the version."""
    import ray

    from offstep.config.schema import ActorConfig, AlgorithmConfig
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.worker import RolloutWorker
    from offstep.sync.collective import connect
    from offstep.train.actor import ActorWorker
    from offstep.train.distributed import GroupSpec

    spec = GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    env = {"runtime_env": {"env_vars": {"OFFSTEP_CACHE": os.environ["OFFSTEP_CACHE"], "HF_HUB_OFFLINE": "1"}}}
    actor = (
        ray.remote(ActorWorker)
        .options(num_cpus=0.01, **env)
        .remote(spec, 0, "tiny", "float32", "float32", ActorConfig(), AlgorithmConfig(), 1.0)
    )
    reward = RewardFunction()
    rollouts = [
        ray.remote(RolloutWorker).options(num_cpus=0.01, **env).remote(RolloutSpec.local("tiny", reward, 8))
        for _ in range(2)
    ]
    try:
        connect([actor], rollouts, "gloo", bucket_mb=0.05, timeout_s=60)

        def perturb(self, seed):
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.to_local().add_(torch.randn(p.to_local().shape, generator=g))
            return {k: v.clone() for k, v in self.full_state_dict(self.model).items()}

        for version, path in ((1, "collective"), (2, "object_store"), (3, "collective")):
            expected = ray.get(actor.__ray_call__.remote(perturb, version))
            if path == "collective":
                loads = [w.receive_weights.remote(version) for w in rollouts]
                ray.get(actor.send_weights.remote(version))
            else:
                refs = ray.get(actor.export_weights.remote())
                loads = [w.load_weights.remote(refs[0], version) for w in rollouts]
            assert [t.span.version for t in ray.get(loads)] == [version, version]
            for w in rollouts:
                got = _rollout_state(w)
                assert ray.get(w.__ray_call__.remote(lambda self: self.engine.version)) == version
                for k, v in expected.items():
                    assert torch.equal(got[k], v), (path, k)
    finally:
        for h in [actor, *rollouts]:
            ray.kill(h)


# ------------------------------------------------------------------ a tiny run end to end
def _run(out, *extra):
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    train(
        load_config(
            [
                "preset=tiny",
                "trainer.total_steps=3",
                f"trainer.output_dir={out}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                *extra,
            ]
        )
    )
    return [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1], read_jsonl(out / "timeline.jsonl")


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_run_collective_equals_object_store(tmp_path, ray_session):
    """k = 0: the collective path gives the same run as the object-store path, step for step."""
    a, _ = _run(tmp_path / "store", "pipeline.max_staleness=0")
    b, tl = _run(
        tmp_path / "coll",
        "pipeline.max_staleness=0",
        "pipeline.weight_sync=collective",
        "pipeline.weight_sync_bucket_mb=0.1",
    )
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for key in (
            "reward/mean",
            "response_length/mean",
            "actor/pg_loss",
            "actor/kl",
            "actor/entropy",
            "actor/grad_norm",
        ):
            assert x[key] == y[key], (x["step"], key)
    assert sorted(e["version"] for e in tl if e["stage"] == "load_weights") == [1, 2, 3]


@pytest.mark.ray
def test_tiny_run_collective_one_step_off_policy(tmp_path, ray_session):
    """k = 1 over the collective path: loads queue behind generation; versions as in the object-store path."""
    m, tl = _run(tmp_path, "pipeline.max_staleness=1", "pipeline.weight_sync=collective")
    assert [x["rollout/staleness_max"] for x in m] == [0, 1, 1]
    gen = {e["step"]: e["version"] for e in tl if e["stage"] == "gen"}
    assert [gen[s] for s in (1, 2, 3)] == [0, 0, 1]
    assert sorted(e["version"] for e in tl if e["stage"] == "load_weights") == [1, 2, 3]


@pytest.mark.ray
@pytest.mark.slow
def test_fsdp_two_ranks_two_replicas_collective_equals_object_store(tmp_path, ray_session):
    """FSDP2 over 2 trainer ranks (the full tensors are all-gathered) broadcasting to 2 replicas."""
    extra = ("pipeline.max_staleness=0", "pipeline.colocate=true", "resources.trainer_workers=2", "rollout.replicas=2")
    a, _ = _run(tmp_path / "store", *extra)
    b, tl = _run(tmp_path / "coll", *extra, "pipeline.weight_sync=collective")
    for x, y in zip(a, b, strict=True):
        for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert x[key] == y[key], (x["step"], key)
    loads = sorted((e["role"], e["version"]) for e in tl if e["stage"] == "load_weights")
    assert loads == [(f"rollout/{i}", v) for i in (0, 1) for v in (1, 2, 3)]
