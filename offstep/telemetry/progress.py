"""Live progress inside a step: how far generation, training and weight sync are.

A Ray actor runs one method at a time, so the driver cannot ask a busy worker how far it is.
Instead each worker pushes a small record to a *progress hub*, a tiny Ray actor that
keeps only the latest record per role, and the driver polls the hub every ~0.5 s to refresh the
console's status line::

    step 3 | trainer update_actor 3/8 | rollout/0 gen v2 17/32

    rollout/<i>  gen v2 17/32       samples finished of this replica's share, policy version 2
    trainer      update_actor 3/8   micro-batches trained on rank 0 (all ranks run in step); with
                                    several mini-batches, of those planned so far, and which one
    trainer      sync               noted by the driver itself (``LiveStatus.note``)

Pushes are fire-and-forget (``hub.update.remote(...)``, never awaited) and rate-limited per worker
(``min_interval_s``), so a hot loop pays at most one small remote call per interval; a client
without a hub does nothing. The hub is ours (not Ray's dashboard or ``ray.util.state``) because
those report task state, not progress inside a running method.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import ray

from offstep.telemetry.names import Role, replica_index


class ProgressHub:
    """The latest progress record of each role. A plain (one call at a time) actor: every call
    takes microseconds, and Ray then runs one caller's calls in the order they were sent."""

    def __init__(self) -> None:
        self._states: dict[str, dict] = {}

    def update(self, role: str, state: dict) -> None:
        # One client's records arrive in order; "t" still guards against a stale overwrite.
        old = self._states.get(role)
        if old is None or state.get("t", 0.0) >= old.get("t", 0.0):
            self._states[role] = state

    def snapshot(self) -> dict[str, dict]:
        return dict(self._states)


def launch_hub():
    """Start a hub actor. It takes no CPU from the pools (``num_cpus=0``): it only stores dicts."""
    return ray.remote(num_cpus=0)(ProgressHub).remote()


class ProgressClient:
    """A worker's handle on the hub, for one role (``trainer``, ``rollout/0``, ...).

    ``start(stage, total)`` begins a stage and is always sent; ``plan(n)`` adds units that only
    become known during the stage; ``advance()`` counts one unit (a finished sample, a trained
    micro-batch) and is sent at most every ``min_interval_s``, except the one that completes the
    units planned so far. Picklable: pass it to a Ray actor's constructor.
    """

    def __init__(self, hub=None, role: str = "", min_interval_s: float = 0.25):
        self.hub, self.role, self.min_interval_s = hub, role, min_interval_s
        self._state: dict = {}
        self._last = 0.0

    def start(self, stage: str, total: int = 0, **extra) -> None:
        if self.hub is None:
            return
        self._state = {"stage": stage, "done": 0, "total": int(total), **extra}
        self._push(force=True)

    def plan(self, n: int) -> None:
        """``n`` more units in this stage, known only now (the micro-batches of the next
        mini-batch); counts that part in ``mini``."""
        if self.hub is None:
            return
        self._state["total"] = self._state.get("total", 0) + n
        self._state["mini"] = self._state.get("mini", 0) + 1

    def advance(self, n: int = 1) -> None:
        if self.hub is None:
            return
        done = self._state.get("done", 0) + n
        self._state["done"] = done
        self._push(force=done == self._state.get("total", 0))

    def _push(self, force: bool) -> None:
        now = time.time()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        self.hub.update.remote(self.role, {**self._state, "t": now})  # fire-and-forget


def mini_batch_count(n: int, mini: int, epochs: int = 1) -> int:
    """Optimizer steps of one update: ``n`` local samples cut into mini-batches of ``mini``
    (``TrainBatch.chunks``: the last may be short), for ``epochs`` epochs."""
    return epochs * -(-n // (mini or n)) if n else 0


def _role_key(role: str) -> tuple:
    # trainer first, then rollout replicas by index, then anything else by name
    if role == Role.TRAINER:
        return (0, 0, role)
    i = replica_index(role)
    if i is not None:
        return (1, i, role)
    return (2, 0, role)


def format_status(states: dict[str, dict], step: int | None = None) -> str:
    """One line from the latest record per role, e.g.
    ``step 3 | trainer update_actor 3/8 | rollout/0 gen v2 17/32``."""
    parts = [f"step {step}"] if step is not None else []
    for role in sorted(states, key=_role_key):
        st = states[role]
        text = f"{role} {st.get('stage', '?')}"
        if st.get("version") is not None:
            text += f" v{st['version']}"
        if st.get("total"):
            text += f" {st.get('done', 0)}/{st['total']}"
        if st.get("minis", 0) > 1:
            text += f" (mini-batch {st.get('mini', 0)}/{st['minis']})"
        parts.append(text)
    return " | ".join(parts)


def latest(*sources: dict[str, dict]) -> dict[str, dict]:
    """Merge per-role records, keeping the newest (largest ``t``) for each role."""
    out: dict[str, dict] = {}
    for src in sources:
        for role, st in src.items():
            if role not in out or st.get("t", 0.0) >= out[role].get("t", 0.0):
                out[role] = st
    return out


class LiveStatus:
    """The driver's side: polls the hub from an asyncio task and feeds ``console.status``.

    Wiring in the controller: ``live = LiveStatus.create(console)``; pass ``live.client(role)`` to
    each worker; ``live.start()`` inside the event loop; ``live.note("trainer", "sync", step=s)``
    for stages the driver itself runs; ``await live.stop()`` at the end; ``live.close()``.
    """

    def __init__(self, console, hub=None, interval_s: float = 0.5):
        self.console, self.hub, self.interval_s = console, hub, interval_s
        self.step: int | None = None
        self.notes: dict[str, dict] = {}
        self.snapshot: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    @classmethod
    def create(cls, console, interval_s: float = 0.5) -> "LiveStatus":
        """With a hub unless the console shows nothing (``trainer.progress=off``)."""
        return cls(console, launch_hub() if console.mode != "off" else None, interval_s)

    def client(self, role: str) -> ProgressClient:
        return ProgressClient(self.hub, role)

    def note(self, role: str, stage: str, step: int | None = None, **extra) -> None:
        """A stage run or awaited by the driver (``wait_gen``, ``ref``, ``sync``)."""
        if step is not None:
            self.step = step
        self.notes[role] = {"stage": stage, "t": time.time(), **extra}
        self.render()

    def render(self) -> str:
        text = format_status(latest(self.snapshot, self.notes), self.step)
        self.console.status(text)
        return text

    async def poll_once(self) -> None:
        if self.hub is not None:
            try:
                self.snapshot = await self.hub.snapshot.remote()
            except ray.exceptions.RayError:  # the hub died: keep showing the driver's own notes
                self.hub = None
        self.render()

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Start polling; call from inside the running event loop."""
        if self._task is None and self.console.mode != "off":
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def close(self) -> None:
        if self.hub is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.hub)
            self.hub = None
