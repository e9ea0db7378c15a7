"""On-policy distillation (distill.*): the teacher's log-probs against a direct transformers
forward, the refusal of a teacher with another vocabulary, and tiny runs in both pipeline modes
with the teacher on the replicas and in a pool of its own. The maths by hand is
tests/algos/test_algos_distill.py; kill-and-resume with a teacher is tests/pipeline/test_checkpoint.py's
one-step-teacher case."""

from __future__ import annotations

import shutil

import pytest
import torch

from offstep.errors import ModelError
from offstep.launch.loader import load_config
from offstep.launch.validate import problems
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Adv, Distill, Stage, Timing, reward_lane


def _direct(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log-softmax of a plain transformers forward over prompt + response, at the response tokens."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1)


@pytest.mark.heavy
def test_the_teachers_logprobs_equal_a_direct_forward(tiny):
    from offstep.rollout.scoring.teacher_scoring import TeacherModel, TeacherSpec

    path, tok, model, _ = tiny
    seqs = [(tok("What is 2+3?")["input_ids"], [11, 12, 13, 14]), (tok("1+1")["input_ids"], [7, 8])]
    for topk in (0, 4):
        spec = TeacherSpec(path, "float32", "builtin", 0.7, "float32", batch_size=8, topk=topk, timeout_s=60)
        got = TeacherModel(spec, torch.device("cpu"))(seqs)
        for (prompt, response), t in zip(seqs, got):
            want = _direct(model, prompt, response, 0.7)
            assert torch.allclose(torch.tensor(t.logprobs), want[torch.arange(len(response)), response], atol=1e-5)
            if topk:
                values, ids = want.topk(topk, -1)
                assert t.topk_ids == ids.tolist()
                assert torch.allclose(torch.tensor(t.topk_logprobs), values, atol=1e-5)
            else:
                assert t.topk_ids is None


def test_a_teacher_with_another_vocabulary_is_refused_before_start(tmp_path, tiny):
    from offstep.models.teacher import resolve_teacher

    path, tok, _, _ = tiny
    other = tmp_path / "teacher"
    shutil.copytree(path, other)
    extra = type(tok).from_pretrained(other)
    extra.add_tokens(["<teacher-only>"])
    extra.save_pretrained(other)
    with pytest.raises(ModelError, match="vocabulary of .* not the same .*teacher-only.*same tokenizer"):
        resolve_teacher(str(other), tok, "tiny")
    assert resolve_teacher(path, tok, "tiny") == path  # the policy's own family passes


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["distill.use_task_rewards=false"], "no teacher is given"),
        (["distill.teacher.path=tiny", "distill.loss_mode=reverse"], "distill.loss_mode='reverse' is not one of"),
        (["distill.teacher.path=tiny", "distill.coef=0"], "distill.coef=0.0 must be a finite number > 0"),
        (
            [
                "distill.teacher.path=tiny",
                "distill.teacher.engine=vllm",
                "distill.loss_mode=forward_kl_topk",
                "rollout.temperature=1.0",
            ],
            "needs distill.teacher.engine=builtin",
        ),
        (
            ["distill.teacher.path=tiny", "distill.teacher.engine=vllm", "rollout.temperature=0.7"],
            "set rollout.temperature=1.0",
        ),
        (
            ["distill.teacher.path=tiny", "distill.teacher.placement=pool", "resources.teacher_workers=0"],
            "resources.teacher_workers=0 must be >= 1",
        ),
    ],
)
def test_bad_distill_keys_are_refused_with_the_fix(overrides, fragment):
    found = problems(load_config(["preset=tiny", *overrides]))
    assert any(fragment in p for p in found), found


def _run(tmp_path, steps: int, *extra: str) -> tuple[list[dict], list[dict]]:
    from offstep.pipeline.controller import train

    out = tmp_path / "run"
    train(
        load_config(
            [
                "preset=tiny",
                f"trainer.total_steps={steps}",
                f"trainer.output_dir={out}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "trainer.val_freq=-1",
                *extra,
            ]
        )
    )
    return [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1], read_jsonl(out / "timeline.jsonl")


