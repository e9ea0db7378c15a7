"""What a serving engine does between two decode steps at another thread's request: load new
weights, or suspend its in-flight samples.

In the fully asynchronous mode (``pipeline.mode=fully_async``) a replica's engine never stops
generating: a weight load is posted here by the thread that received it and carried out by the
engine's own thread at its next step boundary, so the in-flight samples continue under the new
weights (a partial rollout). ``partial`` says how they continue (``rollout.partial``):

- ``keep``: their KV cache, computed under the old weights, stays (no extra work; the next tokens
  attend to keys and values of the old weights);
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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from offstep.config.choices import PARTIAL_MODES

SUSPENDED = "suspended"  # the finish reason of a sample a suspension ended


class StepControl:
    def __init__(self, partial: str):
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial={partial!r} is not one of {list(PARTIAL_MODES)}")
        self.partial = partial
        self._lock = threading.Lock()
        self._serving = False
        self._load: tuple[Callable[[], None], Future] | None = None
        self._suspend: Future | None = None
        self._work: list[tuple[Callable[[], object], Future]] = []
        self._wake: Callable[[], None] = lambda: None

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

    def pending(self) -> str | None:
        """``"suspend"``, ``"load"`` (in that order of precedence) or None."""
        with self._lock:
            return "suspend" if self._suspend is not None else "load" if self._load is not None else None

    def run_work(self) -> None:
        """Run the posted work (in the calling thread), each poster getting its result or error."""
        with self._lock:
            work, self._work = self._work, []
        for fn, fut in work:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def run_load(self) -> bool:
        """Carry out the posted load (in the calling thread); False when none was posted."""
        with self._lock:
            posted, self._load = self._load, None
        if posted is None:
            return False
        apply, fut = posted
        try:
            apply()
        except BaseException as e:  # the poster gets the error (a load that did not match the model)
            fut.set_exception(e)
        else:
            fut.set_result(None)
        return True

    def run_suspend(self) -> None:
        """The in-flight samples were ended (the engine emitted them); the poster may go on."""
        with self._lock:
            fut, self._suspend = self._suspend, None
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
        step boundary; at once when the engine is not serving. One load at a time."""
        fut: Future = Future()
        with self._lock:
            if self._load is not None:
                raise RuntimeError("a weight load is already waiting for the engine; post the next one after it")
            self._load = (apply, fut)
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
