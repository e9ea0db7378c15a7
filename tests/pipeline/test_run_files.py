"""A run's and a checkpoint's files as an attacker or a careless user leaves them, without Ray:
folders holding runs one level down, hard links to files outside, FIFOs and devices where a file
belongs, sparse files of many GB, trees nested thousands deep, a file where a folder belongs, escape
codes in what is printed. Each ends in a clear error or is made harmless, never a lost file, a hang
or a traceback; files outside are hashed before and after."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from pathlib import Path

import pytest
from test_export_safety import tiny_run  # noqa: F401  (a fixture: a run with one checkpoint of the tiny model)
from test_folder_safety import _cfg

from offstep.errors import CheckpointError, ConfigError, NotAFile
from offstep.files import open_record, printable, read_text, remove_tree, walk
from offstep.pipeline.checkpoints import STATE_FILE, open_checkpoint
from offstep.pipeline.run_dir import LOCK, MARKER, open_run
from tests.saved_roles import ended_run, recraft

QUIET = lambda _: None  # noqa: E731


@pytest.fixture(autouse=True)
def _single_process_dcp(tmp_path):
    with warnings.catch_warnings():  # DCP: "no process group, assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        yield
    remove_tree(tmp_path)  # pytest's own clean-up (shutil.rmtree) recurses, and these trees are too deep for it


def _digest_tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _bounded(call, seconds: float = 20.0):
    """``call()``'s result or exception; a failure if it does not return within ``seconds`` (a hang)."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for over {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _deep(root: Path, n: int = 1200) -> Path:
    """``root/d/d/...`` ``n`` deep, past Python's recursion limit (``os.makedirs`` recurses)."""
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(n):
        root = root / "d"
        root.mkdir()
    return root


def _export(run: Path, out: Path, *extra: str) -> tuple[int, str]:
    import contextlib
    import io

    from offstep.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = _bounded(lambda: main(["export", str(run), "--out", str(out), *extra]), 120)
    return code, err.getvalue()


# ------------------------------------------------------------------ 1. export --force over runs one level down
def test_export_force_never_replaces_a_folder_holding_runs_at_any_depth(tiny_run, tmp_path):  # noqa: F811
    run, _ = tiny_run
    box = tmp_path / "box"
    for inner in ("run_a/checkpoints/step_000001", "deeper/x/y/run_b"):
        (box / inner).mkdir(parents=True)
    (box / "run_a" / "checkpoints" / "step_000001" / STATE_FILE).write_text("{}")
    (box / "deeper" / "x" / "y" / "run_b" / MARKER).write_text('{"run_id": "b"}')
    (box / "notes.txt").write_text("mine")
    before = _digest_tree(box)
    for nested in ("run_a/checkpoints", "deeper/x/y/run_b"):
        code, err = _export(run, box, "--force")
        assert code == 2 and "holds an offstep run or checkpoint" in err and "at any depth" in err, err
        assert _digest_tree(box) == before
        if nested == "run_a/checkpoints":  # the second marker alone is refused too
            import shutil

            shutil.rmtree(box / "run_a")
            before = _digest_tree(box)
    # A folder with only a model export in it is replaced, as before.
    import shutil

    shutil.rmtree(box / "deeper")
    assert _export(run, box, "--force")[0] == 0 and not (box / "notes.txt").exists()


def test_export_replaces_a_deep_out_and_refuses_one_too_large_to_be_a_model_folder(tiny_run, tmp_path):  # noqa: F811
    run, _ = tiny_run
    box = tmp_path / "box"
    _deep(box)  # no run in it: --force replaces it, deleted at any depth
    code, err = _export(run, box, "--force")
    assert code == 0 and (box / ".offstep-export").is_file() and not (box / "d").exists(), err
    big = tmp_path / "big"
    big.mkdir()
    for i in range(10_001):
        (big / str(i)).touch()
    code, err = _export(run, big, "--force")
    assert code == 2 and "more than 10000 files" in err and len(list(big.iterdir())) == 10_001


# ------------------------------------------------------------------ 2. hard links to files outside
def test_a_hard_linked_lock_or_record_never_writes_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    notes, empty = outside / "notes", outside / "empty"
    notes.write_text("my notes\n")
    empty.write_text("")
    run = tmp_path / "run"
    ended_run(_cfg(run), QUIET)  # a fresh run folder: its marker, lock and config, no records
    (run / LOCK).unlink()
    os.link(notes, run / LOCK)
    os.link(empty, run / "metrics.jsonl")  # an empty records file: not a record, so the run starts
    before = _digest_tree(outside)
    opened = open_run(_cfg(run), QUIET)
    try:
        with open_record(run / "metrics.jsonl", append=True) as f:
            f.write('{"step": 1}\n')
        with open_record(run / "timeline.jsonl", append=False) as f:
            f.write("{}\n")
    finally:
        opened.lock.release()
    assert _digest_tree(outside) == before
    assert os.stat(run / LOCK).st_nlink == 1 and os.stat(run / "metrics.jsonl").st_nlink == 1
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # A record with content and a second link keeps its content under its own inode.
    os.link(run / "metrics.jsonl", outside / "copy")
    with open_record(run / "metrics.jsonl", append=True) as f:
        f.write('{"step": 2}\n')
    assert (outside / "copy").read_text() == '{"step": 1}\n'
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


# ------------------------------------------------------------------ 5. FIFOs where a file belongs
@pytest.mark.parametrize("name", [MARKER, "metrics.jsonl", "config.yaml", LOCK])
def test_a_fifo_among_the_run_files_is_refused_not_waited_on(tmp_path, name):
    run = tmp_path / "run"
    ended_run(_cfg(run), QUIET)
    (run / name).unlink(missing_ok=True)
    os.mkfifo(run / name)
    with pytest.raises(ConfigError, match=f"{name} is a FIFO"):
        _bounded(lambda: open_run(_cfg(run), QUIET))
    with pytest.raises(NotAFile, match="is a FIFO"):
        _bounded(lambda: read_text(run / name))
    with pytest.raises(NotAFile, match="is a FIFO"):
        _bounded(lambda: open_record(run / name, append=True))


