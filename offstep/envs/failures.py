"""An environment's rollout that failed: counted, retried, and then its group dropped or the run
stopped (docs/environments.md, "Failures"); never trained as reward 0."""

from __future__ import annotations

from offstep.telemetry.names import Env

ERRORS, TIMEOUTS = Env.ERRORS, Env.TIMEOUTS  # the keys a rollout's reward extras carry
FAILED = "env/failed"  # a dropped rollout's placeholder sample: its group leaves the batch (never a metric)
DROPPED_GROUPS = Env.DROPPED_GROUPS


def split_failed(samples: list) -> tuple[list, list]:
    """(samples of groups without a failed rollout, samples of groups with one)."""
    bad = {s.uid for s in samples if s.reward_extra.get(FAILED)}
    return [s for s in samples if s.uid not in bad], [s for s in samples if s.uid in bad]


class EnvRolloutFailed(Exception):
    """The environment raised or ran out of time inside one rollout (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out
