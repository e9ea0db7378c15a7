"""End-to-end runs of ``preset=tiny_vl`` (a tiny random Qwen2-VL on the shapes task) through Ray:
2 steps at k = 1, with images reaching the engine and the trainer; the fully asynchronous mode at k = 0
killed and resumed, equal to batch mode. At step 1 the
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


def _overrides(out, reward, *extra: str) -> list[str]:
    return [
        "preset=tiny_vl",
        f"trainer.output_dir={out}",
        "trainer.total_steps=4",
        "trainer.save_freq=2",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress=off",
        f"reward.custom_path={reward}",
        "reward.num_threads=1",
        *extra,
    ]


def _killed_in_step_3_and_resumed(args: list[str], killed) -> None:
    """``offstep train args`` in a process of its own, SIGKILLed once in step 3 (its scoring blocked from
    the step-2 checkpoint on: tests/blocking_reward.py), then resumed here to its end."""
    import os
    import signal
    import time

    from cli_runs import cli, wait_for
    from run_records import step_records

    gate = killed / "checkpoints" / "step_000002" / "trainer_state.json"
    proc = cli(args, env={**os.environ, "BLOCK_AFTER": str(gate)})
    wait_for(gate, proc, timeout=240)
    time.sleep(1.0)  # into step 3, whose scoring now blocks
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(step_records(killed)) < 4, "the run was meant to be killed before it finished"
    history = train(load_config(args))
    assert [m["step"] for m in history] == [3, 4]


def test_tiny_vl_sigkill_and_resume_equals_an_uninterrupted_run(tmp_path, ray_session):
    """4 steps at k = 1 in one go == 2 steps, SIGKILL in step 3, resume: the same metrics at every step
    (the resumed run rebuilds each prompt's images from the prompt index; the batch in flight at the
    checkpoint is stored with it)."""
    from run_records import step_records

    reward = tmp_path / "reward.py"
    reward.write_text(BLOCKING_REWARD)
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(load_config(_overrides(full, reward, "pipeline.max_staleness=1")))
    _killed_in_step_3_and_resumed(_overrides(killed, reward, "pipeline.max_staleness=1"), killed)
    a, b = step_records(full), step_records(killed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step] == b[step], f"step {step} differs after resume"


def test_tiny_vl_fully_async_k0_killed_and_resumed_equals_batch_mode(tmp_path, ray_session):
    """``pipeline.mode=fully_async`` with images at k = 0, SIGKILLed in step 3 and resumed, equals an
    uninterrupted batch-mode run at k = 0 at every step, on every metric the two modes share (the
    synchronous loop: the same prompts, samples, rewards, losses and gradient norms, bit for bit). The
    stream gives the engine each prompt's images, the resumed stream rebuilds them from the prompt index,
    and the trainer's log-probs equal the engine's at every step (``actor/mismatch_kl_k1`` about 0; 1.77
    when the trainer is not given the images)."""
    from run_records import step_records

    reward = tmp_path / "reward.py"
    reward.write_text(BLOCKING_REWARD)
    batch, stream = tmp_path / "batch", tmp_path / "stream"
    train(load_config(_overrides(batch, reward, "pipeline.max_staleness=0")))
    _killed_in_step_3_and_resumed(
        _overrides(stream, reward, "pipeline.max_staleness=0", "pipeline.mode=fully_async"), stream
    )
    a, b = step_records(batch), step_records(stream)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert {k: b[step].get(k) for k in a[step]} == a[step], f"step {step}: fully_async differs from batch mode"
        assert abs(b[step]["actor/mismatch_kl_k1"]) < 1e-4, b[step]
        assert b[step]["rollout/staleness_max"] == b[step]["rollout/partial_samples"] == 0
        assert b[step]["rollout/version_span_max"] == 1 and b[step]["response_length/mean"] > 0


def test_tiny_vl_lora_trains_the_language_models_adapters(tmp_path, ray_session):
    """``actor.lora.rank=8`` with images, 2 steps at k = 0: the adapters (on the language model's layers
    only, the vision tower frozen with the base) train, travel to the engine (at each step the engine's log-probs
    equal the trainer's: step 2's batch was generated with step 1's adapters), and are all the checkpoint holds of the weights."""
    from offstep.train.checkpoint import SafeReader

    cfg = load_config(
        [
            "preset=tiny_vl",
            "actor.lora.rank=8",
            "pipeline.max_staleness=0",
            "trainer.total_steps=2",
            "trainer.save_freq=2",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
        ]
    )
    train(cfg)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/grad_norm"] > 0 for m in metrics), metrics
    assert abs(metrics[0]["actor/mismatch_kl_k1"]) < 1e-4, metrics[0]
    assert abs(metrics[1]["actor/mismatch_kl_k1"]) < 1e-4, "step 2: the engine got step 1's adapters"
    keys = SafeReader(tmp_path / "checkpoints" / "step_000002" / "actor").read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k and ".language_model.layers." in k for k in weights), weights[:5]
