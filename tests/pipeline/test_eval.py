"""Validation/eval metrics (hand-worked) and `offstep eval` on the tiny model."""

from __future__ import annotations

import json

import pytest

from offstep.batch import Sample
from offstep.cli import main
from offstep.data.tasks import write_task
from offstep.pipeline.evaluation import run_eval, summarise


def _s(uid, src, score, **extra):
    return Sample(
        uid=uid,
        prompt_ids=[1],
        response_ids=[2],
        rollout_logprobs=[0.0],
        finish_reason="stop",
        score=score,
        version=0,
        data_source=src,
        reward_extra=extra,
    )


def test_summarise_hand_worked():
    # Source a: prompt 0 scores (1, 0), prompt 1 scores (0, 0) -> mean@2 = 1/4, best@2 = (1 + 0)/2.
    # Source b: one prompt, score 0.5 with the scorer's own acc=1 -> acc 1.0, reward 0.5.
    samples = [_s(0, "a", 1.0), _s(0, "a", 0.0), _s(1, "a", 0.0), _s(1, "a", 0.0), _s(2, "b", 0.5, acc=1.0)]
    m = summarise(samples, prefix="val/")
    assert m["val/a/acc"] == 0.25 and m["val/a/acc/best@2"] == 0.5
    assert m["val/b/acc"] == 1.0 and m["val/b/reward/mean"] == 0.5
    assert "val/b/acc/best@1" not in m
    # Overall: correct = 1 + 0 + 0 + 0 + 1 = 2 of 5; reward (1 + 0.5) / 5.
    assert m["val/acc"] == pytest.approx(0.4) and m["val/reward/mean"] == pytest.approx(0.3)
    # The standard error, over prompts: their mean accuracies 0.5, 0, 1 (mean 0.5); squared deviations
    # 0 + 0.25 + 0.25 = 0.5, over n - 1 = 2: 0.25, root 0.5; over sqrt(3): 0.2887.
    assert m["val/acc_stderr"] == pytest.approx(0.5 / 3**0.5)
    # four prompts of one sample, correct 1, 1, 0, 1: squares 3 x 0.0625 + 0.5625 = 0.75, / 3 = 0.25,
    # root 0.5, / sqrt(4) = 0.25; one prompt alone: 0
    four = summarise([_s(i, "a", v) for i, v in enumerate([1.0, 1.0, 0.0, 1.0])], prefix="val/")
    assert four["val/acc_stderr"] == pytest.approx(0.25)
    assert summarise([_s(0, "a", 1.0)], prefix="val/")["val/acc_stderr"] == 0.0


def test_eval_tiny_model(tmp_path):
    _, val = write_task("arithmetic", str(tmp_path), 8, 6, 0)
    metrics, samples = run_eval("tiny", val, n=2, temperature=1.0, max_new_tokens=8, batch_size=4, threads=1)
    assert len(samples) == 12 and {s.uid for s in samples} == set(range(6))
    assert metrics["acc"] == pytest.approx(sum(float(s.score >= 1.0) for s in samples) / 12)
    assert "arithmetic/acc/best@2" in metrics


def test_eval_cli_writes_results_and_rejects_missing_data(tmp_path, capsys):
    _, val = write_task("arithmetic", str(tmp_path), 4, 3, 0)
    out = tmp_path / "res.json"
    assert main(["eval", "tiny", "--data", val, "--max-new-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["metrics"]) >= {"acc", "reward/mean", "arithmetic/acc"} and len(res["samples"]) == 3
    assert main(["eval", "tiny", "--data", str(tmp_path / "missing.parquet")]) == 2
    assert "missing.parquet" in capsys.readouterr().err


@pytest.mark.heavy  # generates with tiny_vl
def test_eval_image_rows(tmp_path, capsys):
    """`offstep eval` of the shapes task (image rows) with the tiny vision-language model; the same
    rows with a text model are refused, naming the row."""
    _, val = write_task("shapes", str(tmp_path), 4, 3, 0)
    metrics, samples = run_eval("tiny_vl", val, n=2, temperature=1.0, max_new_tokens=4, batch_size=4, threads=1)
    assert len(samples) == 6 and "shapes/acc" in metrics
    assert all(s.response_ids for s in samples)
    assert main(["eval", "tiny", "--data", val, "--max-new-tokens", "2", "--out", str(tmp_path / "o.json")]) == 2
    assert "row 0 has images, but model.path is a text model" in capsys.readouterr().err
