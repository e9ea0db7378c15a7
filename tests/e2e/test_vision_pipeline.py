"""End-to-end runs of ``preset=tiny_vl`` (a tiny random Qwen2-VL on the shapes task) through Ray:
2 steps at staleness 0 and at k = 1, with images reaching the engine and the trainer. At step 1 the
trainer's log-probs equal the engine's (the same weights, the same images): ``actor/mismatch_kl_k1``
is about 0. A run whose trainer dropped the images would show a mismatch far above the bound."""

from __future__ import annotations

import math

import pytest

from offstep.cli import main
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.pipeline.evaluation import run_eval
from offstep.telemetry.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("k", [0, 1])
def test_tiny_vl_trains_two_steps(tmp_path, ray_session, k):
    cfg = load_config(
        [
            "preset=tiny_vl",
            f"pipeline.max_staleness={k}",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            f"trainer.save_freq={2 if k == 0 else 0}",
        ]
    )
    assert cfg.preset == "tiny_vl" and cfg.model.path == "tiny_vl" and cfg.data.task == "shapes"
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["rollout/staleness_max"] for m in metrics] == [0, k]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 for m in metrics), metrics
    assert all(m["response_length/mean"] > 0 for m in metrics), metrics
    assert abs(metrics[0]["actor/mismatch_kl_k1"]) < 1e-4, metrics[0]
    if k == 0:  # the exported model keeps its image processor, and evaluates on image rows
        out = tmp_path / "exported"
        assert main(["export", str(tmp_path), "--out", str(out)]) == 0
        assert (out / "preprocessor_config.json").is_file()
        metrics, samples = run_eval(str(out), str(tmp_path / "data" / "val.parquet"), n=1, max_new_tokens=4)
        assert len(samples) == cfg.data.task_val_size and "shapes/acc" in metrics


def test_tiny_vl_fsdp_two_ranks(tmp_path, ray_session):
    """FSDP2 over 2 trainer ranks: the language model's decoder layers sharded, the vision tower in
    the root unit; each rank's micro-batches take their own rows' images."""
    cfg = load_config(
        [
            "preset=tiny_vl",
            "pipeline.max_staleness=0",
            "pipeline.colocate=true",
            "resources.trainer_workers=2",
            "actor.micro_batch_size=1",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
        ]
    )
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics), metrics
    assert abs(metrics[0]["actor/mismatch_kl_k1"]) < 1e-4, metrics[0]


def test_tiny_vl_fsdp_two_ranks_text_and_image_rows(tmp_path, ray_session):
    """Text rows beside image rows, one row a micro-batch on 2 ranks: a rank's micro-batch without an
    image skips the vision tower, which must not leave the other rank waiting on a collective (the
    tower is in the root FSDP unit)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from offstep.data.tasks import write_task

    train_file, val_file = write_task("shapes", str(tmp_path / "data"), 16, 4, 0)
    rows = pq.read_table(train_file).to_pylist()
    for row in rows[::2]:  # every other row: the same question, no picture
        row["prompt"] = [{"role": "user", "content": "How many shapes are in 1 + 1? Answer with a number."}]
        row["images"] = []
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(train_file)), str(tmp_path / "mixed.parquet"))
    cfg = load_config(
        [
            "preset=tiny_vl",
            f"data.train_files=[{tmp_path / 'mixed.parquet'}]",
            f"data.val_files=[{val_file}]",
            "data.shuffle=false",
            "pipeline.max_staleness=0",
            "pipeline.colocate=true",
            "resources.trainer_workers=2",
            "actor.micro_batch_size=1",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
        ]
    )
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if m["step"] >= 1]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert abs(metrics[0]["actor/mismatch_kl_k1"]) < 1e-4, metrics[0]
