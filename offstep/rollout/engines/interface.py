"""``RolloutEngine``: everything the rollout worker, its stream server and its agent loops call on
an inference engine. The built-in engine (``offstep.rollout.engines.torch_engine.TorchEngine``) and vLLM's
(``offstep.rollout.engines.vllm_engine.VLLMEngine``) implement all of it; where an engine cannot do
something, its method says so with an error. ``tests/rollout/test_engine_contract.py`` runs one suite over
both."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

    from offstep.rollout.engines.control import StepControl
    from offstep.rollout.types import Completion, SamplingParams, TurnFeed
    from offstep.sync.digest import WeightDigest

__all__ = ["RolloutEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker needs from an inference engine."""

    version: int  # the policy version of the weights it generates with
    max_batch_size: int  # sequences decoded together at most

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[Completion], None] | None = None,
        images: list | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt, prompt-major; call ``on_finish`` as each finishes.
        ``images``: per prompt, its ``offstep.models.vision.ImageInputs`` or None (the built-in engine only)."""
        ...

    def serve(
        self,
        feed: TurnFeed,
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[int, Completion], None],
        control: StepControl | None = None,
    ) -> None:
        """Generate the requests of ``feed`` as they come until it is exhausted, calling
        ``on_finish(request index, completion)`` as each finishes. ``control``: weight loads and
        suspensions carried out between two decode steps (``offstep.rollout.engines.control``; an engine
        that cannot raises ``NotImplementedError``)."""
        ...

    def base_logprobs(
        self,
        sequences: Sequence[tuple[list[int], list[int]]],
        temperature: float,
        compute_dtype: str = "float32",
        micro_batch_size: int = 8,
        images: Sequence | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each ``(prompt_ids, response_ids)``'s response under the
        engine's base model (with LoRA: the adapters off), the reference of the KL term.
        ``compute_dtype`` and ``micro_batch_size`` as the trainer's forward (an engine that
        batches by itself may ignore them). ``images``: per sequence, its prompt's
        ``offstep.models.vision.ImageInputs`` or None (the built-in engine only)."""
        ...

    # ---------------------------------------------------------------- weights
    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy new policy weights in place and record their version (resets any cache)."""
        ...

    def load_adapters(self, adapters: Mapping[str, Tensor], version: int) -> None:
        """Copy new LoRA adapters (the trainer's peft names) in and record their version; the base
        weights stay as they are."""
        ...

    def weight_manifest(self) -> list:
        """The tensors ``load_weights`` takes, as the collective weight path lays them out
        (``offstep.sync.collective.TensorSpec``)."""
        ...

    def adapter_manifest(self) -> list:
        """The same for ``load_adapters``."""
        ...

    def receive_in_place(self) -> nn.Module | None:
        """The module whose parameters a collective receive may write directly (its weights then
        change without ``load_weights``), or ``None``: received weights go through ``load_weights``."""
        ...

    def weights_digest(self, specs: list) -> WeightDigest:
        """The digest of the weights the engine now computes with, read back from it, over the
        sync manifest ``specs`` (``offstep.sync.digest``): what proves a sync arrived."""
        ...

    def reset_cache(self) -> None:
        """Drop any cached state (KV / prefix cache) that depends on the weights."""
        ...

    # ---------------------------------------------------------------- sleep (rollout.sleep_during_update)
    def sleep(self) -> bool:
        """Free the device memory the engine holds while a colocated trainer updates; no call but
        ``wake_up`` until it is awake again. Returns whether the weights survive the sleep (``False``:
        they are discarded, and a weight load must follow the wake before the engine generates)."""
        ...

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back what ``sleep`` freed: ``("weights",)`` first, for a load into them, then
        ``("kv_cache",)``; ``None``: all of it."""
        ...

    def close(self) -> None:
        """Release what the engine holds; it is unusable after."""
        ...
