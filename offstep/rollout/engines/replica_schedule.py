"""A replica's schedule in the fully asynchronous mode: at which decode step each weight load, each
suspension and each admission of requests happened. Recorded on every stream; given back
(``pipeline.replay``), it makes a replica do the same things at the same decode steps, so that a run
with ``pipeline.max_staleness >= 1`` can be reproduced although where a load lands depends on timing
(``docs/fully-async.md``, "Replaying a run").

The engine's serving loop is not changed for it: the schedule is consulted by the loop's
:class:`~offstep.rollout.engines.control.StepControl` (loads, suspensions, and the wait at each step boundary
for what is due there) and by its :class:`~offstep.rollout.stream.replica_stream.StreamFeed` (admissions). The loop
reports each decode step (``StepControl.decoded``).

An event is ``[t, kind, keys]``: before decode step ``t`` (counted from 0 since the stream started)
the replica ran a ``"load"`` or a ``"suspend"``, or ``"admit"``-ted the requests ``keys`` in that
order. A request's key is its random stream and where it starts (``seed, stream, offset``) and its
length, which name it whichever order its submissions arrived in.

Each batch of recorded events ends with ``[t, "until"]``: nothing else happened before decode step
``t`` (the step the replica had reached when the events were collected). Without it a replay that
ran out of events would run freely from its last one, and a load could land inside samples the
recorded run finished under the old weights.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

LOAD, SUSPEND, ADMIT, UNTIL = "load", "suspend", "admit", "until"
DIFFERS = "the run being replayed differs from the recorded one (its config, its engine or its model)"


def request_key(req) -> list:
    """The name of a ``TurnRequest`` in a schedule."""
    return [req.seed, req.stream, req.offset, len(req.prompt_ids)]


class Schedule:
    """Recording (``replay=None``) or replaying ``replay`` (a replica's events, in order). A replay
    runs out after its last event: from there the replica runs freely. A replay records too, so that a
    replayed run's schedule is the recorded one (its own ``until`` marks aside)."""

    def __init__(self, replay: Iterable[list] | None = None):
        self.t = 0  # decode steps done
        self._lock = threading.Lock()
        self._recorded: list[list] = []
        self._replay = [list(e) for e in replay] if replay is not None else []
        self._next = 0  # the first event of _replay not yet carried out

    # ---------------------------------------------------------------- recording
    def decoded(self) -> None:
        self.t += 1

    def note(self, kind: str, keys: list | None = None) -> None:
        """``kind`` happened now (before decode step ``t``); when replaying, it was the event due."""
        if self.replaying:
            self._next += 1
        with self._lock:
            self._recorded.append([self.t, kind] if keys is None else [self.t, kind, keys])

    def drain(self) -> list[list]:
        """The events recorded since the last call, and the mark of the decode step reached."""
        with self._lock:
            out, self._recorded = self._recorded, []
            return out + [[self.t, UNTIL]]

    # ---------------------------------------------------------------- replaying
    @property
    def replaying(self) -> bool:
        return self._next < len(self._replay)

    def due(self) -> list | None:
        """The next event if it is due before the coming decode step; None otherwise (or when the
        replay ran out)."""
        while self.replaying and (event := self._replay[self._next])[1] == UNTIL and event[0] <= self.t:
            self._next += 1  # a mark passed: nothing else was due up to it
        if not self.replaying:
            return None
        event = self._replay[self._next]
        if event[0] < self.t:
            raise RuntimeError(
                f"replay: event {event} was due before decode step {self.t}, which this replica "
                f"passed without it: {DIFFERS}"
            )
        return event if event[0] == self.t and event[1] != UNTIL else None

    def stuck(self) -> str:
        """Why a replica with nothing in flight cannot go on (the next event is for a later decode
        step, which only samples in flight would reach)."""
        return (
            f"replay: this replica has nothing in flight at decode step {self.t}, but the recorded run's next "
            f"event is {self._replay[self._next]}: {DIFFERS}"
        )

    def allows(self, kind: str) -> bool:
        """Whether ``kind`` may run now: recording, always; replaying, only when it is the event due."""
        if not self.replaying:
            return True
        event = self.due()
        return event is not None and event[1] == kind
