"""Checkpoints: atomic commits, which one a resume picks, the best kept beside the last, exact
continuation after SIGKILL (including the batch that was generating), and export to a Hugging Face folder."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from blocking_reward import BLOCKING_REWARD
from cli_runs import cli, wait_for
from conftest import needs_vllm
from run_records import step_records

from offstep.config.schema import to_yaml
from offstep.launch.loader import ConfigError, load_config
from offstep.pipeline.checkpoints import Checkpoints, TrainerState, check_compatible, complete_checkpoints, resolve_path


def _overrides(
    out: Path,
    reward: Path,
    k: int,
    steps: int = 6,
    engine: str = "builtin",
    lora: int = 0,
    agent: str = "single_turn_agent",
    mode: str = "batch",
    teacher: bool = False,
) -> list[str]:
    # a teacher scoring one sample a batch: its log-probs then never depend on which samples it was batched with
    return [
        *(["distill.teacher.path=tiny", "distill.teacher.batch_size=1", "distill.coef=0.5"] if teacher else []),
        "preset=tiny",
        f"pipeline.mode={mode}",
        f"rollout.engine={engine}",
        f"actor.lora.rank={lora}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        f"rollout.agent.default_agent={agent}",
        "trainer.save_freq=3",
        f"pipeline.max_staleness={k}",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress=off",
        f"reward.custom_path={reward}",
        "reward.num_threads=1",
    ]


# ------------------------------------------------------------------ on-disk layout, no Ray
def _fake_commit(ck: Checkpoints, step: int, cfg_yaml: str = "a: 1\n") -> Path:
    """A checkpoint as the controller commits it, with a one-layer "actor"."""
    from offstep.train.checkpoint import save_role

    staging = ck.staging(step)
    with warnings.catch_warnings():  # DCP: "no process group, assuming a single process" is the intent
        warnings.simplefilter("ignore", UserWarning)
        save_role(staging / "actor", 0, torch.nn.Linear(2, 2))
    return ck.commit(staging, TrainerState(step, step, 0.0, {"epoch": 0, "position": 0}, [], 0), cfg_yaml)


def test_commit_is_atomic_and_auto_skips_partial(tmp_path):
    ck = Checkpoints(tmp_path)
    _fake_commit(ck, 3)
    # A crash while writing step 6 leaves only the staging folder: resume=auto must not pick it.
    partial = ck.staging(6)
    (partial / "actor").mkdir()
    assert ck.resolve("auto") == tmp_path / "checkpoints" / "step_000003"
    assert [s for s, _ in complete_checkpoints(ck.root)] == [3]
    # The next save clears the stale staging folder away.
    _fake_commit(ck, 9)
    assert not partial.exists()
    assert ck.resolve("auto").name == "step_000009"
    assert ck.resolve("off") is None


def test_what_must_outlive_a_kill_is_written_before_the_checkpoint_is_published(tmp_path):
    """``before_publish`` (the controller's timeline entry of the step) runs once the checkpoint is
    complete in its .partial folder and before the rename: a kill right after the rename found the
    entry missing, and a resume from that checkpoint never writes it."""
    from offstep.train.checkpoint import save_role

    ck = Checkpoints(tmp_path)
    staging = ck.staging(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save_role(staging / "actor", 0, torch.nn.Linear(2, 2))
    seen = []
    final = ck.commit(
        staging,
        TrainerState(2, 2, 0.0, {"epoch": 0, "position": 0}, [], 0),
        "a: 1\n",
        lambda: seen.append(
            (
                staging.exists() and (staging / "trainer_state.json").is_file(),
                (tmp_path / "checkpoints" / "step_000002").exists(),
            )
        ),
    )
    assert seen == [(True, False)]
    assert final.name == "step_000002" and complete_checkpoints(ck.root) == [(2, final)]


def test_keep_checkpoints_prunes_oldest_complete(tmp_path):
    ck = Checkpoints(tmp_path, keep=2)
    for s in (2, 4, 6):
        _fake_commit(ck, s)
    assert [s for s, _ in complete_checkpoints(ck.root)] == [4, 6]


def _scores(run: Path, **by_step: float) -> None:
    """metrics.jsonl of ``run`` with val/acc at the given steps (``s4=0.5``)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": int(k[1:]), "val/acc": v}) + "\n" for k, v in by_step.items())
    )


def test_keep_best_spares_the_best_scoring_checkpoint_from_pruning(tmp_path):
    from offstep.pipeline.checkpoints import best_checkpoint

    ck = Checkpoints(tmp_path, keep=1, run_id="", best_metric="val/acc")
    for step, score in ((2, 0.5), (4, 0.9), (6, 0.7), (8, 0.6)):  # each step's record is on disk before its commit
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "val/acc": score}) + "\n")
        _fake_commit(ck, step)
    assert [s for s, _ in complete_checkpoints(ck.root)] == [4, 8]
    assert best_checkpoint(tmp_path)[::2] == (4, 0.9)
    # equal scores: the later (more trained) one; non-numbers, NaN and steps without a checkpoint are passed over
    _scores(tmp_path, s4=0.9, s8=0.9)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "val/acc": NaN}\n{"step": 3, "val/acc": 1.0}\n{"step": 4, "val/acc": true}\n')
    assert best_checkpoint(tmp_path)[0] == 8
    assert best_checkpoint(tmp_path, "val/reward/mean") is None


