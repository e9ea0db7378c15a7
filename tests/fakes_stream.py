"""The simulated replicas' serving engine, for ``tests/fakes.py``'s ``FakeRollout``.

**A GPU-like profile** (``profile=GpuProfile(...)``): the replica simulates a serving engine with
continuous batching. A decode step takes ``step_s`` whatever the number of running samples (up to
``slots`` of them; more wait in a queue), and gives every running sample one token tagged with the
replica's version at that step. A sample's length is drawn from a lognormal (``len_median``,
``len_sigma``; at least ``len_min``, at most ``rollout.max_new_tokens``) by its own random stream
``(seed, stream)``, as the real engine's sampling is (``TurnRequest``): the same sample is as long
in batch mode as in the fully asynchronous mode, and after a suspension, whatever the timing. Its
score is drawn from the same stream. Batch mode (``generate``) runs the request's samples through
the same decode steps. A token's id is ``3 + version`` of the step that made it, so whoever holds
the trained batch can read every token's version back (``FakeActor``'s ``record``).

**The fully asynchronous mode** (``pipeline.mode=fully_async``): ``stream_start``,
``stream_submit`` (``GroupWork`` s), ``stream_take`` (``FinishedGroup`` s whose ``Sample`` s have
``token_versions``) and ``stream_suspend`` (the unfinished ``GroupWork`` s with their
``SampleState`` s), with the real worker's signatures and the real types
(``offstep.rollout.stream.replica_stream``). A background thread runs the decode steps; a ``load_weights``
posted meanwhile lands between two steps and takes ``load_s`` (no step runs during it), and the
in-flight samples continue under the new version (a partial rollout); ``rollout.partial=off``
admits no new sample until the running ones finish, then loads; ``recompute`` adds one step (the
prefill of the running samples) to a load that finds samples running. A suspended sample keeps its
tokens and, submitted again, its target length.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import ray

from offstep.batch import Sample
from offstep.rollout.stream.replica_stream import FinishedGroup, GroupWork, SampleState

if TYPE_CHECKING:
    from fakes import FakeRollout

# Imported by path or as a test helper: Ray ships these classes by value (as tests/fakes.py's).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKEN0 = 3  # a simulated token's id is TOKEN0 + the version that sampled it


@dataclass(frozen=True)
class GpuProfile:
    """A replica's simulated serving engine (see the module's docstring)."""

    step_s: float = 0.004  # one decode step, for any number of running samples up to `slots`
    slots: int = 64  # samples decoded at once (continuous batching); the others wait
    len_median: float = 40.0  # lognormal lengths: the median ...
    len_sigma: float = 1.0  # ... and the log-space spread (the tail's heaviness)
    len_min: int = 2
    # what a take spends on the groups it hands over (the real worker attaches their reference
    # log-probs there with pipeline.ref_on_rollout): the groups are off the replica meanwhile
    take_s: float = 0.0
    # a fault: the first replica whose take has finished groups to hand over, after this many
    # groups finished on it, creates this file and its process exits (os._exit), losing them and
    # its samples in flight; a replacement finds the file and lives
    die_marker: str | None = None
    die_after_groups: int = 6

    def length(self, seed: int, stream: int, cap: int) -> tuple[int, float]:
        """The target length and the score of the sample with random stream ``(seed, stream)``."""
        rng = np.random.default_rng([int(seed), int(stream)])
        n = int(round(rng.lognormal(math.log(self.len_median), self.len_sigma)))
        return max(self.len_min, min(n, cap)), float(rng.integers(0, 2))


def logprob(position: int) -> float:
    return -0.1 * (1 + position % 7)


class _Pacer:
    """Decode steps of ``step_s`` each against the clock: a step that ran late is made up by the
    next ones (so many short steps do not accumulate sleep overhead), but an idle engine does not
    bank time."""

    def __init__(self, step_s: float):
        self.step_s, self.next = step_s, None

    def idle(self) -> None:
        self.next = None

    def step(self) -> None:
        now = time.monotonic()
        if self.next is None or now - self.next > 20 * self.step_s:
            self.next = now
        self.next += self.step_s
        if self.next > now:
            time.sleep(self.next - now)


class SimStream:
    """The replica's side of the fully asynchronous mode, simulated (``offstep.rollout.stream.replica_stream``'s
    ``StreamServer``): a thread of decode steps over the submitted groups' samples."""

    def __init__(self, owner: "FakeRollout", params, partial: str):
        self.owner, self.params, self.partial, self.profile = owner, params, partial, owner.profile
        self.cond = threading.Condition()
        self.groups: dict[int, GroupWork] = {}  # uid -> unfinished group
        self.targets: dict[tuple[int, int], tuple[int, float]] = {}  # (uid, j) -> (length, score)
        self.queue: deque[tuple[int, int]] = deque()
        self.running: list[tuple[int, int]] = []
        self.finished: list[FinishedGroup] = []
        self.handed = 0  # groups handed over by takes (the fault's clock)
        self.loads: deque[tuple[int, Future]] = deque()  # posted, in order (as StepControl's)
        self.suspending: Future | None = None
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="sim-serve", daemon=True)
        self.thread.start()

    def submit(self, groups: list[GroupWork]) -> None:
        with self.cond:
            now = time.time()
            for g in groups:
                uid = g.request.uid
                if not g.samples:
                    g.samples = [SampleState() for _ in range(self.params.n)]
                g.started = g.started or now
                self.groups[uid] = g
                for j, s in enumerate(g.samples):
                    self.targets[uid, j] = self.profile.length(g.seed, g.stream0 + j, self.params.max_new_tokens)
                    if not s.finish_reason:
                        self.queue.append((uid, j))
                self._maybe_done(uid)
            self.cond.notify_all()

    def _serve(self) -> None:
        pacer = _Pacer(self.profile.step_s)
        try:
            while True:
                with self.cond:
                    while not (self.closed or self.suspending or self.loads or self.queue or self.running):
                        pacer.idle()
                        self.cond.wait()
                    if self.closed:
                        return
                    if self.suspending is not None:  # every in-flight sample stops where it is
                        self.queue.clear()
                        self.running.clear()
                        out, self.groups = list(self.groups.values()), {}
                        fut, self.suspending = self.suspending, None
                        fut.set_result(out)
                        continue
                    load = self.loads.popleft() if self.loads and (self.partial != "off" or not self.running) else None
                    hold = bool(self.loads) if load is None else False  # partial=off: drain the running samples first
                    while not hold and self.queue and len(self.running) < self.profile.slots:
                        self.running.append(self.queue.popleft())
                    running = bool(self.running)
                if load is not None:  # between two decode steps; the engine does nothing else meanwhile
                    version, fut = load
                    time.sleep(
                        self.owner.load_s + (self.profile.step_s if self.partial == "recompute" and running else 0.0)
                    )
                    self.owner.version = version
                    pacer.idle()
                    fut.set_result(None)
                    continue
                if not running:
                    continue
                pacer.step()
                self._decoded()
        except BaseException as e:  # handed to the controller by the next take
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _decoded(self) -> None:
        """One token for every running sample, of the version held now."""
        with self.cond:
            v = self.owner.version
            still = []
            for uid, j in self.running:
                s = self.groups[uid].samples[j]
                s.tokens.append(TOKEN0 + v)
                s.logprobs.append(logprob(len(s.tokens)))
                s.versions.append(v)
                length, score = self.targets[uid, j]
                if len(s.tokens) >= length:
                    s.finish_reason = "length" if length >= self.params.max_new_tokens else "stop"
                    s.score = score
                    self.owner.progress.advance()
                    self._maybe_done(uid)
                else:
                    still.append((uid, j))
            self.running = still
            self.cond.notify_all()

    def _maybe_done(self, uid: int) -> None:
        g = self.groups[uid]
        if not all(s.finish_reason for s in g.samples):
            return
        del self.groups[uid]
        r = g.request
        samples = [
            Sample(
                uid=uid,
                prompt_ids=list(r.prompt_ids),
                response_ids=list(s.tokens),
                rollout_logprobs=list(s.logprobs),
                finish_reason=s.finish_reason,
                score=s.score,
                version=s.versions[0] if s.versions else self.owner.version,
                data_source=r.data_source,
                token_versions=list(s.versions),
            )
            for s in g.samples
        ]
        self.finished.append(FinishedGroup(uid, samples, g.started, time.time()))

    def take(self, wait_s: float) -> list[FinishedGroup]:
        deadline = time.monotonic() + wait_s
        with self.cond:
            while not self.finished and self.error is None and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            if self.error is not None:
                raise self.error
            out, self.finished = self.finished, []
            self.handed += len(out)
        if out and self.profile.die_marker and self.handed >= self.profile.die_after_groups:
            try:
                os.close(os.open(self.profile.die_marker, os.O_CREAT | os.O_EXCL))  # one replica dies, once
            except FileExistsError:
                pass
            else:
                os._exit(1)
        if out and self.profile.take_s:
            time.sleep(self.profile.take_s)
        return out

    def post_load(self, version: int) -> None:
        fut: Future = Future()
        with self.cond:
            self.loads.append((version, fut))
            self.cond.notify_all()
        fut.result()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=10)

    def suspend(self) -> list[GroupWork]:
        fut: Future = Future()
        with self.cond:
            self.suspending = fut
            self.cond.notify_all()
        return fut.result()
