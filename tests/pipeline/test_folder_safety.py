"""Data safety of run folders and checkpoints, without Ray: a run never writes into a folder it
does not own; damaged checkpoints are named and passed over; commits always leave a complete copy."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import quick_cases

from offstep.config.schema import to_yaml
from offstep.launch.loader import ConfigError, load_config
from offstep.pipeline.checkpoints import (
    Checkpoints,
    complete_checkpoints,
    open_checkpoint,
    read_run_id,
)
from offstep.pipeline.run_dir import MARKER, read_marker
from offstep.pipeline.trainer_state import STATE_FILE, TrainerState
from offstep.train.checkpoint import CheckpointError, save_role
from tests.saved_roles import commit_small, ended_run, recraft, save_small_role, single_process_dcp  # noqa: F401 (an autouse fixture)


# ------------------------------------------------------------------ run folders
def _cfg(out: Path, *extra: str):
    return load_config(["preset=tiny", f"trainer.output_dir={out}", "trainer.keep_checkpoints=1", *extra])


def test_the_audit_scenario_cannot_happen(tmp_path):
    """Run A saved steps 1 and 2; run B in the same folder with resume=off, save_freq=1 and
    keep_checkpoints=1 used to replace A's step 1, prune its own, and the next resume=auto took
    A's step 2 with mixed metrics. Now B is refused, or with overwrite moves A aside."""
    out, logs = tmp_path / "run", []
    a = ended_run(_cfg(out), logs.append)
    ck_a = Checkpoints(out, 0, a.run_id)
    for s in (1, 2):
        commit_small(ck_a, s, to_yaml(_cfg(out)))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    with pytest.raises(
        ConfigError,
        match="holds run .* trainer.resume=off would write over it; give a new "
        "trainer.output_dir, or trainer.overwrite=true to move",
    ):
        ended_run(_cfg(out, "trainer.resume=off"), logs.append)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing touched

    b = ended_run(_cfg(out, "trainer.resume=off", "trainer.overwrite=true"), logs.append)
    assert b.run_id != a.run_id and b.resume is None
    (old,) = tmp_path.glob("run.old-*")
    assert [s for s, _ in complete_checkpoints(old / "checkpoints")] == [1, 2]
    assert (old / "metrics.jsonl").read_text().count("step") == 2 and read_marker(old) == a.run_id
    assert not (out / "metrics.jsonl").exists() and read_marker(out) == b.run_id
    assert any("moved the previous contents" in line for line in logs)
    ck_b = Checkpoints(out, 1, b.run_id)
    for s in (1, 2):
        commit_small(ck_b, s, to_yaml(_cfg(out)))
    assert [s for s, _ in complete_checkpoints(ck_b.root)] == [2]
    resumed = ended_run(_cfg(out), logs.append)
    assert resumed.run_id == b.run_id and resumed.resume.run_id == b.run_id and resumed.resume.state.step == 2


def test_pruning_never_deletes_another_runs_checkpoint(tmp_path):
    foreign = commit_small(Checkpoints(tmp_path, 0, "someone-else"), 1)
    ours = Checkpoints(tmp_path, 1, "us")
    for s in (2, 3):
        commit_small(ours, s)
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
            ended_run(_cfg(other, f"trainer.resume={resume}"), log)
    ended_run(_cfg(other, "trainer.overwrite=true"), log)
    assert (next(tmp_path.glob("other.old-*")) / "notes.txt").read_text() == "mine"
    # A run with metrics but no checkpoint (killed before its first, or save_freq=0): resume=auto
    # cannot continue it, so the same command moves its records aside, in one line, and starts a
    # new run; resume=off is still refused.
    run = tmp_path / "run"
    first = ended_run(_cfg(run), log)
    (run / "metrics.jsonl").write_text("")  # a start that crashed before step 1: nothing to keep
    assert ended_run(_cfg(run), log).run_id == first.run_id
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds run .*metrics.jsonl.* trainer.resume=off would write over it"):
        ended_run(_cfg(run, "trainer.resume=off"), log)
    said = []
    second = ended_run(_cfg(run), said.append)
    assert second.run_id != first.run_id and second.resume is None and not (run / "metrics.jsonl").exists()
    aside = next(tmp_path.glob("run.old-*"))
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and read_marker(aside) == first.run_id
    assert len(said) == 1 and f"run {first.run_id} has no intact checkpoint" in said[0] and str(aside) in said[0]
    # With checkpoints that are all damaged it is refused, never restarted over them.
    damaged = commit_small(Checkpoints(run, 0, second.run_id), 1)
    (damaged / STATE_FILE).write_text("{")
    with pytest.raises(ConfigError, match="holds run .*checkpoints/ \\(1\\).* but no intact checkpoint"):
        ended_run(_cfg(run), QUIET_LOG)
    # Missing and empty folders become new runs.
    (tmp_path / "empty").mkdir()
    assert ended_run(_cfg(tmp_path / "empty"), log).resume is None
    assert read_marker(tmp_path / "new" / "deep") is None
    assert ended_run(_cfg(tmp_path / "new" / "deep"), log).run_id == read_marker(tmp_path / "new" / "deep")


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
        recraft(path)


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
    run = ended_run(_cfg(out), logs.append)
    ck = Checkpoints(out, 0, run.run_id)
    for s in (1, 2):
        commit_small(ck, s, to_yaml(_cfg(out)))
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
        ended_run(_cfg(out, "trainer.resume_step=2"), logs.append)
    resumed = ended_run(_cfg(out), logs.append)
    assert resumed.resume.state.step == 1
    assert any("step 2" in line and "damaged" in line for line in logs)
    assert any("resuming from the previous complete checkpoint instead: step 1" in line for line in logs)
    # The damaged one is kept under another name, and no later resume picks it.
    assert (out / "checkpoints" / "step_000002.damaged").is_dir()
    assert [s for s, _ in complete_checkpoints(ck.root)] == [1]