@pytest.mark.parametrize("damage", ["garbled", "fifo", "link"])
def test_best_checkpoint_refuses_unreadable_scores_without_blocking(tmp_path, damage):
    from offstep.pipeline.checkpoints import best_checkpoint

    _fake_commit(Checkpoints(tmp_path), 2)
    metrics = tmp_path / "metrics.jsonl"
    if damage == "garbled":
        metrics.write_text('{"step": 2, "val/acc": 1.0}\n[1, 2]\n')
    elif damage == "fifo":
        os.mkfifo(metrics)
    else:
        (tmp_path / "elsewhere.jsonl").write_text('{"step": 2, "val/acc": 1.0}\n')
        metrics.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(ConfigError, match="cannot be read.*--step"):
        best_checkpoint(tmp_path)


def test_best_step_names_the_fix(tmp_path):
    from offstep.cli import main
    from offstep.pipeline.export import best_step

    path = _fake_commit(Checkpoints(tmp_path), 2)
    with pytest.raises(ConfigError, match="save_freq a multiple of trainer.val_freq"):
        best_step(tmp_path)  # no metrics.jsonl
    with pytest.raises(ConfigError, match="give the run directory"):
        best_step(path)
    _scores(tmp_path, s2=0.25)
    assert best_step(tmp_path) == 2
    with pytest.raises(SystemExit):  # one of --step and --best
        main(["export", str(tmp_path), "--step", "2", "--best", "--out", str(tmp_path / "x")])
    assert main(["eval", str(tmp_path / "nothing"), "--best", "--data", str(tmp_path / "d.jsonl")]) == 2


@pytest.mark.parametrize("save_freq,val_freq", [(0, 5), (5, 0), (5, 2)])
def test_keep_best_needs_every_checkpoint_scored(save_freq, val_freq):
    from offstep.launch.preflight import validate

    with pytest.raises(ConfigError, match="trainer.keep_best=true .* trainer.save_freq a multiple"):
        validate(
            load_config(
                [
                    "preset=tiny",
                    "trainer.keep_best=true",
                    f"trainer.save_freq={save_freq}",
                    f"trainer.val_freq={val_freq}",
                ]
            )
        )
    with pytest.raises(ConfigError, match="best_metric='acc' must be a validation metric"):
        validate(load_config(["preset=tiny", "trainer.best_metric=acc"]))


def test_resolve_path_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint.*save_freq"):
        resolve_path(tmp_path)
    ck = Checkpoints(tmp_path)
    _fake_commit(ck, 3)
    assert resolve_path(tmp_path).name == "step_000003"
    assert resolve_path(tmp_path / "checkpoints" / "step_000003").name == "step_000003"
    with pytest.raises(ConfigError, match=r"no checkpoint of step 5; it has steps \[3\]"):
        resolve_path(tmp_path, step=5)


def test_resume_refuses_a_different_run():
    saved = to_yaml(load_config(["preset=tiny"]))
    check_compatible(saved, load_config(["preset=tiny", "trainer.total_steps=50"]))  # more steps: fine
    with pytest.raises(ConfigError, match="data.train_batch_size: checkpoint 4, now 8.*trainer.resume=off"):
        check_compatible(saved, load_config(["preset=tiny", "data.train_batch_size=8"]))


def test_resume_path_that_does_not_exist_is_a_config_error(tmp_path):
    from offstep.launch.preflight import validate

    with pytest.raises(ConfigError, match="trainer.resume=.*does not exist"):
        validate(load_config(["preset=tiny", f"trainer.resume={tmp_path / 'nope'}"]))


