"""Cores that never idle (``pipeline.lend_cores``): while no generation runs on the rollout
replicas, their cores are lent to the trainer's ranks, and given back before the next one starts.

The fleet calls ``busy`` as it submits a generation and ``idle`` as one ends; the first and the
last of overlapping generations send the change to every trainer rank, in the actor's
``LEND_GROUP`` (served at once, beside the update it is running). A rank takes the new thread
count at its next decoder layer, forward or backward (``offstep.train.threads``). Generations are
submitted at step boundaries, while the trainer waits between stages, so the cores are back before
the rollout needs them; they are lent during the long stretch where the update runs alone.

The count a rank computes with then depends on when generation ended, and a CPU kernel's
summation order depends on its thread count: results agree with an unlent run to rounding, not
bit for bit. That is why it is off by default (``docs/performance.md``)."""

from __future__ import annotations

import time

from offstep.pipeline.pools import LEND_GROUP, RoleGroup


class CoreLending:
    def __init__(self, groups: list[RoleGroup], cores_per_rank: int):
        self.groups, self.cores = groups, cores_per_rank
        self.running = 0  # generations submitted and not yet ended
        self.lent_s = 0.0  # seconds the trainer held the cores, since ``take_seconds`` last read them
        self._since: float | None = None  # when they were last lent; None: not lent now

    def busy(self) -> None:
        self.running += 1
        if self.running == 1:
            self._send(0)
            if self._since is not None:
                self.lent_s += time.monotonic() - self._since
                self._since = None

    def idle(self, *_) -> None:
        self.running -= 1
        if self.running == 0:
            self._since = time.monotonic()
            self._send(self.cores)

    def take_seconds(self) -> float:
        """Seconds the cores were lent since the last call (the step's ``perf/lent_cores_s``)."""
        now = time.monotonic()
        if self._since is not None:
            self.lent_s += now - self._since
            self._since = now
        out, self.lent_s = self.lent_s, 0.0
        return out

    def _send(self, cores: int) -> None:
        for group in self.groups:
            for handle in group.handles:
                handle.lend_threads.options(concurrency_group=LEND_GROUP).remote(cores)