def test_a_fifo_or_device_in_a_checkpoint_is_refused_by_resume_and_export(tiny_run, tmp_path):  # noqa: F811
    import shutil

    run, _ = tiny_run
    for where in ("config.yaml", "extra", "actor/extra"):
        copy = tmp_path / f"copy-{where.replace('/', '-')}"
        shutil.copytree(run, copy)
        ckpt = copy / "checkpoints" / "step_000001"
        (ckpt / where).unlink(missing_ok=True)
        os.mkfifo(ckpt / where)
        with pytest.raises(CheckpointError, match="is a FIFO"):
            _bounded(lambda: open_checkpoint(ckpt))
        code, err = _export(copy, tmp_path / f"hf-{where.replace('/', '-')}")
        assert code == 2 and "is a FIFO" in err, err
        with pytest.raises(ConfigError, match="is a FIFO"):  # a resume checks the folder before it reads
            _bounded(lambda: open_run(_cfg(copy), QUIET))


# ------------------------------------------------------------------ 6. sparse giants, deep trees, wrong kinds
@pytest.mark.parametrize("name", [STATE_FILE, "actor/rank0.json"])
def test_a_sparse_giant_state_file_is_refused_unread(tiny_run, tmp_path, name):  # noqa: F811
    import shutil

    run, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_000001"
    if name != STATE_FILE:
        recraft(ckpt)  # its digest listed, so that the read of the file itself is what refuses it
    with open(ckpt / name, "r+b") as f:
        f.truncate(32 * 2**30)  # 32 GB, all holes: costs no disk
    with pytest.raises(CheckpointError, match="larger than"):
        _bounded(lambda: open_checkpoint(ckpt))
    code, err = _export(copy, tmp_path / "hf")
    assert code == 2 and "larger than" in err and "MemoryError" not in err


def test_trees_nested_thousands_deep_are_errors_not_recursion(tiny_run, tmp_path):  # noqa: F811
    import shutil

    run, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    deep = _deep(copy / "checkpoints" / "step_000001")
    (deep / "f").write_text("x")
    open_checkpoint(copy / "checkpoints" / "step_000001")  # walked to the bottom (an extra file is never read)
    assert sum(1 for _ in walk(copy / "checkpoints")) > 1200
    fresh = tmp_path / "fresh"
    ended_run(_cfg(fresh), QUIET)
    _deep(fresh / "data")
    ended_run(_cfg(fresh), QUIET)  # walked (no link, no FIFO), the run is still this folder's
    with pytest.raises(NotAFile, match="more than 5 files"):
        list(walk(fresh, limit=5))


def test_a_file_where_a_folder_belongs_and_the_other_way_round(tmp_path):
    run = tmp_path / "run"
    ended_run(_cfg(run), QUIET)
    (run / "data").mkdir(exist_ok=True)
    os.rmdir(run / "data") if not any((run / "data").iterdir()) else None
    (run / "data").write_text("not a folder")
    with pytest.raises(ConfigError, match="data is a regular file, where a run keeps a folder"):
        open_run(_cfg(run), QUIET)
    (run / "data").unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="metrics.jsonl is a folder, where a run keeps a regular file"):
        open_run(_cfg(run), QUIET)
    with pytest.raises(NotAFile, match="is a folder"):
        open_record(run / "metrics.jsonl", append=True)


# ------------------------------------------------------------------ 9. escape codes, torch's advice, the intact step
def test_escape_codes_in_a_run_id_never_reach_the_terminal(tmp_path):
    run = tmp_path / "run"
    ended_run(_cfg(run), QUIET)
    (run / MARKER).write_text(json.dumps({"run_id": "\x1b]0;pwned\x07\x1b[2J"}))
    with pytest.raises(ConfigError) as e:
        open_run(_cfg(run), QUIET)
    assert "\x1b" not in printable(str(e.value)) and "letters, digits" in str(e.value)
    assert printable("a\x1b[31mb\tc\nd\x9b") == "a\\x1b[31mb\tc\nd\\x9b"


def test_a_garbled_shard_gets_no_advice_to_load_it_unrestricted(tiny_run, tmp_path):  # noqa: F811
    import shutil

    run, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_000001"
    shard = ckpt / "actor" / "__0_0.distcp"
    shard.write_bytes(os.urandom(64) + shard.read_bytes()[64:])  # no zip header: torch reads it as a bare pickle
    recraft(ckpt)
    code, err = _export(copy, tmp_path / "hf")
    assert code == 2 and "cannot be loaded" in err, err
    assert "weights_only" not in err and "can still be loaded" not in err


def test_export_of_a_damaged_latest_names_the_intact_step(tiny_run, tmp_path):  # noqa: F811
    import shutil

    run, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.copytree(copy / "checkpoints" / "step_000001", copy / "checkpoints" / "step_000002")
    state = json.loads((copy / "checkpoints" / "step_000002" / STATE_FILE).read_text())
    state["step"] = 2
    (copy / "checkpoints" / "step_000002" / STATE_FILE).write_text(json.dumps(state))
    (copy / "checkpoints" / "step_000002" / "config.yaml").write_text("model: [unclosed\n")
    code, err = _export(copy, tmp_path / "hf")
    assert code == 2 and "step 2" in err and "--step 1" in err, err
    assert _export(copy, tmp_path / "hf", "--step", "1")[0] == 0