# ------------------------------------------------------------------ kill and resume
# These cases (about 45-70 s each) are not marked slow although they are over 30 s: they are the
# check that a resume equals no interruption (LoRA's adapters and tool rows included); vLLM's is slow.
@pytest.mark.ray
@pytest.mark.parametrize(
    "k,engine,lora,agent,mode,teacher",
    [
        (0, "builtin", 0, "single_turn_agent", "batch", False),
        (1, "builtin", 0, "single_turn_agent", "batch", True),
        pytest.param(1, "vllm", 0, "single_turn_agent", "batch", False, marks=[needs_vllm, pytest.mark.slow]),
        (1, "builtin", 8, "single_turn_agent", "batch", False),
        (1, "builtin", 0, "tool_agent", "batch", False),
        (0, "builtin", 0, "single_turn_agent", "fully_async", False),
    ],
    ids=["sync", "one-step-teacher", "one-step-vllm", "one-step-lora", "one-step-tools", "fully-async-k0"],
)
def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path, ray_session, k, engine, lora, agent, mode, teacher):
    """6 steps in one go == 3 steps, SIGKILL mid-step 4/5, resume for the rest: same prompts,
    rewards, losses, KL, entropy and gradient norms at every step, bit for bit (CPU, fixed seeds;
    in one-step mode the batch generating at save time is stored in the checkpoint). With vLLM the
    resumed replica is a new vLLM engine given the checkpoint's weights: its per-request seeds make
    the same samples. With LoRA the checkpoint holds the adapters and their optimizer state only
    (the frozen base is the model's): the resumed actor and replica start from the base again and
    get the adapters. With tool rows (agent loops, ``rollout.agent.ordered``) the in-flight batch's
    samples keep their masks and loop statistics, and the loops' engine admissions do not depend
    on timing. In the fully asynchronous mode with k = 0, admission is held from the step's sync
    to its checkpoint, so no group is generating when it is written (with k >= 1, where loads land
    inside generation at moments that depend on timing, tests/pipeline/test_fully_async.py checks that a
    resume loses and repeats no group). The one-step case distils from a teacher (distill.teacher):
    the in-flight batch keeps its samples' teacher log-probs."""
    from offstep.pipeline.controller import train

    reward = tmp_path / "reward.py"
    reward.write_text(BLOCKING_REWARD)
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(load_config(_overrides(full, reward, k, engine=engine, lora=lora, agent=agent, mode=mode, teacher=teacher)))
    if lora:  # adapters and their AdamW moments, nothing of the frozen base
        from offstep.train.checkpoint import SafeReader

        keys = SafeReader(full / "checkpoints" / "step_000003" / "actor").read_metadata().state_dict_metadata
        weights = [k for k in keys if k.startswith("model.")]
        assert weights and all(".lora_" in k for k in weights), weights[:5]
        assert any(".lora_" in k and "exp_avg" in k for k in keys)

    gate = killed / "checkpoints" / "step_000003" / "trainer_state.json"
    proc = cli(
        _overrides(killed, reward, k, engine=engine, lora=lora, agent=agent, mode=mode, teacher=teacher),
        env={**os.environ, "BLOCK_AFTER": str(gate)},
    )
    wait_for(gate, proc)
    time.sleep(1.0)  # let it get into step 4, whose generation (k=0) or the next one (k=1) now blocks
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(step_records(killed)) < 6, "the run was meant to be killed before it finished"

    history = train(
        load_config(_overrides(killed, reward, k, engine=engine, lora=lora, agent=agent, mode=mode, teacher=teacher))
    )  # trainer.resume=auto is the default
    assert [m["step"] for m in history] == [4, 5, 6]
    a, b = step_records(full), step_records(killed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert a[step] == b[step], f"step {step} differs after resume"
    assert not teacher or all("distill/reverse_kl" in a[step] for step in a)


@pytest.mark.ray
def test_export_writes_a_loadable_model_equal_to_the_checkpoint(tmp_path, ray_session):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from offstep.cli import main
    from offstep.models.loading import load_causal_lm, resolve_model
    from offstep.pipeline.controller import train

    run, reward = tmp_path / "run", tmp_path / "reward.py"
    reward.write_text(BLOCKING_REWARD)  # scores that differ from step to step, so that one step is the best
    train(
        load_config(
            [
                "preset=tiny",
                f"trainer.output_dir={run}",
                "trainer.total_steps=3",
                "trainer.save_freq=1",
                "trainer.val_freq=1",
                "trainer.keep_checkpoints=1",
                "trainer.keep_best=true",
                "trainer.best_metric=val/reward/mean",
                f"reward.custom_path={reward}",
                "trainer.val_before_train=false",
                "trainer.progress=off",
            ]
        )
    )
    # keep_checkpoints=1 with keep_best: the last step's checkpoint and the best-scoring one stay
    scores = {
        m["step"]: m["val/reward/mean"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    }
    best = max(scores, key=lambda s: (scores[s], s))
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == sorted({best, 3}), scores
    assert main(["export", str(run), "--best", "val/reward/mean", "--out", str(tmp_path / "best")]) == 0
    assert json.loads((tmp_path / "best" / ".offstep-export").read_text())["step"] == best
    assert (
        main(
            [
                "eval",
                str(run),
                "--best",
                "val/reward/mean",
                "--data",
                str(run / "data" / "val.parquet"),
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert main(["export", str(run), "--step", "3", "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # An independent reading of the same shards: torch's own DCP-to-torch.save converter.
    dcp_to_torch_save(run / "checkpoints" / "step_000003" / "actor", tmp_path / "full.pt")
    reference = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    initial = load_causal_lm(resolve_model("tiny")).state_dict()
    got = exported.state_dict()
    for name, t in reference.items():
        assert torch.equal(got[name], t), name
    assert any(not torch.equal(got[n], initial[n]) for n in reference), "the exported policy should be trained"
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
