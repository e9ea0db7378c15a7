"""Exports of a run's checkpoint, without Ray: atomic, never into a folder that is not an export,
never trusting a received run's config or files, and never destroying a checkpoint or a run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from offstep.config.schema import to_yaml
from offstep.launch.loader import load_config
from offstep.pipeline.checkpoints import Checkpoints
from offstep.pipeline.trainer_state import TrainerState
from offstep.train.checkpoint import save_role
from tests.saved_roles import ended_run, recraft


@pytest.fixture(autouse=True)
def _single_process_dcp():
    with warnings.catch_warnings():  # DCP: "no process group, assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run folder with one checkpoint of the tiny model's actor, as training writes it."""
    from offstep.models.loading import load_causal_lm, resolve_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = tmp_path_factory.mktemp("tiny") / "run"
        cfg = load_config(["preset=tiny", f"trainer.output_dir={out}"])
        ck = Checkpoints(out, 0, ended_run(cfg, lambda _: None).run_id)
        model = load_causal_lm(resolve_model("tiny"))
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a "trained" policy, unlike the base model
        staging = ck.staging(1)
        save_role(staging / "actor", 0, model)
        ck.commit(staging, TrainerState(1, 1, 0.0, {"epoch": 0, "position": 1}, [], 0), to_yaml(cfg))
    return out, model


def test_export_is_atomic_refuses_a_full_out_and_forces(tiny_run, tmp_path):
    from offstep.cli import main

    run, model = tiny_run
    dest = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(dest)]) == 0
    assert (dest / ".offstep-export").is_file() and (dest / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(dest).state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    (dest / "mine.txt").write_text("keep")
    assert main(["export", str(run), "--out", str(dest)]) == 2  # non-empty: refused
    assert (dest / "mine.txt").is_file()
    assert main(["export", str(run), "--out", str(dest), "--force"]) == 0
    assert not (dest / "mine.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_trusts_the_saved_model_path_only_as_an_alias_or_folder(tiny_run, tmp_path, capsys):
    import shutil

    from offstep.cli import main

    run, _ = tiny_run
    copy = tmp_path / "received"
    shutil.copytree(run, copy)
    cfg_file = copy / "checkpoints" / "step_000001" / "config.yaml"
    cfg_file.write_text(cfg_file.read_text().replace("path: tiny", "path: ${oc.env:HOME}/model"))
    assert main(["export", str(copy), "--out", str(tmp_path / "hf")]) == 2
    assert "config.yaml is not the file that was written" in capsys.readouterr().err  # edited after the write
    recraft(cfg_file.parent)
    assert main(["export", str(copy), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "${oc.env:HOME}/model" in err and "neither a built-in alias" in err and "--model" in err
    assert main(["export", str(copy), "--out", str(tmp_path / "hf"), "--model", "tiny"]) == 0


def test_eval_exports_a_run_once_into_the_cache_and_never_trusts_a_shipped_hf(tiny_run, tmp_path, monkeypatch):
    import shutil

    from offstep.pipeline.export import model_for_eval

    monkeypatch.setenv("OFFSTEP_CACHE", str(tmp_path / "cache"))
    run, model = tiny_run
    copy = tmp_path / "received"
    shutil.copytree(run, copy)
    shipped = copy / "checkpoints" / "step_000001" / "hf"  # a marked "export" of other weights
    shipped.mkdir()
    (shipped / "config.json").write_text("{}")
    (shipped / ".offstep-export").write_text("{}")
    before = sorted(str(p.relative_to(copy)) for p in copy.rglob("*"))
    got = Path(model_for_eval(copy))
    assert got.parent == tmp_path / "cache" / "exports" and (got / "model.safetensors").is_file()
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == before  # nothing written into the run
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(got).state_dict()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # the checkpoint's weights
    stamp = (got / ".offstep-export").stat().st_mtime_ns
    assert model_for_eval(run) == str(got)  # the same files: the same export, made once
    assert (got / ".offstep-export").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "where", ["the checkpoint", "inside the checkpoint", "the run", "its checkpoints folder", "another run"]
)
def test_export_never_destroys_a_checkpoint_or_a_run_even_with_force(tiny_run, tmp_path, where, capsys):
    import hashlib
    import shutil

    from offstep.cli import main

    run, _ = tiny_run
    copy, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(run, copy)
    shutil.copytree(run, other)
    ckpt = copy / "checkpoints" / "step_000001"
    dest = {
        "the checkpoint": ckpt,
        "inside the checkpoint": ckpt / "actor",
        "the run": copy,
        "its checkpoints folder": copy / "checkpoints",
        "another run": other,
    }[where]

    def hashes():
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = hashes()
    assert main(["export", str(copy), "--out", str(dest), "--force"]) == 2
    err = capsys.readouterr().err
    assert (
        "is, holds or lies inside the checkpoint being exported" in err
        if where != "another run"
        else "holds an offstep run or checkpoint" in err
        and "export never replaces one, at any depth, even with --force" in err
    )
    assert hashes() == before
