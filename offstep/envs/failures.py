"""An environment's rollout that failed: counted and retried, never trained as reward 0."""

from __future__ import annotations

from offstep.telemetry.names import Env

ERRORS, TIMEOUTS = Env.ERRORS, Env.TIMEOUTS  # the keys a rollout's reward extras carry


class EnvRolloutFailed(Exception):
    """The environment raised or ran out of time inside one rollout (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out
