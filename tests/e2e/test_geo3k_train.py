"""verl's geo3k layout (``tests/geo3k_rows.py``) trains 2 steps on the tiny vision-language model, named
with verl's keys; the rows are scored by verl's geo3k scorer (data_source ``hiyouga/geometry3k``)."""

from __future__ import annotations

import json
import math

import pytest
from geo3k_rows import write_geo3k

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_verl_geo3k_parquet_trains_two_steps(tmp_path, ray_session):
    train_file, val_file = (
        write_geo3k(tmp_path / "train.parquet", 8, "train"),
        write_geo3k(tmp_path / "test.parquet", 4, "test"),
    )
    notes: list[str] = []
    cfg = load_config(
        [
            "preset=tiny_vl",  # the engine and pipeline settings that take images (docs/multimodal.md)
            "algorithm.adv_estimator=grpo",  # as verl's geo3k scripts (verl's default is gae)
            "actor_rollout_ref.model.path=tiny_vl",
            f"data.train_files=[{train_file}]",
            f"data.val_files=[{val_file}]",
            "data.image_key=images",
            "data.prompt_key=prompt",
            "data.max_prompt_length=256",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=8",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.test_freq=2",
            "trainer.progress=off",
        ],
        notes=notes,
    )
    assert cfg.data.train_files == [train_file] and cfg.data.image_key == "images"
    train(cfg)
    run = tmp_path / "run"
    metrics = read_jsonl(run / "metrics.jsonl")
    steps = [m for m in metrics if m["step"] >= 1 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 for m in steps), steps
    assert abs(steps[0]["actor/mismatch_kl_k1"]) < 1e-4, steps[0]  # the trainer saw the images the engine saw
    val = {k for m in metrics for k in m if k.startswith("val/")}
    assert any("geometry3k" in k for k in val), sorted(val)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {s["data_source"] for s in samples} == {"hiyouga/geometry3k"}
