"""A run folder is the run's alone: nothing is written or read through a link out of it, one run
holds it at a time, and a finished run keeps its policy (issue 24's findings, written as the
attacks). Each attack checks that nothing outside the run folder changed."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import quick_cases

os.environ.setdefault("OFFSTEP_CACHE", str(Path(__file__).resolve().parents[2] / ".cache" / "offstep"))

from offstep.config.schema import to_yaml  # noqa: E402
from offstep.files import LinkRefused, loads_json, loads_yaml, write_file  # noqa: E402
from offstep.launch.loader import ConfigError, load_config  # noqa: E402
from offstep.pipeline.checkpoints import Checkpoints, TrainerState, load_failed  # noqa: E402
from offstep.pipeline.run_dir import LOCK, open_run  # noqa: E402
from offstep.train.checkpoint import save_role  # noqa: E402


def _cfg(out: Path, *extra: str):
    return load_config(["preset=tiny", f"trainer.output_dir={out}", *extra])


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _commit(ck: Checkpoints, step: int, cfg) -> Path:
    import torch

    staging = ck.staging(step)
    save_role(staging / "actor", 0, torch.nn.Linear(2, 2))
    return ck.commit(staging, TrainerState(step, step, 0.0, {"epoch": 0, "position": step}, [], 0), to_yaml(cfg))


@pytest.fixture
def run_and_outside(tmp_path):
    """A run folder with two checkpoints and records, and another project's folder beside it."""
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "train.parquet").write_bytes(b"their data")
    (outside / "notes.txt").write_text("their file")
    run = open_run(_cfg(out), lambda _: None)
    ck = Checkpoints(out, 0, run.run_id)
    for s in (1, 2):
        _commit(ck, s, _cfg(out))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "config.yaml").write_text(to_yaml(_cfg(out)))
    (out / "data").mkdir()
    run.lock.release()
    return out, outside


@pytest.mark.parametrize(
    "name",
    quick_cases(  # the quick tier: a file, a folder, a checkpoint shard, the lock
        [
            "config.yaml",
            "data",
            ".offstep-run.tmp",
            "metrics.jsonl",
            "timeline.jsonl",
            "checkpoints/step_000002/actor/__0_0.distcp",
            "data/train.parquet.tmp",
            LOCK,
            "tmp",
        ],
        ["config.yaml", "data", "checkpoints/step_000002/actor/__0_0.distcp", LOCK],
    ),
)
def test_a_link_among_the_run_files_is_refused_by_name_and_nothing_outside_changes(run_and_outside, name):
    out, outside = run_and_outside
    target = outside if name == "data" else outside / "notes.txt"
    link = out / name
    if link.exists():
        link.rename(link.with_name(link.name + ".orig")) if link.is_file() else os.rename(link, str(link) + ".orig")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    before, run_before = _hashes(outside), _hashes(out)
    with pytest.raises(LinkRefused, match=f"{link} is a symbolic link .*give another trainer.output_dir"):
        open_run(_cfg(out), lambda _: None)
    assert _hashes(outside) == before and _hashes(out) == run_before  # nothing written anywhere


