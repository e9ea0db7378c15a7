"""A rollout replica's sleep (``rollout.sleep_during_update``): in the colocated synchronous layout
the replica frees its device memory while the trainer runs its passes and its update on the same
devices, and takes it back for the weight load that follows, as verl's hybrid engine does with
vLLM's sleep mode. The engine does the freeing (``RolloutEngine.sleep``/``wake_up``); this keeps
the state: a second sleep does nothing, a load wakes the weights before it writes into them and
the KV cache after, and a generation that reaches a sleeping replica wakes it first."""

from __future__ import annotations

import time

import torch

from offstep.batch import Span
from offstep.rollout.engines.interface import RolloutEngine

PARTS = ("weights", "kv_cache")  # what a sleep frees, in the order a load wakes them


class SleepState:
    """The sleep of one replica's engine, and of the reference copy beside it
    (``pipeline.ref_on_rollout``), which on a GPU moves to CPU memory with the engine's weights."""

    def __init__(self, engine: RolloutEngine, ref_model: torch.nn.Module | None, device: torch.device):
        self.engine, self.ref_model, self.device = engine, ref_model, device
        self.asleep: tuple[str, ...] = ()  # the parts freed and not yet taken back
        self.weights_lost = False  # the sleep discarded the weights: a load must come before a generation
        self._woke: list[Span] = []  # wakes not yet reported (take_wakes)

    def sleep(self) -> Span | None:
        """Free the engine's device memory; ``None`` when it is asleep already."""
        if self.asleep:
            return None
        t0 = time.time()
        self.weights_lost = not self.engine.sleep()
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = PARTS
        return Span(t0, time.time(), self.engine.version)

    def wake(self, parts: tuple[str, ...] = PARTS) -> None:
        """Take back the sleeping ones of ``parts`` (its span is kept for :meth:`take_wakes`)."""
        todo = tuple(p for p in self.asleep if p in parts)
        if not todo:
            return
        t0 = time.time()
        self.engine.wake_up(todo)
        if "weights" in todo and self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to(self.device)
        self.asleep = tuple(p for p in self.asleep if p not in todo)
        self._woke.append(Span(t0, time.time(), self.engine.version))

    def before_generation(self) -> None:
        """Wake a sleeping engine before it generates; refuse when its weights were discarded and
        no load has filled them since (it would sample from uninitialised memory)."""
        if self.weights_lost:
            raise RuntimeError(
                f"rollout replica asked to generate after its sleep discarded the weights (vLLM sleep "
                f"level 2) and before a weight load filled them again (version {self.engine.version})"
            )
        self.wake()

    def loaded(self) -> tuple[Span, ...]:
        """After a weight load: the weights hold a policy again; the KV cache wakes too. Returns the
        wakes since the last report (a generation's included)."""
        self.weights_lost = False
        self.wake()
        woke, self._woke = tuple(self._woke), []
        return woke
