"""Non-finite losses and gradients: ``clip_and_step`` skips and counts them, or stops the run
(``actor.nonfinite``), and a real tiny run hits both paths."""

from __future__ import annotations

import math

import pytest
import torch

from offstep.cli import main
from offstep.config.schema import OptimConfig
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl
from offstep.train.fsdp import NonFiniteError, clip_and_step, make_optimizer


def linear_with_grad(grad: list[float]):
    """A 2 -> 1 linear layer with weights (1, 1), no bias, and the given gradient."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    model.weight.grad = torch.tensor([grad])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def test_finite_step_is_clipped_and_taken():
    model, opt, sched = linear_with_grad([3.0, 4.0])
    norm, stepped = clip_and_step(model, opt, sched, max_norm=1.0, loss=0.5)
    # |g| = sqrt(9 + 16) = 5; clipped to 1: g' = g / 5 = (0.6, 0.8); SGD lr 1: w = (1, 1) - g' = (0.4, 0.2)
    assert stepped and norm == pytest.approx(5.0)
    assert model.weight.detach()[0].tolist() == pytest.approx([0.4, 0.2], abs=1e-5)
    assert model.weight.grad is None and sched.last_epoch == 1


@pytest.mark.parametrize(
    "grad, loss",
    [([float("nan"), 1.0], 0.5), ([float("inf"), 1.0], 0.5), ([3.0, 4.0], float("nan")), ([3.0, 4.0], float("inf"))],
)
def test_nonfinite_grad_or_loss_is_skipped(grad, loss):
    model, opt, sched = linear_with_grad(grad)
    norm, stepped = clip_and_step(model, opt, sched, max_norm=1.0, loss=loss)
    assert not stepped
    assert model.weight.detach().tolist() == [[1.0, 1.0]]  # untouched
    assert model.weight.grad is None  # the bad gradient is dropped, not carried into the next step
    assert sched.last_epoch == 1  # the schedule keeps its place
    assert math.isfinite(norm) == math.isfinite(grad[0])


def test_nonfinite_stop_raises_naming_the_key_and_where():
    model, opt, sched = linear_with_grad([float("nan"), 1.0])
    with pytest.raises(NonFiniteError) as info:
        clip_and_step(model, opt, sched, max_norm=1.0, loss=0.5, nonfinite="stop", where="step 7")
    msg = str(info.value)
    assert (
        "step 7" in msg and "actor.nonfinite=stop" in msg and "actor.nonfinite=skip" in msg and "grad_norm=nan" in msg
    )
    assert model.weight.detach().tolist() == [[1.0, 1.0]]
    # a finite update under "stop" steps as usual
    model, opt, sched = linear_with_grad([3.0, 4.0])
    assert clip_and_step(model, opt, sched, 1.0, 0.5, "stop")[1]


def test_critic_stop_names_the_critic_key():
    model, opt, sched = linear_with_grad([1.0, 1.0])
    with pytest.raises(NonFiniteError) as info:
        clip_and_step(model, opt, sched, 1.0, float("inf"), "stop", "the critic update of step 2", role="critic")
    msg = str(info.value)
    assert "the critic update of step 2" in msg and "critic.nonfinite=stop" in msg and "critic/skipped_steps" in msg
    assert "actor." not in msg


def test_skipped_step_leaves_adamw_state_untouched():
    model = torch.nn.Linear(2, 1, bias=False)
    opt, sched, _ = make_optimizer(model.parameters(), OptimConfig(lr=0.1))
    model.weight.grad = torch.ones_like(model.weight)
    clip_and_step(model, opt, sched, 1.0)
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    w = model.weight.detach().clone()
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    assert not clip_and_step(model, opt, sched, 1.0)[1]
    after = opt.state[model.weight]
    assert all(torch.equal(before[k], after[k]) for k in before)  # step count and moments unchanged
    assert torch.equal(model.weight.detach(), w)


def test_unknown_policy():
    model, opt, sched = linear_with_grad([1.0, 1.0])
    with pytest.raises(ValueError, match="actor.nonfinite"):
        clip_and_step(model, opt, sched, 1.0, nonfinite="ignore")


# --------------------------------------------------------------------------------------------------
# a real tiny run

# Every response scores 3e38: finite, and within float32, so the reward checks accept it; but the
# GRPO group mean overflows float32 (3e38 + 3e38 = inf), the advantages become (3e38 - inf) / inf
# = nan, and so do the loss and the gradients of every update. A clean way to reach the actor's
# non-finite path through the real pipeline.
HUGE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 3.0e38
"""


def huge_reward_run(tmp_path, *extra: str) -> list[str]:
    scorer = tmp_path / "huge.py"
    scorer.write_text(HUGE)
    return [
        "preset=tiny",
        "pipeline.max_staleness=1",
        "trainer.total_steps=3",
        "trainer.val_before_train=false",
        f"trainer.output_dir={tmp_path / 'run'}",
        "trainer.progress=off",
        f"reward.custom_path={scorer}",
        *extra,
    ]


@pytest.mark.ray
def test_run_skips_and_counts_nonfinite_updates(tmp_path, ray_session):
    history = train(load_config(huge_reward_run(tmp_path, "actor.nonfinite=skip")))
    metrics = [m for m in history if m["step"] >= 1]  # in memory: metrics.jsonl writes NaN as null
    assert [m["step"] for m in metrics] == [1, 2, 3]  # the run went on
    assert [m["actor/skipped_steps"] for m in metrics] == [1.0, 2.0, 3.0]
    assert all(math.isnan(m["actor/loss"]) and math.isnan(m["actor/grad_norm"]) for m in metrics)
    assert all(math.isfinite(m["response_length/mean"]) for m in metrics)  # weights stayed finite


@pytest.mark.ray
def test_run_stops_on_nonfinite_update(tmp_path, ray_session, capsys):
    capsys.readouterr()
    rc = main(["train", *huge_reward_run(tmp_path, "actor.nonfinite=stop")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Traceback" not in err, err
    assert "non-finite values at the actor update of step 1 (epoch 1, mini-batch 1)" in err, err
    assert "actor.nonfinite=stop" in err and "actor.nonfinite=skip" in err, err
    assert not [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if m.get("step", 0) >= 1]


@pytest.mark.ray
def test_critic_skips_or_stops_on_nonfinite_value_loss(tmp_path, ray_session, capsys):
    # With GAE the returns are ~3e38, so the critic's squared value error overflows to inf.
    gae = ["algorithm.adv_estimator=gae", "rollout.n=1", "trainer.total_steps=2"]
    history = train(load_config(huge_reward_run(tmp_path, *gae, "critic.nonfinite=skip")))
    metrics = [m for m in history if m["step"] >= 1]
    assert [m["critic/skipped_steps"] for m in metrics] == [1.0, 2.0]
    capsys.readouterr()
    (tmp_path / "stop").mkdir()
    rc = main(["train", *huge_reward_run(tmp_path / "stop", *gae, "critic.nonfinite=stop")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert "non-finite values at the critic update of step 1 (epoch 1, mini-batch 1)" in err, err
    assert "critic.nonfinite=stop" in err, err
