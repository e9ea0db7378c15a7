"""End-to-end runs of ``preset=tiny_vl`` (a tiny random Qwen2-VL on the shapes task) through Ray:
2 steps at k = 1, with images reaching the engine and the trainer. At step 1 the
trainer's log-probs equal the engine's (the same weights, the same images): ``actor/mismatch_kl_k1``
is about 0. A run whose trainer dropped the images would show a mismatch far above the bound."""

from __future__ import annotations

import math

import pytest
from blocking_reward import BLOCKING_REWARD

from offstep.cli import main
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.pipeline.evaluation import run_eval
from offstep.telemetry.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tiny_vl_trains_two_steps_exports_and_evaluates(tmp_path, ray_session):
    """Two steps at k = 1 (step 1 on version 0: staleness 0, step 2 one behind); the exported model keeps
    its image processor and evaluates on image rows."""
    cfg = load_config(
        [
            "preset=tiny_vl",
            "pipeline.max_staleness=1",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            "trainer.save_freq=2",
        ]
    )
    assert cfg.preset == "tiny_vl" and cfg.model.path == "tiny_vl" and cfg.data.task == "shapes"
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0 for m in metrics), metrics
    assert all(m["response_length/mean"] > 0 for m in metrics), metrics
    assert abs(metrics[0]["actor/mismatch_kl_k1"]) < 1e-4, metrics[0]
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path), "--out", str(out)]) == 0
    assert (out / "preprocessor_config.json").is_file()
    metrics, samples = run_eval(str(out), str(tmp_path / "data" / "val.parquet"), n=1, max_new_tokens=4)
    assert len(samples) == cfg.data.task_val_size and "shapes/acc" in metrics


def test_tiny_vl_fsdp_two_ranks_text_and_image_rows(tmp_path, ray_session):
    """FSDP2 over 2 trainer ranks (the decoder layers sharded, the vision tower in the root unit), text
    rows beside image rows, one row a micro-batch: a rank's micro-batch without an
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


def test_tiny_vl_sigkill_and_resume_equals_an_uninterrupted_run(tmp_path, ray_session):
    """4 steps at k = 1 in one go == 2 steps, SIGKILL in step 3, resume: the same metrics at every step
    (the resumed run rebuilds each prompt's images from the prompt index; the batch in flight at the
    checkpoint is stored with it)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from run_records import step_records

    reward = tmp_path / "reward.py"
    reward.write_text(BLOCKING_REWARD)

    def overrides(out):
        return [
            "preset=tiny_vl",
            f"trainer.output_dir={out}",
            "trainer.total_steps=4",
            "trainer.save_freq=2",
            "pipeline.max_staleness=1",
            "trainer.val_freq=0",
            "trainer.val_before_train=false",
            "trainer.progress=off",
            f"reward.custom_path={reward}",
            "reward.num_threads=1",
        ]

    full, killed = tmp_path / "full", tmp_path / "killed"
    train(load_config(overrides(full)))
    gate = killed / "checkpoints" / "step_000002" / "trainer_state.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "offstep.cli", "train", *overrides(killed)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "BLOCK_AFTER": str(gate)},
    )
    t0 = time.time()
    while not gate.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) early: {proc.stderr.read()}"
        if time.time() - t0 > 240:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{gate} did not appear")
        time.sleep(0.1)
    time.sleep(1.0)  # into step 3, whose scoring now blocks
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(step_records(killed)) < 4, "the run was meant to be killed before it finished"
    history = train(load_config(overrides(killed)))
    assert [m["step"] for m in history] == [3, 4]
    a, b = step_records(full), step_records(killed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step] == b[step], f"step {step} differs after resume"
