"""Data safety and security of checkpoints, without Ray: a received checkpoint runs no code, and
what a checkpoint stores reads back exactly. Run folders, damaged checkpoints and commits:
test_folder_safety.py; exports: test_export_safety.py."""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from offstep.batch import GenTiming, Sample, Span
from offstep.config.schema import to_yaml
from offstep.launch.loader import ConfigError, load_config
from offstep.pipeline.checkpoints import (
    Checkpoints,
    check_compatible,
    complete_checkpoints,
    open_checkpoint,
)
from offstep.pipeline.dynamic_sampling import Generated
from offstep.pipeline.trainer_state import STATE_FILE, TrainerState, decode_state, encode_state
from offstep.train.checkpoint import CheckpointError, _dcp_load, check_role, load_model_weights, load_role
from tests.saved_roles import commit_small, ended_run, save_small_role, single_process_dcp  # noqa: F401 (an autouse fixture)


class Payload:
    """Unpickling this creates ``marker``: what a hostile pickle would do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


# ------------------------------------------------------------------ trainer_state.json
def test_every_sample_field_is_read_back_from_a_checkpoint():
    """A field added to ``Sample`` is stored in a checkpoint's in-flight batches; if the reader
    does not know it, every such checkpoint reads as damaged and a resume starts afresh."""
    import dataclasses

    from offstep.pipeline.trainer_state import _SAMPLE_CHECKS

    assert {f.name for f in dataclasses.fields(Sample)} == set(_SAMPLE_CHECKS)


def test_every_stream_sample_state_field_is_read_back_from_a_checkpoint():
    """The same for the fully asynchronous stream's unfinished samples (``SampleState``): a field
    the reader does not know (``kv_age`` was one) makes every fully async checkpoint damaged."""
    import dataclasses

    from offstep.pipeline.trainer_state import _STATE_CHECKS
    from offstep.rollout.stream.replica_stream import SampleState

    assert {f.name for f in dataclasses.fields(SampleState)} == set(_STATE_CHECKS)


def test_trainer_state_round_trips_exactly():
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            uid=7 + i // 2,
            prompt_ids=[1, 2, 3],
            response_ids=[4, 5],
            rollout_logprobs=[float(v) for v in rng.normal(size=2)],
            finish_reason="stop",
            score=0.1 + i,
            version=3,
            data_source="arith",
            text="4",
            reward_extra={"acc": np.float32(0.5), "n": np.int64(2), "flag": np.bool_(True)},
            ref_logprobs=[-math.inf, 1e-310] if i == 0 else None,
            baseline_score=math.nan if i == 1 else None,
            baseline_length=5 if i == 1 else None,
        )
        for i in range(4)
    ]
    rounds = [
        [
            (samples[:2], GenTiming(Span(1.25, 2.5, 3), Span(2.5, 2.75))),
            (samples[2:], GenTiming(Span(1.0, 3.0, 3), cut=5)),
        ]
    ]
    gen = Generated(rounds, [samples[2], samples[3], samples[0]], {16: 4, 17: 9}, kept_groups=1, filled_groups=1)
    stream = {"epoch": 1, "position": 8, "num_items": 40, "batch_size": 4, "seed": 0, "shuffle": True}
    state = TrainerState(4, 4, 1717171717.123456789, stream, [(5, 1, [4, 9], gen)], 2, {"value": 0.1 + 0.2})

    back, run_id, _ = decode_state(encode_state(state, "run-a"))
    assert run_id == "run-a"
    assert (back.step, back.version, back.stream, back.restarts, back.kl_ctrl) == (
        4,
        4,
        stream,
        2,
        {"value": 0.1 + 0.2},
    )
    assert _bits(back.t0) == _bits(state.t0)
    ((b, e, idx, g),) = back.in_flight
    assert (b, e, idx) == (5, 1, [4, 9])
    assert g.prompt_of == {16: 4, 17: 9} and all(type(k) is int for k in g.prompt_of)
    assert (g.kept_groups, g.filled_groups) == (1, 1)
    flat = [s for results in g.rounds for ss, _ in results for s in ss]
    assert [s.uid for s in flat] == [s.uid for s in samples]
    for got, want in zip(flat, samples):
        assert [_bits(x) for x in got.rollout_logprobs] == [_bits(x) for x in want.rollout_logprobs]
        assert _bits(got.score) == _bits(want.score) and got.prompt_ids == want.prompt_ids
    assert flat[0].ref_logprobs == [-math.inf, 1e-310] and math.isnan(flat[1].baseline_score)
    assert flat[0].reward_extra == {"acc": 0.5, "n": 2, "flag": True}
    assert g.rounds[0][0][1] == GenTiming(Span(1.25, 2.5, 3), Span(2.5, 2.75)) and g.rounds[0][1][1].ref is None
    assert g.rounds[0][1][1].cut == 5  # the samples rollout.over_sample_rate cut, for the step's count
    # The training samples are the rounds' own objects, as in the run that wrote them.
    assert [id(s) for s in g.samples] == [id(flat[2]), id(flat[3]), id(flat[0])]


def test_rank_file_is_json_and_restores_every_rng(tmp_path):
    import random

    model = save_small_role(tmp_path / "actor")
    state = json.loads((tmp_path / "actor" / "rank0.json").read_text())
    assert set(state) == {"format", "rng", "sched", "extra"}
    want = (random.random(), float(np.random.rand()), torch.rand(2))
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    other = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    assert load_role(tmp_path / "actor", 0, other, opt) == {"updates": 1}
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    assert torch.equal(other.weight, model.weight)


# ------------------------------------------------------------------ received checkpoints run no code
def test_crafted_dcp_metadata_is_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    save_small_role(tmp_path / "actor")
    (tmp_path / "actor" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata refers to pathlib.Path.touch.*refused"):
        load_model_weights(tmp_path / "actor", torch.nn.Linear(3, 2))
    assert "refers to pathlib.Path.touch" in check_role(tmp_path / "actor")
    (tmp_path / "actor" / ".metadata").write_bytes(pickle.dumps((os.system, ("touch " + str(marker),))))
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        load_model_weights(tmp_path / "actor", torch.nn.Linear(3, 2))
    assert not marker.exists()


def test_crafted_non_tensor_item_in_shards_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"weight": torch.ones(2), "evil": Payload(marker)}}, checkpoint_id=str(tmp_path / "actor"))
    with pytest.raises(CheckpointError, match="'model.evil' holds a pickled object .*refused") as e:
        _dcp_load({"model": {"weight": torch.zeros(2), "evil": None}}, tmp_path / "actor")
    assert "weights_only=False" not in str(e.value)  # never torch's advice to load it unrestricted
    assert not marker.exists()


def test_crafted_rank_and_state_files_are_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    ck = Checkpoints(tmp_path / "run")
    path = commit_small(ck, 1)
    (path / "actor" / "rank0.json").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="rank0.json cannot be read"):
        load_role(path / "actor", 0, torch.nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match="step 1 at .*damaged.*rank0.json"):
        open_checkpoint(path)
    # An older offstep's pickled trainer_state.pt is never loaded: the checkpoint does not count.
    legacy = tmp_path / "legacy" / "checkpoints" / "step_000001"
    legacy.mkdir(parents=True)
    (legacy / "trainer_state.pt").write_bytes(pickle.dumps(Payload(marker)))
    assert complete_checkpoints(legacy.parent) == []
    cfg = load_config(["preset=tiny", f"trainer.output_dir={tmp_path / 'legacy'}"])
    with pytest.raises(ConfigError, match="older offstep.*trainer.overwrite=true"):
        ended_run(cfg, lambda _: None)
    (path / STATE_FILE).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="trainer_state.json cannot be read"):
        open_checkpoint(path)
    assert not marker.exists()


def test_a_stored_tool_loop_is_checked_before_it_is_continued():
    """A checkpoint's unfinished tool loop (``SampleState.loop``) becomes an AgentResult on a replica:
    only its own fields, each of its kind, per-token lists of one length."""
    from offstep.pipeline.trainer_state import decode_stream_groups

    loop = {
        "request_pos": 0,
        "response_ids": [5, 6],
        "logprobs": [-0.1, 0.0],
        "versions": [0, -1],
        "loss_mask": [1, 0],
        "turns": 1,
        "calls": [{"name": "x", "arguments": {}, "error": "", "ran": True}],
        "tool_time_s": 0.5,
    }

    def doc(lp):
        return {
            "admitted": 1,
            "drawn": [],
            "epoch": 0,
            "groups": [
                {"g": 0, "epoch": 0, "prompt": 0, "replica": 0, "version": 0, "samples": None, "states": [{"loop": lp}]}
            ],
        }

    assert decode_stream_groups(doc(loop))[0]["states"][0]["loop"] == loop
    for bad in (
        {**loop, "turns": "1"},
        {**loop, "__class__": "x"},
        {**loop, "loss_mask": [1]},
        {**loop, "max_turns_hit": 1},
        {k: v for k, v in loop.items() if k != "request_pos"},
        {**loop, "calls": ["rm -rf /"]},
        [1, 2],
    ):
        with pytest.raises(ValueError, match="a sample state that is not"):
            decode_stream_groups(doc(bad))


def test_saved_config_is_data_never_interpolated(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFSTEP_TEST_SECRET", "hunter2")
    saved = to_yaml(load_config(["preset=tiny"])).replace("path: tiny", "path: ${oc.env:OFFSTEP_TEST_SECRET}")
    with pytest.raises(ConfigError, match=r"model.path: checkpoint '\$\{oc.env:OFFSTEP_TEST_SECRET\}'") as e:
        check_compatible(saved, load_config(["preset=tiny"]))
    assert "hunter2" not in str(e.value)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        check_compatible(
            saved.replace("${oc.env:OFFSTEP_TEST_SECRET}", "tiny").replace(
                "train_batch_size: 4", "train_batch_size: 5"
            ),
            load_config(["preset=tiny"]),
        )
