"""The trainers' optimizer (``offstep.train.fsdp.make_optimizer``): fused AdamW, equal to torch's
per-tensor AdamW within float32 rounding, and the linear warm-up."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from offstep.config.schema import OptimConfig
from offstep.train.fsdp import make_optimizer


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def _train(net: torch.nn.Module, opt, sched, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()


def test_the_optimizer_is_fused_adamw_over_the_trained_parameters():
    net = _net()
    net[0].weight.requires_grad_(False)  # as a LoRA model's frozen base
    opt, _, _ = make_optimizer(net.parameters(), OptimConfig(lr=1e-3))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in net.parameters() if p.requires_grad}


def test_fused_equals_the_per_tensor_loop_within_float32_rounding():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=3)
    fused_net, loop_net = _net(), _net()
    fused, fused_sched, _ = make_optimizer(fused_net.parameters(), cfg)
    loop = torch.optim.AdamW(
        loop_net.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, foreach=False
    )
    loop_sched = torch.optim.lr_scheduler.LambdaLR(loop, lambda s: min(1.0, (s + 1) / 3))
    start = copy.deepcopy(loop_net.state_dict())
    _train(fused_net, fused, fused_sched, 20)
    _train(loop_net, loop, loop_sched, 20)
    for (name, a), b in zip(fused_net.state_dict().items(), loop_net.state_dict().values()):
        moved = (b - start[name]).abs().max()
        assert moved > 1e-3, name  # the weights did move: the comparison is not of untouched tensors
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("warmup,expected", [(0, [1.0, 1.0, 1.0]), (2, [0.5, 1.0, 1.0]), (4, [0.25, 0.5, 0.75])])
def test_learning_rate_warms_up_linearly_then_stays(warmup, expected):
    opt, sched, _ = make_optimizer(_net().parameters(), OptimConfig(lr=0.1, warmup_steps=warmup))
    seen = []
    for _ in expected:
        seen.append(opt.param_groups[0]["lr"] / 0.1)
        opt.step()
        sched.step()
    assert seen == pytest.approx(expected)


def test_a_cosine_schedule_decays_over_the_horizon_the_caller_sets():
    cfg = OptimConfig(lr=0.1, warmup_steps=1, lr_scheduler_type="cosine", min_lr_ratio=0.2)
    opt, sched, schedule = make_optimizer(_net().parameters(), cfg)
    schedule.horizon = 5  # 1 warm-up step, then 4 of decay: progress 0, 1/4, 2/4, 3/4
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"] / 0.1)
        opt.step()
        sched.step()
    half = [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert seen == pytest.approx([1.0, *(0.2 + 0.8 * h for h in half)])
    assert sched.state_dict()["lr_lambdas"] == [None]  # a checkpoint stores none of the schedule's settings
