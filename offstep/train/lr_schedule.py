"""The learning rate's schedule: a linear warm-up over ``warmup_steps`` optimizer steps, then
constant, or verl's cosine decay (``lr_scheduler_type=cosine``): from the peak after the warm-up down
to ``min_lr_ratio`` x the peak over the run's optimizer steps, ``num_cycles`` cosine periods
(0.5: one half period, a monotone decay).

The run's optimizer steps are known only once the first update has cut its batch into mini-batches
(``trainer.total_steps`` x the optimizer steps of one update); the actor sets :attr:`LrSchedule.horizon`
before each update. The factor of step 0 does not depend on it.
"""

from __future__ import annotations

import math

from offstep.config.choices import LR_SCHEDULES


def lr_factor(
    step: int, warmup: int, horizon: int, kind: str = "constant", min_ratio: float = 0.0, num_cycles: float = 0.5
) -> float:
    """The learning rate of optimizer step ``step`` (0-based) over the peak. The warm-up rises
    linearly to 1 at step ``warmup - 1``; the cosine decays from 1 at step ``warmup`` and would reach
    ``min_ratio`` at step ``horizon`` (the run's last step, ``horizon - 1``, is one step short of it, as in verl);
    steps past ``horizon`` stay at ``min_ratio``."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r} is not one of {list(LR_SCHEDULES)}")
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or horizon <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (horizon - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress))


class LrSchedule:
    """``lr_factor`` with the settings of one ``OptimConfig``, as ``LambdaLR``'s function of the
    optimizer step (wrapped in a plain function by ``make_optimizer``, so that a checkpoint stores
    none of its attributes: what a received checkpoint holds never sets them)."""

    def __init__(self, warmup: int, kind: str, min_ratio: float, num_cycles: float):
        self.warmup, self.kind, self.min_ratio, self.num_cycles = warmup, kind, min_ratio, num_cycles
        self.horizon = 0  # the run's optimizer steps, once known (0: not yet; the warm-up still applies)

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup, self.horizon, self.kind, self.min_ratio, self.num_cycles)
