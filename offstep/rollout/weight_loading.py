"""How a rollout worker takes new weights (``RolloutWorker``'s side of a weight sync): whole or as a
delta through Ray's object store, or received from the actor's broadcast (``pipeline.weight_sync=collective``);
in the fully asynchronous mode between two decode steps of the running engine. Each load reports the
digest of what the engine then holds (``offstep.sync.digest``), read on the engine's thread right after it
loaded, before a load queued behind it runs."""

from __future__ import annotations

import time

from offstep.batch import Span
from offstep.rollout.engines.delta_load import DeltaLoads
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.sync.collective import TensorSpec, WeightReceiver
from offstep.sync.delta import Delta, DeltaRefused
from offstep.sync.digest import Loaded
from offstep.sync.weights import unpack_state_dict
from offstep.telemetry.names import Stage


class WeightLoading:
    """A mixin of ``offstep.rollout.worker.RolloutWorker``: it has ``engine``, ``lora``, ``device``,
    ``progress``, ``_sleeping``, ``_receiving`` and, in the fully asynchronous mode, ``_stream``."""

    def load_weights(self, packed: dict | Delta, version: int) -> Loaded:
        """Full weights, or a delta from the version held (``pipeline.weight_sync_delta``): one
        that does not fit is refused, the weights left as they were (``Loaded.refused``)."""
        self._sleeping.wake(("weights",))  # a sleeping engine: the weights first, the load writes into them
        t0 = time.time()
        self.progress.start(Stage.LOAD_WEIGHTS, version=version)
        if isinstance(packed, Delta):
            run = self.deltas.loader(packed, version, self.weight_sync_manifest(), self._apply)
        else:
            tensors = unpack_state_dict(packed)

            def run():
                self._apply(tensors, version)
                self.deltas.loaded_full(self.weight_sync_manifest(), tensors)

        try:
            if getattr(self, "_stream", None) is not None:  # between two decode steps of the running engine
                try:  # the digest read on the engine's thread, before a load queued behind this one runs
                    held = self._stream.load(lambda: (run(), self._held())[1])
                finally:
                    self._generating_again()
                return self._loaded(t0, version, held=held)
            run()
        except DeltaRefused as e:
            return self._loaded(t0, version, str(e))
        return self._loaded(t0, version)

    @property
    def deltas(self) -> DeltaLoads:
        if getattr(self, "_deltas", None) is None:
            self._deltas = DeltaLoads(self.engine, isinstance(self.engine, TorchEngine) and self.lora is None)
        return self._deltas

    def _apply(self, tensors: dict, version: int) -> None:
        """A sync's tensors into the engine: the adapters (LoRA) or every weight."""
        (self.engine.load_adapters if self.lora is not None else self.engine.load_weights)(tensors, version)

    def _held(self) -> tuple[str, float]:
        """The digest of what the engine holds now, read back from it over the sync manifest
        (``offstep.sync.digest``) and noted as the base of the next delta; and its seconds."""
        t_digest = time.perf_counter()
        digest = self.engine.weights_digest(self.weight_sync_manifest())
        self.deltas.held(digest)
        return digest, time.perf_counter() - t_digest

    def _loaded(self, t0: float, version: int, refused: str = "", held: tuple[str, float] | None = None) -> Loaded:
        """The report of a load that began at ``t0``, with the digest of what the engine holds after
        it (``held``: read by the load itself, on the engine's thread; else now)."""
        woke = self._sleeping.loaded()  # the KV cache wakes once the weights are in
        digest, seconds = held if held is not None else self._held()
        return Loaded(Span(t0, time.time(), version), digest, seconds, woke, refused)

    # Collective path (pipeline.weight_sync=collective): rank i + 1 of the weight-sync group, made
    # by offstep.sync.collective.connect (again, with every replica, when one is replaced). The
    # built-in engine receives into its parameters in place; vLLM into buffers, then through its
    # own loader (as load_weights).
    def weight_sync_manifest(self) -> list[TensorSpec]:
        if getattr(self, "_manifest", None) is None:
            if self.lora is not None:  # the adapters only, into buffers of their own (they are small)
                self._manifest = self.engine.adapter_manifest()
            else:
                self._manifest = self.engine.weight_manifest()
        return self._manifest

    def join_weight_sync(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        specs: list,
        bucket_bytes: int,
        timeout_s: float,
        in_place: bool = True,
    ) -> None:
        """Join the broadcast group. ``in_place=False`` (pipeline.mode=fully_async): receive into
        buffers of the receiver's own, applied between two decode steps, never into the weights
        that the running stream reads."""
        model = self.engine.receive_in_place() if self.lora is None and in_place else None
        if model is not None:
            self._weight_receiver = WeightReceiver(model, self.device)
        else:
            self._weight_receiver = WeightReceiver(None, self.device, self.weight_sync_manifest())
        self._weight_receiver.connect(host, port, rank, world_size, backend, specs, bucket_bytes, timeout_s)

    def receive_weights(self, version: int) -> Loaded:
        """The collective counterpart of ``load_weights``: ``start`` is when the actor's data began
        to arrive (an idle worker may wait for the actor before that)."""
        receiver = getattr(self, "_weight_receiver", None)
        if receiver is None:
            raise RuntimeError(
                "receive_weights: this rollout worker has not joined the weight-sync group "
                "(offstep.sync.collective.connect; a replaced worker needs a new group)"
            )
        self.progress.start(Stage.LOAD_WEIGHTS, version=version)
        self._sleeping.wake(("weights",))
        if receiver.model is None and getattr(self, "_stream", None) is not None:  # between two decode steps
            # The next version may not be received into the buffers before this one is applied: the
            # engine's thread can be busy past a training step (the actor's broadcast then waits here).
            with self._receiving:
                try:
                    t0 = receiver.receive(version, self.deltas.held_fp)
                except DeltaRefused as e:  # received whole, applied to nothing
                    return self._loaded(time.time(), version, str(e))
                held = self._stream.load(lambda: (self._apply(receiver.tensors(), version), self._held())[1])
            self._generating_again()
            return self._loaded(t0, version, held=held)
        try:
            t0 = receiver.receive(version, self.deltas.held_fp)
        except DeltaRefused as e:  # received whole, applied to nothing
            return self._loaded(time.time(), version, str(e))
        if receiver.model is None:
            self._apply(receiver.tensors(), version)
        else:
            self.engine.version = int(version)
            self.engine.reset_cache()
        return self._loaded(t0, version)
