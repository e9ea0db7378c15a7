"""A test-only rollout worker that drops or corrupts its load of one weight version, for the tests
of the sync check (``tests/sync/test_sync_verify.py``): the digest check must stop the run, naming the
worker and the version. Installed by the test, never by a configuration:

    train(cfg, start=faulty_start("drop", replica=1, version=2))
"""

from __future__ import annotations

import sys

from offstep.rollout.worker import RolloutWorker


class FaultyRolloutWorker(RolloutWorker):
    """At version ``fault[1]``: ``drop`` keeps the weights the engine holds under the new version
    tag (a silently dropped sync); ``corrupt`` loads what was sent with one element changed, in
    the manifest's last tensor (never a tied one, which has two names). ``fault=None``: none."""

    fault: tuple[str, int] | None = None

    def _fault(self, version: int) -> str | None:
        return self.fault[0] if self.fault is not None and self.fault[1] == version else None

    def _apply(self, tensors: dict, version: int) -> None:
        fault = self._fault(version)
        if fault == "drop":
            self.engine.version = int(version)
            return
        if fault == "corrupt":
            tensors = dict(tensors)
            last = self.weight_sync_manifest()[-1].name
            tensors[last] = tensors[last].detach().clone()
            tensors[last].view(-1)[0] += 1  # one element, by a change no cast to the engine's dtype rounds away
        super()._apply(tensors, version)

    def receive_weights(self, version: int):
        """The collective path. An engine that receives into its live weights (the built-in one)
        got version ``version`` already: a drop puts back what it held, a corruption loads the
        received tensors again through :meth:`_apply`."""
        receiver, fault = getattr(self, "_weight_receiver", None), self._fault(version)
        if fault is None or receiver is None or receiver.model is None:
            return super().receive_weights(version)
        before = {n: p.detach().clone() for n, p in receiver.model.named_parameters()} if fault == "drop" else None
        start = super().receive_weights(version).span.start
        if before is not None:
            self.engine.load_weights(before, version)
        else:
            self._apply(receiver.tensors(), version)
        return self._loaded(start, version)


def faulty_class(kind: str, version: int) -> type:
    """A :class:`FaultyRolloutWorker` subclass whose every instance has the fault ``(kind, version)``."""
    if kind not in ("drop", "corrupt"):
        raise ValueError(f"{kind!r} is not drop or corrupt")
    return type(f"{kind.capitalize()}AtVersion{version}", (FaultyRolloutWorker,), {"fault": (kind, version)})


def faulty_start(kind: str, replica: int, version: int):
    """``start`` for ``offstep.pipeline.controller.train``: the real workers, but rollout replica
    ``replica`` drops or corrupts its load of ``version``. This module travels to Ray's worker
    processes by value (they cannot import ``tests/``)."""
    import ray.cloudpickle

    from offstep.pipeline import controller

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    faulty = faulty_class(kind, version)

    def start(cfg, inputs, console):  # the run's own start, looked up now: the session's keeper, if it wraps it
        return controller.start_workers(cfg, inputs, console, lambda i: faulty if i == replica else RolloutWorker)

    return start