def test_train_refuses_a_linked_config_before_ray_with_exit_2(run_and_outside, capsys):
    from offstep.cli import main

    out, outside = run_and_outside
    (out / "config.yaml").unlink()
    (out / "config.yaml").symlink_to(outside / "notes.txt")
    before = _hashes(outside)
    assert main(["train", "preset=tiny", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'config.yaml'} is a symbolic link" in err and "starting Ray" not in err
    assert _hashes(outside) == before


def test_writes_replace_a_link_instead_of_following_it(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    (tmp_path / "config.yaml").symlink_to(outside)
    write_file(tmp_path / "config.yaml", "ours\n")
    assert outside.read_text() == "theirs" and not (tmp_path / "config.yaml").is_symlink()
    assert (tmp_path / "config.yaml").read_text() == "ours\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "outside.txt"]  # no temporary left


def test_a_killed_runs_scratch_is_no_record_and_is_emptied_at_the_next_start(tmp_path):
    """Workers write scratch files into the run's ``tmp/`` (vLLM's LoRA adapters), never outside the
    folder; a run killed before its first record leaves them there. The next start neither counts
    them as records (the folder is still this run's, used again) nor keeps them."""
    out = tmp_path / "run"
    first = open_run(_cfg(out), lambda _: None)
    adapter = out / "tmp" / "vllm-lora-x" / "adapter-3" / "adapter_model.safetensors"
    adapter.parent.mkdir(parents=True)
    adapter.write_bytes(b"weights")
    first.lock.release()  # killed: no metrics, no checkpoint
    again = open_run(_cfg(out), lambda _: None)
    assert again.run_id == first.run_id and again.resume is None
    assert not (out / "tmp").exists()
    again.lock.release()


def test_one_run_per_folder_the_second_start_names_the_first(tmp_path):
    out = tmp_path / "run"
    first = open_run(_cfg(out), lambda _: None)
    with pytest.raises(
        ConfigError,
        match=rf"is in use by another offstep run \(pid {os.getpid()} on .*\); one run per "
        r"folder",
    ):
        open_run(_cfg(out), lambda _: None)
    first.lock.release()
    open_run(_cfg(out), lambda _: None).lock.release()  # free again once the first has ended


def test_a_foreign_folder_is_refused_without_a_lock_file_written_into_it(tmp_path):
    other = tmp_path / "project"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not an offstep run folder"):
        open_run(_cfg(other), lambda _: None)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_a_load_that_fails_in_the_worker_names_the_step_to_resume_from(run_and_outside):
    out, _ = run_and_outside
    err = load_failed(out / "checkpoints" / "step_000002", ValueError("not enough values to unpack"))
    assert "could not be loaded (not enough values to unpack)" in str(err)
    assert "trainer.resume_step=1" in str(err)
    err = load_failed(out / "checkpoints" / "step_000001", ValueError("x"))
    assert "no earlier intact checkpoint" in str(err)


def test_received_json_and_yaml_decode_to_messages_not_tracebacks():
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_json("[" * 100000 + "]" * 100000)
    t0 = time.time()
    bomb = (
        "a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b]\n"
    )
    with pytest.raises(ValueError, match="YAML anchors"):
        loads_yaml(bomb)
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_yaml("a: " + "[" * 100000 + "]" * 100000)
    assert time.time() - t0 < 5  # about 1 s alone; a bomb would not finish at all
    assert loads_yaml("model: {path: tiny}\n") == {"model": {"path": "tiny"}}


def test_report_of_damaged_metrics_is_a_message(tmp_path, capsys):
    from offstep.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n' + "[" * 100000 + "]" * 100000 + "\n")
    assert main(["report", str(run)]) == 2
    assert "line 2 cannot be read (the JSON is nested too deeply)" in capsys.readouterr().err


def test_report_never_writes_through_a_linked_report_folder(tmp_path, capsys):
    from offstep.cli import main

    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "summary.md").write_text("theirs")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5, "timing_s/step": 1.0}\n')
    (run / "report").symlink_to(outside)
    assert main(["report", str(run)]) == 2
    assert f"{run / 'report'} is a symbolic link" in capsys.readouterr().err
    assert (
        sorted(p.name for p in outside.iterdir()) == ["summary.md"] and (outside / "summary.md").read_text() == "theirs"
    )


def test_eval_of_a_run_without_a_checkpoint_names_the_key(tmp_path, capsys):
    from offstep.cli import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".offstep-run").write_text('{"run_id": "x"}')
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    assert main(["eval", str(run), "--data", str(tmp_path / "d.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint" in err and "trainer.save_last=true" in err


def _train(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offstep.cli",
            "train",
            "preset=tiny",
            "trainer.total_steps=2",
            f"trainer.output_dir={out}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.ray
def test_two_runs_started_together_into_one_folder_one_runs_and_keeps_its_policy(tmp_path):
    """Both started at the same moment: one trains to the end and keeps its last step's policy
    (trainer.save_last, the default), the other is refused at once naming the first."""
    out = tmp_path / "run"
    procs = [_train(out), _train(out)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    refused = next(r for r in results if r[0] == 2)
    winner = next(p for p, r in zip(procs, results) if r[0] == 0)
    assert f"is in use by another offstep run (pid {winner.pid} on" in refused[2]
    from offstep.telemetry.metrics import read_jsonl

    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m] == [1, 2]
    assert (out / "checkpoints" / "step_000002" / "trainer_state.json").is_file()  # the trained policy is kept
    from offstep.pipeline.export import model_for_eval

    assert (Path(model_for_eval(out)) / "model.safetensors").is_file()


class _Payload:
    """Unpickling this creates ``marker``: what a hostile pickle would do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_eval_of_a_model_folder_with_a_pickled_bin_is_refused_unread(tmp_path, capsys):
    import shutil

    import torch

    from offstep.cli import main
    from offstep.models.loading import resolve_model

    folder, marker = tmp_path / "model", tmp_path / "pwned"
    shutil.copytree(resolve_model("tiny"), folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1?", "answer": "2", "data_source": "arithmetic"}\n')
    assert (
        main(
            [
                "eval",
                str(folder),
                "--data",
                str(tmp_path / "d.jsonl"),
                "--answer-key",
                "answer",
                "--out",
                str(tmp_path / "r.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "holds a pickled object that is not plain tensors: refused" in err and "weights_only=False" not in err
    assert not marker.exists()
