"""What a serving engine does between two decode steps at another thread's request: load new
weights, or suspend its in-flight samples.

In the fully asynchronous mode (``pipeline.mode=fully_async``) a replica's engine never stops
generating: a weight load is posted here by the thread that received it and carried out by the
engine's own thread at its next step boundary, so the in-flight samples continue under the new
weights (a partial rollout). ``partial`` says how they continue (``rollout.partial``):

- ``keep``: their KV cache, computed under the old weights, stays (no extra work; the next tokens
  attend to keys and values of the old weights), unless it would then lag the weights by more than
  ``rollout.max_kv_age`` versions: that sample alone is prefilled again, as ``recompute`` does;
- ``recompute``: their prompt and tokens so far are prefilled again under the new weights (one
  prefill of every running sample per load), so every later token is sampled from the new policy
  exactly;
- ``off``: no new sample is admitted until the running ones finish, then the weights load (no
  sample crosses a load).

A suspension ends every in-flight sample at the next step boundary with finish reason
``suspended`` (its tokens so far), for a checkpoint to store and a later request to continue.
Other work (a reference pass over finished samples) can be posted to run between two steps too,
so that the replica's engine and that work take turns on its cores instead of competing for them.

The poster blocks on the returned future until the engine did it. An engine that is not serving
(no :meth:`attach`) has nothing in flight: a post then runs at once in the poster's thread.

A stream's schedule (``offstep.rollout.engines.replica_schedule``) counts the decode steps (:meth:`decoded`) and
records at which one each load and suspension ran; replaying one, a load or suspension runs only at
its recorded step, and each step boundary waits until what is due there was posted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from offstep.config.choices import PARTIAL_MODES
from offstep.rollout.engines.replica_schedule import ADMIT, LOAD, SUSPEND, Schedule

SUSPENDED = "suspended"  # the finish reason of a sample a suspension ended


class StepControl:
    def __init__(self, partial: str, max_kv_age: int = -1):
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial={partial!r} is not one of {list(PARTIAL_MODES)}")
        self.partial = partial
        self.max_kv_age = max_kv_age  # keep: a sample's K/V may lag the weights by this many versions (-1: any)
        self._lock = threading.Lock()
        self._serving = False
        self._loads: list[tuple[Callable[[], None], Future]] = []  # posted, not yet carried out: in order
        self._suspend: Future | None = None
        self._work: list[tuple[Callable[[], object], Future]] = []
        self._wake: Callable[[], None] = lambda: None
        self.schedule: Schedule | None = None
        self._feed = None  # the feed whose admissions the schedule names (use_schedule)

    @property
    def kv_bound(self) -> float:
        """How many versions a running sample's K/V may lag the weights after a load before it is
        prefilled again: 0 with ``recompute``, ``max_kv_age`` with ``keep`` (any when negative)."""
        if self.partial == "recompute":
            return 0
        return float("inf") if self.max_kv_age < 0 else self.max_kv_age

    def use_schedule(self, schedule: Schedule, feed) -> None:
        """Record into, or replay, ``schedule``; ``feed`` (a ``StreamFeed``) holds the requests it admits."""
        self.schedule, self._feed = schedule, feed

    # ---------------------------------------------------------------- the engine's side
    def attach(self, wake: Callable[[], None]) -> None:
        """The engine starts serving; ``wake`` unblocks its wait for requests (a post calls it)."""
        with self._lock:
            self._serving, self._wake = True, wake

    def detach(self) -> None:
        """The engine stopped serving: what is still posted runs now, in this thread."""
        with self._lock:
            self._serving = False
        self.run_work()
        self.run_load()
        self.run_suspend()

    def decoded(self) -> None:
        """The engine ran a decode step (for the schedule)."""
        if self.schedule is not None:
            self.schedule.decoded()

    def _allows(self, kind: str) -> bool:
        """(Under the lock.) Whether a posted ``kind`` may run now: a replayed schedule says when."""
        return not self._serving or self.schedule is None or self.schedule.allows(kind)

    def pending(self) -> str | None:
        """``"suspend"``, ``"load"`` (in that order of precedence) or None."""
        with self._lock:
            if self._suspend is not None and self._allows(SUSPEND):
                return "suspend"
            return "load" if self._loads and self._allows(LOAD) else None

    def run_work(self) -> None:
        """Run the posted work (in the calling thread), each poster getting its result or error.
        Replaying a schedule, the engine's step boundary: first wait until what is due there has
        been posted or has arrived (running the work posted meanwhile)."""
        if self._serving and self.schedule is not None and self.schedule.replaying:
            self._await_due()
        self.run_posted()

    def _await_due(self) -> None:
        while True:
            self.run_posted()
            event = self.schedule.due()
            if event is None:
                return
            with self._lock:
                ready = self._suspend if event[1] == SUSPEND else (self._loads or None) if event[1] == LOAD else True
            if self._feed.closed or ready is not None and (event[1] != ADMIT or self._feed.holds(event[2])):
                return
            self._feed.wait_change(0.05)

    def run_posted(self) -> None:
        """Run the posted work now (in the calling thread), whatever a schedule says."""
        with self._lock:
            work, self._work = self._work, []
        for fn, fut in work:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def run_load(self) -> bool:
        """Carry out the posted loads (in the calling thread), in the order they were posted; False
        when none was posted. Two can be waiting: the engine's thread can be busy past a training
        step (a reference pass over a long group, posted work), and the next step's load then
        arrives before the last one ran. Each runs, so every version is loaded and confirmed."""
        ran = False
        while True:
            with self._lock:
                if not self._loads or not self._allows(LOAD):
                    return ran
                apply, fut = self._loads.pop(0)
                if self._serving and self.schedule is not None:
                    self.schedule.note(LOAD)
            ran = True
            try:
                result = apply()
            except BaseException as e:  # the poster gets the error (a load that did not match the model)
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def run_suspend(self) -> None:
        """The in-flight samples were ended (the engine emitted them); the poster may go on."""
        with self._lock:
            if not self._allows(SUSPEND):
                return
            fut, self._suspend = self._suspend, None
            if fut is not None and self._serving and self.schedule is not None:
                self.schedule.note(SUSPEND)
        if fut is not None:
            fut.set_result(None)

    # ---------------------------------------------------------------- the poster's side
    def _carry_out(self, run: Callable[[], object]) -> None:
        """After a post: wake the serving engine, which carries it out at its next step boundary,
        or ``run`` it now when no engine is serving."""
        with self._lock:
            serving, wake = self._serving, self._wake
        if serving:
            wake()
        else:
            run()

    def post_load(self, apply: Callable[[], None]) -> Future:
        """``apply()`` (which loads the weights into the engine and sets its version) at the next
        step boundary, after the loads posted before it; at once when the engine is not serving. The
        future gives what ``apply`` returns: what must be read before a later load runs (the digest
        of the weights it loaded) is read inside it."""
        fut: Future = Future()
        with self._lock:
            self._loads.append((apply, fut))
        self._carry_out(self.run_load)
        return fut

    def post_work(self, fn: Callable[[], object]) -> Future:
        """``fn()`` at the next step boundary (at once when the engine is not serving); the
        future gives its result."""
        fut: Future = Future()
        with self._lock:
            self._work.append((fn, fut))
        self._carry_out(self.run_work)
        return fut

    def post_suspend(self) -> Future:
        """End every in-flight sample at the next step boundary (they are emitted as ``suspended``)."""
        fut: Future = Future()
        with self._lock:
            if self._suspend is None:
                self._suspend = fut
            else:
                fut = self._suspend
        self._carry_out(self.run_suspend)
        return fut