@pytest.mark.ray
@pytest.mark.parametrize(
    "mode,placement,loss",
    [("batch", "rollout", "k1"), ("fully_async", "rollout", "forward_kl_topk"), ("batch", "pool", "k1")],
    ids=["one-step-replicas", "fully-async-replicas-topk", "pool"],
)
def test_a_teacher_trains_in_each_mode_and_placement(tmp_path, ray_session, mode, placement, loss):
    """3 steps of the tiny preset with a teacher of another initialisation (the tiny model with
    model.override_config would change its shape: a copy with its weights perturbed instead).
    The teacher's batches are on the replica's reward lane and in timing_s/teacher; every step
    reports the reverse KL; with the pool the rollout is colocated so that the run fits 2 cores."""
    from offstep.models.loading import load_causal_lm, resolve_model

    teacher = tmp_path / "teacher"
    shutil.copytree(resolve_model("tiny"), teacher)
    model = load_causal_lm(teacher)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(teacher)
    where = ["pipeline.max_staleness=0", "pipeline.colocate=true"] if placement == "pool" else []
    metrics, timeline = _run(
        tmp_path,
        3,
        f"pipeline.mode={mode}",
        f"distill.teacher.path={teacher}",
        f"distill.teacher.placement={placement}",
        f"distill.loss_mode={loss}",
        *where,
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m[Distill.REVERSE_KL] != 0.0 and m[Distill.TEACHER_LOGPROB] < 0
        assert loss != "forward_kl_topk" or m["actor/distill_topk_kl"] > 0
    # the stream's groups may all have been scored before a step: that step reports no teacher time
    assert all(m[Timing.TEACHER] >= 0 for m in metrics if Timing.TEACHER in m)
    assert Timing.TEACHER in metrics[0] and (mode == "fully_async" or all(Timing.TEACHER in m for m in metrics))
    lane = [e for e in timeline if e["role"] == reward_lane(0)]
    assert {e["stage"] for e in lane} == {Stage.TEACHER} and 1 in {e["step"] for e in lane}


@pytest.mark.ray
def test_pure_distillation_from_a_teacher_equal_to_the_student_changes_nothing(tmp_path, ray_session):
    """use_task_rewards=false and the teacher the student's own weights: every advantage is zero
    (to float rounding: the teacher's forward and the rollout's decode round differently, by about
    1e-6 nats), and with no other loss term (entropy and KL off) the gradient is zero to rounding."""
    metrics, _ = _run(
        tmp_path,
        2,
        "distill.teacher.path=tiny",
        "distill.use_task_rewards=false",
        "algorithm.entropy_coeff=0",
        "algorithm.use_kl_loss=false",
    )
    for m in metrics:
        assert abs(m[Distill.REVERSE_KL]) < 1e-5 and m[Adv.ABS_MEAN] < 1e-5 and m[Adv.MAX] < 1e-4
        assert m["actor/grad_norm"] < 1e-3


def test_verl_distillation_keys_translate():
    notes: list[str] = []
    cfg = load_config(
        [
            "preset=tiny",
            "distillation.enabled=True",
            "distillation.teacher_model.model_path=tiny",
            "distillation.teacher_model.enable_resource_pool=True",
            "distillation.num_workers=2",
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.use_policy_gradient=False",
            "distillation.distillation_loss.topk=16",
            "distillation.distillation_loss.use_task_rewards=False",
            "distillation.distillation_loss.distillation_loss_coef=0.5",
        ],
        notes=notes,
    )
    d = cfg.distill
    assert (d.teacher.path, d.teacher.placement, cfg.resources.teacher_workers) == ("tiny", "pool", 2)
    assert (d.loss_mode, d.topk, d.use_task_rewards, d.coef) == ("forward_kl_topk", 16, False, 0.5)
    assert any("distill.loss_mode=forward_kl_topk" in n for n in notes)
    later: list[str] = []
    off = load_config(["preset=tiny", "distillation.teacher_model.model_path=tiny"], notes=later)
    assert not off.distill.enabled and any("no effect (distillation.enabled is not True)" in n for n in later)


@pytest.mark.parametrize("mode,gradient", [("k3", "True"), ("k1", "False"), ("jsd", "False")])
def test_verl_distillation_modes_offstep_lacks_are_refused(mode, gradient):
    from offstep.errors import ConfigError

    with pytest.raises(ConfigError, match=f"loss_mode='{mode}': with use_policy_gradient={gradient} has no offstep"):
        load_config(
            [
                "preset=tiny",
                "distillation.enabled=True",
                "distillation.teacher_model.model_path=tiny",
                f"distillation.distillation_loss.loss_mode={mode}",
                f"distillation.distillation_loss.use_policy_gradient={gradient}",
            ]
        )