def test_resume_step_continues_from_that_step_and_sets_later_ones_aside(tmp_path):
    out, log = tmp_path / "run", (lambda _: None)
    run = ended_run(_cfg(out), log)
    ck = Checkpoints(out, 0, run.run_id)
    for s in (1, 2, 3):
        commit_small(ck, s, to_yaml(_cfg(out)))
    with pytest.raises(ConfigError, match=r"no checkpoint of step 4.*steps \[1, 2, 3\]"):
        ended_run(_cfg(out, "trainer.resume_step=4"), log)
    resumed = ended_run(_cfg(out, "trainer.resume_step=2"), log)
    assert resumed.run_id == run.run_id and resumed.resume.state.step == 2
    assert [s for s, _ in complete_checkpoints(ck.root)] == [1, 2]
    assert (ck.root / "step_000003.superseded").is_dir()
    with pytest.raises(ConfigError, match="trainer.resume_step=2 needs trainer.resume=auto"):
        ended_run(_cfg(out, "trainer.resume=off", "trainer.resume_step=2"), log)
    # A checkpoint path of another folder starts a new run from it in an empty folder.
    fork = ended_run(_cfg(tmp_path / "fork", f"trainer.resume={ck.root / 'step_000001'}"), log)
    assert fork.run_id != run.run_id and fork.resume.state.step == 1


# ------------------------------------------------------------------ commits
def test_recommit_leaves_a_complete_copy_at_every_moment(tmp_path):
    ck = Checkpoints(tmp_path, 0, "r")
    path = commit_small(ck, 3)
    # A crash after the old copy was renamed aside and before the new one was renamed in: the
    # aside copy still counts as step 3, and the next save puts it back.
    os.rename(path, path.with_name("step_000003.replaced"))
    assert [(s, p.name) for s, p in complete_checkpoints(ck.root)] == [(3, "step_000003.replaced")]
    assert open_checkpoint(ck.root / "step_000003.replaced").state.step == 3
    ck.staging(4)
    assert [(s, p.name) for s, p in complete_checkpoints(ck.root)] == [(3, "step_000003")]
    commit_small(ck, 3)  # re-saving a step: no .replaced or .partial left behind
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
    commit_small(ck, 1)
    staging = ck.staging(2)
    save_small_role(staging / "actor")
    (staging / "config.yaml").symlink_to(tmp_path / "outside")  # never written through
    with pytest.raises(CheckpointError, match=r"step_000002.partial failed .*Too many levels of symbolic links"):
        ck.commit(staging, TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0), "a: 1\n")
    assert not (tmp_path / "outside").exists()
    staging = ck.staging(2)
    save_small_role(staging / "actor")

    def full(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("offstep.pipeline.checkpoints.write_durably", full)
    with pytest.raises(CheckpointError, match=r"step_000002.partial failed .*No space left"):
        ck.commit(staging, TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0), "a: 1\n")
    assert not staging.exists() and [s for s, _ in complete_checkpoints(ck.root)] == [1]
