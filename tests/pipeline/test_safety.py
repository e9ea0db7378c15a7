"""Data safety and security of run folders and checkpoints, without Ray: a received checkpoint runs
no code; a run never writes into a folder it does not own; commits always leave a complete copy;
damaged checkpoints are named and passed over. Exports: test_export_safety.py."""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import quick_cases

from offstep.batch import GenTiming, Sample, Span
from offstep.config.schema import to_yaml
from offstep.launch.loader import ConfigError, load_config
from offstep.pipeline.checkpoints import (
    Checkpoints,
    check_compatible,
    complete_checkpoints,
    file_digests,
    open_checkpoint,
    read_run_id,
)
from offstep.pipeline.dynamic_sampling import Generated
from offstep.pipeline.run_dir import MARKER, open_run, read_marker
from offstep.pipeline.trainer_state import STATE_FILE, TrainerState, decode_state, encode_state
from offstep.train.checkpoint import CheckpointError, _dcp_load, check_role, load_model_weights, load_role, save_role


@pytest.fixture(autouse=True)
def _single_process_dcp():
    with warnings.catch_warnings():  # DCP: "no process group, assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        yield


class Payload:
    """Unpickling this creates ``marker``: what a hostile pickle would do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _role(path: Path, model: torch.nn.Module | None = None) -> torch.nn.Module:
    model = model or torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, model.in_features)).sum().backward()
    opt.step()
    sched.step()
    save_role(path, 0, model, opt, sched, {"updates": 1})
    return model


def _commit(ck: Checkpoints, step: int, cfg_yaml: str = "model: {path: tiny}\n", in_flight: list | None = None) -> Path:
    staging = ck.staging(step)
    _role(staging / "actor")
    return ck.commit(
        staging, TrainerState(step, step, 12.5, {"epoch": 0, "position": step}, in_flight or [], 0), cfg_yaml
    )


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

    model = _role(tmp_path / "actor")
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
    _role(tmp_path / "actor")
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
    path = _commit(ck, 1)
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
        _ended_run(cfg, lambda _: None)
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


# ------------------------------------------------------------------ run folders
def _ended_run(cfg, log):
    """``open_run`` of a run that then ends (its folder's lock released)."""
    run = open_run(cfg, log)
    run.lock.release()
    return run


def _cfg(out: Path, *extra: str):
    return load_config(["preset=tiny", f"trainer.output_dir={out}", "trainer.keep_checkpoints=1", *extra])


def test_the_audit_scenario_cannot_happen(tmp_path):
    """Run A saved steps 1 and 2; run B in the same folder with resume=off, save_freq=1 and
    keep_checkpoints=1 used to replace A's step 1, prune its own, and the next resume=auto took
    A's step 2 with mixed metrics. Now B is refused, or with overwrite moves A aside."""
    out, logs = tmp_path / "run", []
    a = _ended_run(_cfg(out), logs.append)
    ck_a = Checkpoints(out, 0, a.run_id)
    for s in (1, 2):
        _commit(ck_a, s, to_yaml(_cfg(out)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    with pytest.raises(
        ConfigError,
        match="holds run .* trainer.resume=off would write over it; give a new "
        "trainer.output_dir, or trainer.overwrite=true to move",
    ):
        _ended_run(_cfg(out, "trainer.resume=off"), logs.append)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing touched

    b = _ended_run(_cfg(out, "trainer.resume=off", "trainer.overwrite=true"), logs.append)
    assert b.run_id != a.run_id and b.resume is None
    (old,) = tmp_path.glob("run.old-*")
    assert [s for s, _ in complete_checkpoints(old / "checkpoints")] == [1, 2]
    assert (old / "metrics.jsonl").read_text().count("step") == 2 and read_marker(old) == a.run_id
    assert not (out / "metrics.jsonl").exists() and read_marker(out) == b.run_id
    assert any("moved the previous contents" in line for line in logs)
    ck_b = Checkpoints(out, 1, b.run_id)
    for s in (1, 2):
        _commit(ck_b, s, to_yaml(_cfg(out)))
    assert [s for s, _ in complete_checkpoints(ck_b.root)] == [2]
    resumed = _ended_run(_cfg(out), logs.append)
    assert resumed.run_id == b.run_id and resumed.resume.run_id == b.run_id and resumed.resume.state.step == 2


def test_pruning_never_deletes_another_runs_checkpoint(tmp_path):
    foreign = _commit(Checkpoints(tmp_path, 0, "someone-else"), 1)
    ours = Checkpoints(tmp_path, 1, "us")
    for s in (2, 3):
        _commit(ours, s)
    assert [s for s, _ in complete_checkpoints(ours.root)] == [1, 3]
    assert read_run_id(foreign) == "someone-else"


QUIET_LOG = lambda _: None  # noqa: E731


def test_folders_that_are_not_this_runs_are_refused(tmp_path):
    log = QUIET_LOG
    # Not an offstep run, not empty: refused with either resume mode; overwrite moves it aside.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for resume in ("auto", "off"):
        with pytest.raises(ConfigError, match=f"not an offstep run folder \\(it has no {MARKER}; it holds notes.txt"):
            _ended_run(_cfg(other, f"trainer.resume={resume}"), log)
    _ended_run(_cfg(other, "trainer.overwrite=true"), log)
    assert (next(tmp_path.glob("other.old-*")) / "notes.txt").read_text() == "mine"
    # A run with metrics but no checkpoint (killed before its first, or save_freq=0): resume=auto
    # cannot continue it, so the same command moves its records aside, in one line, and starts a
    # new run; resume=off is still refused.
    run = tmp_path / "run"
    first = _ended_run(_cfg(run), log)
    (run / "metrics.jsonl").write_text("")  # a start that crashed before step 1: nothing to keep
    assert _ended_run(_cfg(run), log).run_id == first.run_id
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds run .*metrics.jsonl.* trainer.resume=off would write over it"):
        _ended_run(_cfg(run, "trainer.resume=off"), log)
    said = []
    second = _ended_run(_cfg(run), said.append)
    assert second.run_id != first.run_id and second.resume is None and not (run / "metrics.jsonl").exists()
    aside = next(tmp_path.glob("run.old-*"))
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and read_marker(aside) == first.run_id
    assert len(said) == 1 and f"run {first.run_id} has no intact checkpoint" in said[0] and str(aside) in said[0]
    # With checkpoints that are all damaged it is refused, never restarted over them.
    damaged = _commit(Checkpoints(run, 0, second.run_id), 1)
    (damaged / STATE_FILE).write_text("{")
    with pytest.raises(ConfigError, match="holds run .*checkpoints/ \\(1\\).* but no intact checkpoint"):
        _ended_run(_cfg(run), QUIET_LOG)
    # Missing and empty folders become new runs.
    (tmp_path / "empty").mkdir()
    assert _ended_run(_cfg(tmp_path / "empty"), log).resume is None
    assert read_marker(tmp_path / "new" / "deep") is None
    assert _ended_run(_cfg(tmp_path / "new" / "deep"), log).run_id == read_marker(tmp_path / "new" / "deep")


def _recraft(ckpt: Path) -> None:
    """What a crafter does after editing a checkpoint's files: list their new digests in its state."""
    doc = json.loads((ckpt / STATE_FILE).read_text())
    doc["files"] = file_digests(ckpt)
    (ckpt / STATE_FILE).write_text(json.dumps(doc))


def _damage(kind: str, path: Path) -> None:
    shard = path / "actor" / "__0_0.distcp"
    if kind == "truncated state":
        (path / STATE_FILE).write_text((path / STATE_FILE).read_text()[:20])
    elif kind == "empty state":
        (path / STATE_FILE).write_text("")
    elif kind == "invalid config":
        (path / "config.yaml").write_text("model: [unclosed\n")
    elif kind == "missing shard":
        shard.unlink()
    elif kind == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif kind == "truncated metadata":
        meta = path / "actor" / ".metadata"
        meta.write_bytes(meta.read_bytes()[:50])
    # Crafted or damaged in ways a size check cannot see (issue 24's audit).
    elif kind == "garbled shard":  # the right length, other bytes
        data = bytearray(shard.read_bytes())
        data[-8:] = bytes(8)
        shard.write_bytes(bytes(data))
    elif kind == "linked shard":
        outside = path.parent.parent.parent / "outside.bin"
        outside.write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(outside)
    elif kind in ("deep state", "overflow step", "stream types", "kl types"):
        doc = json.loads((path / STATE_FILE).read_text())
        if kind == "overflow step":
            text = json.dumps(doc).replace(f'"step": {doc["step"]}', '"step": 1e400')
        else:
            doc.update(
                {
                    "deep state": {"in_flight": "[" * 100000 + "]" * 100000},
                    "stream types": {"stream": {"epoch": "0", "position": [1]}},
                    "kl types": {"kl_ctrl": {"value": "0.1"}},
                }[kind]
            )
            text = json.dumps(doc).replace('"[[[[', "[[[[").replace(']]]]"', "]]]]")
        (path / STATE_FILE).write_text(text)
    else:  # edits whose checkpoint lists the new digests, as a crafter would: the decode must refuse them
        if kind == "deep rank json":
            (path / "actor" / "rank0.json").write_text("[" * 100000 + "]" * 100000)
        elif kind == "rank types":
            doc = json.loads((path / "actor" / "rank0.json").read_text())
            doc["rng"]["numpy"] = ["MT19937", "not a key", 0, 0, 0.0]
            (path / "actor" / "rank0.json").write_text(json.dumps(doc))
        elif kind == "alias bomb config":  # "billion laughs": 9 levels of 9 aliases
            lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
                f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)
            ]
            (path / "config.yaml").write_text("\n".join(lines) + "\nmodel: {path: *a9}\n")
        elif kind == "dtype type":
            (path / "config.yaml").write_text("model: {path: tiny, dtype: [float32]}\n")
        elif kind == "target_modules type":
            (path / "config.yaml").write_text("model: {path: tiny}\nactor: {lora: {rank: 8, target_modules: 5}}\n")
        _recraft(path)


_DAMAGE = [
    "truncated state",
    "empty state",
    "invalid config",
    "missing shard",
    "truncated shard",
    "truncated metadata",
    "garbled shard",
    "linked shard",
    "deep state",
    "overflow step",
    "stream types",
    "kl types",
    "deep rank json",
    "rank types",
    "alias bomb config",
    "dtype type",
    "target_modules type",
]


# The quick tier: one case of each way in (state, shard, link, crafted config); the whole suite: all.
@pytest.mark.parametrize(
    "kind",
    quick_cases(_DAMAGE, ["truncated state", "missing shard", "garbled shard", "linked shard", "alias bomb config"]),
)
def test_damaged_latest_is_named_and_auto_falls_back(tmp_path, kind):
    out, logs = tmp_path / "run", []
    run = _ended_run(_cfg(out), logs.append)
    ck = Checkpoints(out, 0, run.run_id)
    for s in (1, 2):
        _commit(ck, s, to_yaml(_cfg(out)))
    latest = out / "checkpoints" / "step_000002"
    _damage(kind, latest)
    t0 = time.time()
    with pytest.raises(CheckpointError, match=f"checkpoint of step 2 at {latest} is damaged") as e:
        open_checkpoint(latest)
    assert time.time() - t0 < 10 and len(str(e.value)) < 1500  # no hang, no expanded structure in the message
    if kind == "linked shard":
        assert "is a symbolic link" in str(e.value)
        (latest / "actor" / "__0_0.distcp").unlink()  # the run folder itself is refused while it holds the link
    with pytest.raises(CheckpointError, match="step 2"):
        _ended_run(_cfg(out, "trainer.resume_step=2"), logs.append)
    resumed = _ended_run(_cfg(out), logs.append)
    assert resumed.resume.state.step == 1
    assert any("step 2" in line and "damaged" in line for line in logs)
    assert any("resuming from the previous complete checkpoint instead: step 1" in line for line in logs)
    # The damaged one is kept under another name, and no later resume picks it.
    assert (out / "checkpoints" / "step_000002.damaged").is_dir()
    assert [s for s, _ in complete_checkpoints(ck.root)] == [1]


def test_resume_step_continues_from_that_step_and_sets_later_ones_aside(tmp_path):
    out, log = tmp_path / "run", (lambda _: None)
    run = _ended_run(_cfg(out), log)
    ck = Checkpoints(out, 0, run.run_id)
    for s in (1, 2, 3):
        _commit(ck, s, to_yaml(_cfg(out)))
    with pytest.raises(ConfigError, match=r"no checkpoint of step 4.*steps \[1, 2, 3\]"):
        _ended_run(_cfg(out, "trainer.resume_step=4"), log)
    resumed = _ended_run(_cfg(out, "trainer.resume_step=2"), log)
    assert resumed.run_id == run.run_id and resumed.resume.state.step == 2
    assert [s for s, _ in complete_checkpoints(ck.root)] == [1, 2]
    assert (ck.root / "step_000003.superseded").is_dir()
    with pytest.raises(ConfigError, match="trainer.resume_step=2 needs trainer.resume=auto"):
        _ended_run(_cfg(out, "trainer.resume=off", "trainer.resume_step=2"), log)
    # A checkpoint path of another folder starts a new run from it in an empty folder.
    fork = _ended_run(_cfg(tmp_path / "fork", f"trainer.resume={ck.root / 'step_000001'}"), log)
    assert fork.run_id != run.run_id and fork.resume.state.step == 1


# ------------------------------------------------------------------ commits
def test_recommit_leaves_a_complete_copy_at_every_moment(tmp_path):
    ck = Checkpoints(tmp_path, 0, "r")
    path = _commit(ck, 3)
    # A crash after the old copy was renamed aside and before the new one was renamed in: the
    # aside copy still counts as step 3, and the next save puts it back.
    os.rename(path, path.with_name("step_000003.replaced"))
    assert [(s, p.name) for s, p in complete_checkpoints(ck.root)] == [(3, "step_000003.replaced")]
    assert open_checkpoint(ck.root / "step_000003.replaced").state.step == 3
    ck.staging(4)
    assert [(s, p.name) for s, p in complete_checkpoints(ck.root)] == [(3, "step_000003")]
    _commit(ck, 3)  # re-saving a step: no .replaced or .partial left behind
    assert sorted(p.name for p in ck.root.iterdir()) == ["step_000003"]


def test_a_full_disk_is_a_message_with_the_path_and_free_space(tmp_path, monkeypatch):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    role = tmp_path / "actor"
    role.mkdir()
    (role / "__0_0.distcp").symlink_to("/dev/full")  # writes there fail with ENOSPC, as on a full disk
    with pytest.raises(
        CheckpointError,
        match=rf"writing {role} failed \(OSError: \[Errno 28\] No space left on device\); "
        r"[\d.]+ [GM]iB free.*trainer.keep_checkpoints",
    ):
        save_role(role, 0, torch.nn.Linear(2, 2))
    ck = Checkpoints(tmp_path / "run", 0, "r")
    _commit(ck, 1)
    staging = ck.staging(2)
    _role(staging / "actor")
    (staging / "config.yaml").symlink_to(tmp_path / "outside")  # never written through
    with pytest.raises(CheckpointError, match=r"step_000002.partial failed .*Too many levels of symbolic links"):
        ck.commit(staging, TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0), "a: 1\n")
    assert not (tmp_path / "outside").exists()
    staging = ck.staging(2)
    _role(staging / "actor")

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("offstep.pipeline.checkpoints.write_durably", full)
    with pytest.raises(CheckpointError, match=r"step_000002.partial failed .*No space left"):
        ck.commit(staging, TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0), "a: 1\n")
    assert not staging.exists() and [s for s, _ in complete_checkpoints(ck.root)] == [1]
