"""The built-in rollout engine: the scheduler of a PyTorch engine over a transformers causal LM,
implementing ``offstep.rollout.engines.interface.RolloutEngine``.

``TorchEngine`` schedules with **continuous batching** (Orca, Yu et al., OSDI 2022; vLLM, Kwon et
al., SOSP 2023) on Llama-family models: up to ``max_batch_size`` samples occupy the slots of a
pre-allocated KV cache; every step is one forward pass that decodes one token for each running
slot and, in the same pass, prefills the prompts admitted into slots that freed up (packed, no
padding; a prompt is prefilled once for the samples admitted together). A sample that finishes
releases its slot at once: the last running slot is moved into the hole, so the running batch stays
dense, and a waiting sample takes the free slot at the next step. When all prompts of a call start
with the same tokens (a system prompt, a chat-template header), that prefix is prefilled once and
its K/V copied into each admitted slot (the idea of vLLM's automatic prefix caching and SGLang's
RadixAttention, Zheng et al., 2024, reduced to the one longest common prefix of the call). The
forward pass over slots is ``offstep.rollout.engines.llama_runner``; the two decode loops (this one and
the fallback's) are ``offstep.rollout.engines.schedule``.

Other architectures (sliding-window or hybrid attention, q/k norms, ...) use the fallback: the
model's own forward with a transformers ``DynamicCache`` (``offstep.rollout.engines.hf_runner``), in static
sub-batches of ``max_batch_size`` samples (unique prompts prefilled once, left-padded; finished rows
leave the batch).

Sampling, and the per-sample random streams that make a sample's tokens independent of the batch
it shares, are ``offstep.rollout.engines.sampling``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from offstep.models.forward import sequence_logprobs
from offstep.models.lora import adapter_parameters, base_of, is_adapter_name
from offstep.models.vision import vision_token_ids
from offstep.rollout.engines import schedule
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.hf_runner import HFRunner
from offstep.rollout.engines.interface import RolloutEngine
from offstep.rollout.engines.llama_runner import LlamaRunner, unsupported_reason
from offstep.rollout.engines.plain_generation import serve_prompts
from offstep.rollout.engines.schedule import Row
from offstep.rollout.types import Completion, SamplingParams, TurnFeed, check_request
from offstep.sync.collective import manifest
from offstep.sync.digest import WeightDigest, digest_of

_log = logging.getLogger(__name__)

__all__ = ["RolloutEngine", "TorchEngine"]


RUNNERS = ("auto", "slots", "hf")


class TorchEngine:
    """Batched KV-cache generation with a transformers causal LM (CPU or CUDA).

    ``model`` is moved to ``device`` and put in eval mode. ``eos_ids`` end a sample (the eos token is
    kept in ``response_ids``). At most ``max_batch_size`` sequences are decoded together.
    ``runner``: ``"slots"`` continuous batching over a slot KV cache (Llama-family models only),
    ``"hf"`` the model's own forward in static sub-batches, ``"auto"`` (default) the first when the
    model supports it and its forward matches the model's on a short check input. The slot runner
    regroups each layer's q/k/v and gate/up weights into one storage (the parameters become views
    of it: the model's own forward and ``state_dict`` are unchanged).
    """

    min_shared_prefix: int = 8  # tokens; a shorter common prompt prefix is not worth its own forward

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_ids: Sequence[int],
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        runner: str = "auto",
        merge_adapters: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r} must be one of {RUNNERS}")
        eos = [int(e) for e in eos_ids]
        if not eos:
            raise ValueError("eos_ids is empty; pass at least the tokenizer's eos token id")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.eos_ids: list[int] = list(dict.fromkeys(eos))
        self._eos_set = frozenset(self.eos_ids)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id: int = int(pad) if pad is not None else self.eos_ids[0]
        self.max_batch_size = int(max_batch_size)
        self.version: int = 0
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        self.banned_ids: list[int] = vision_token_ids(base_of(self.model).config)  # never sampled
        # LoRA: ``model`` may be a peft model (offstep.models.lora); the runners call the
        # transformers model inside it, whose target layers add the adapters' low-rank term.
        self._runner: LlamaRunner | None = self._pick_runner(runner)
        # The model's own forward, for models the slot runner does not serve.
        self._fallback = HFRunner(base_of(self.model), self.pad_id, self.device) if self._runner is None else None
        self.merge_adapters = merge_adapters
        self._merged = False

    @property
    def runner(self) -> str:
        """The forward path in use: ``"slots"`` (continuous batching) or ``"hf"``."""
        return "slots" if self._runner is not None else "hf"

    # ---------------------------------------------------------------- public API

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[Completion], None] | None = None,
        images: list | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions for each prompt.

        Returns ``len(prompts) * params.n`` completions ordered prompt-major (prompt 0 samples
        ``0..n-1``, then prompt 1, ...). ``on_finish`` is called with each completion (the same object
        as in the returned list) as soon as it finishes. The same ``seed`` and inputs give the same
        outputs.
        """
        self._check(prompts, params)
        if images is not None and any(x is not None for x in images):
            if len(images) != len(prompts):
                raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts")
            if self._runner is not None:
                raise ValueError("image prompts need the HF runner (runner='hf' or 'auto' with a VL model)")
        return serve_prompts(self.serve, prompts, params, seed, on_finish, images)

    def serve(
        self,
        feed: TurnFeed,
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[int, Completion], None],
        control: StepControl | None = None,
    ) -> None:
        """Generate the requests of ``feed`` as they come, until it is exhausted; call
        ``on_finish(request index, completion)`` as each finishes (from this thread: a request it
        adds to the feed is taken at the next step). ``params.n`` is ignored (one completion per
        request); each request has its own token limit and random stream (``TurnRequest``).
        ``generate`` is this with the feed of its prompts. ``control``: weight loads and
        suspensions posted from other threads, carried out between two decode steps
        (``offstep.rollout.engines.control``); a feed that blocks must wake up when one is posted."""

        def emit(row: Row, reason: str) -> None:
            on_finish(row.index, self._finish(row, reason))

        was_training = self.model.training
        self.model.eval()  # no dropout while sampling, even if someone switched the module to train()
        try:
            with torch.inference_mode():
                if params.max_new_tokens == 0:
                    while (new := feed.take(1 << 30, block=True)) is not None:
                        if control is not None:
                            control.run_work()
                            control.run_suspend()
                            control.run_load()
                        for req in new:
                            emit(Row(req.index, req.group, 0), "length")
                elif self._runner is not None:
                    schedule.continuous(self, feed, params, seed, emit, control)
                else:
                    schedule.static(self, feed, params, seed, emit, control)
        finally:
            if control is not None:
                control.detach()
            if was_training:
                self.model.train()

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` (names as in ``model.state_dict()``) into the model in place.

        A tied parameter (e.g. ``lm_head.weight`` tied to the embeddings) may be absent as long as one
        of its names is present. Any other missing parameter, unknown name or shape mismatch raises
        ``KeyError``/``ValueError`` listing them, before anything is copied.
        """
        own = self.model.state_dict(keep_vars=True)
        param_names = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        unexpected = sorted(k for k in state_dict if k not in own)
        # Names sharing storage (tied weights) form one group; a group is satisfied by any one name.
        groups: dict[tuple, list[str]] = {}
        for name in param_names:
            t = own[name]
            groups.setdefault((t.device, t.data_ptr(), tuple(t.shape)), []).append(name)
        missing = sorted(
            name for names in groups.values() if not any(nm in state_dict for nm in names) for name in names
        )
        if missing or unexpected:
            raise KeyError(
                f"load_weights: state dict does not match the rollout model: missing {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''} ({len(missing)}), unexpected {unexpected[:20]}"
                f"{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)}); names must be those of "
                "model.state_dict() (strip wrapper prefixes such as 'module.' or '_orig_mod.')"
            )
        bad_shapes = [
            f"{k}: got {tuple(v.shape)}, model has {tuple(own[k].shape)}"
            for k, v in state_dict.items()
            if tuple(v.shape) != tuple(own[k].shape)
        ]
        if bad_shapes:
            raise ValueError("load_weights: shape mismatch: " + "; ".join(bad_shapes[:20]))
        with torch.no_grad():
            for k, v in state_dict.items():
                dst = own[k]
                dst.copy_(v.to(device=dst.device, dtype=dst.dtype, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = int(version)
        self.reset_cache()

    def weights_digest(self, specs: list) -> WeightDigest:
        """The digest of the weights the engine computes with, read from its parameters (LoRA
        adapters included) by the manifest's names (``offstep.sync.digest``)."""
        return digest_of(specs, self.model.get_parameter)

    def weight_manifest(self) -> list:
        """Every parameter of the model, as the collective weight path lays them out."""
        return manifest(self.model)

    def receive_in_place(self) -> torch.nn.Module:
        """The model: a collective receive writes into its parameters, which the runners read."""
        return self.model

    def base_logprobs(
        self,
        sequences: Sequence[tuple[list[int], list[int]]],
        temperature: float,
        compute_dtype: str = "float32",
        micro_batch_size: int = 8,
        images: Sequence | None = None,
    ) -> list[list[float]]:
        """The base model's teacher-forced log-probs (the adapters off), as the trainer's forward;
        ``images``: per sequence, its prompt's ``ImageInputs`` or None."""
        with self.adapters_disabled() as model:
            return sequence_logprobs(
                model, sequences, self.pad_id, self.device, temperature, compute_dtype, micro_batch_size, images=images
            )

    # ---------------------------------------------------------------- LoRA adapters
    def load_adapters(self, adapters: Mapping[str, Tensor], version: int) -> None:
        """Copy LoRA A/B matrices (the peft model's names, ``offstep.models.lora``) into the
        engine's adapters in place and record their version; the base weights stay as they are.

        Every adapter of the engine's model must be given, under its exact name and shape, or
        ``KeyError``/``ValueError`` says which are not, before anything is copied: an adapter that
        silently failed to arrive would leave the rollout generating with an older policy while
        every version tag said otherwise (verl issue 7495). With ``merge_adapters`` the adapters'
        product is merged into the base weights (one GEMM per layer per load, none per token), and
        unmerged before the next load; otherwise it is added at every forward as ``B(A x)``.
        """
        own = dict(adapter_parameters(self.model))
        if not own:
            raise KeyError(
                "load_adapters: the rollout model has no LoRA adapters (actor.lora.rank > 0 needs the "
                "rollout worker to build them too)"
            )
        missing, unexpected = sorted(set(own) - set(adapters)), sorted(set(adapters) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"load_adapters: the adapters do not match the rollout model's: missing {missing[:10]} "
                f"({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)})"
            )
        bad = [
            f"{k}: got {tuple(v.shape)}, model has {tuple(own[k].shape)}"
            for k, v in adapters.items()
            if tuple(v.shape) != tuple(own[k].shape)
        ]
        if bad:
            raise ValueError("load_adapters: shape mismatch: " + "; ".join(bad[:10]))
        with torch.no_grad():
            if self._merged:
                self.model.unmerge_adapter()
                self._merged = False
            for k, v in adapters.items():
                own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))
            if self.merge_adapters:
                self.model.merge_adapter()
                self._merged = True
        self.version = int(version)
        self.reset_cache()

    def adapter_manifest(self) -> list:
        """The adapters as the collective weight path lays them out (``offstep.sync.collective``)."""
        return manifest(self.model, is_adapter_name)

    @contextlib.contextmanager
    def adapters_disabled(self):
        """The base model, for the reference policy: the adapters switched off (unmerged first
        when merged) for the duration; a model without adapters is its own base."""
        if not hasattr(self.model, "disable_adapter"):
            yield self.model
            return
        merged = self._merged
        if merged:
            self.model.unmerge_adapter()
        try:
            with self.model.disable_adapter():
                yield base_of(self.model)
        finally:
            if merged:
                self.model.merge_adapter()

    def reset_cache(self) -> None:
        """No KV cache outlives a ``generate`` call (the slot runner reads the model's weights in
        place); this releases cached device memory on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sleep(self) -> bool:
        """On CUDA: the weights move to CPU memory and the allocator's cached blocks are released
        (no KV cache outlives a ``generate`` call). On CPU there is nothing to free: no buffer
        outlives a call, and the weights stay where they are. The weights survive (``True``)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
        self.reset_cache()
        return True

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """The weights back on the device (``"weights"``), fused again for the slot runner; the KV
        cache is allocated by each call, so ``"kv_cache"`` has nothing to do."""
        on_host = next(self.model.parameters()).device.type != self.device.type
        if on_host and (tags is None or "weights" in tags):
            self.model.to(self.device)
            if self._runner is not None:
                self._runner.regroup()

    def close(self) -> None:
        """Nothing outlives a call but the model, which the caller owns; releases cached device memory."""
        self.reset_cache()

    # ---------------------------------------------------------------- checks

    def _pick_runner(self, runner: str) -> LlamaRunner | None:
        if runner == "hf":
            return None
        reason = unsupported_reason(base_of(self.model))
        if reason is None:
            slot_runner = LlamaRunner(base_of(self.model))
            reason = self._verify_runner(slot_runner)
            if reason is None:
                return slot_runner
        if runner == "slots":
            raise ValueError(f"runner='slots' cannot serve this model: {reason}; use runner='auto' or 'hf'")
        _log.info("offstep engine: continuous batching unavailable (%s); using the model's forward", reason)
        return None

    @torch.inference_mode()
    def _verify_runner(self, slot_runner: LlamaRunner) -> str | None:
        """Compare the slot forward with the model's own forward on a short input: a prefix prefilled
        into one slot and moved to another, the rest of the prompt prefilled after it, one decode step."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(6)]
        dev = self.device
        none = torch.zeros(0, dtype=torch.long, device=dev)
        was_training = self.model.training
        self.model.eval()
        try:
            want = base_of(self.model)(torch.tensor([ids], device=dev)).logits[0, -2:].float()
            cache = slot_runner.new_cache(2, 8, 8)
            slot_runner.step(cache, none, none, [ids[:3]], [[1]])
            cache.move(torch.tensor([1], device=dev), torch.tensor([0], device=dev), 3)
            first = slot_runner.step(cache, none, none, [ids[3:5]], [[0]], start=3)
            second = slot_runner.step(cache, torch.tensor([ids[5]], device=dev), torch.tensor([5], device=dev), [], [])
        finally:
            if was_training:
                self.model.train()
        got = torch.cat([first, second])
        err = float((got - want).abs().max())
        tol = (1e-3 if self.model.get_input_embeddings().weight.dtype == torch.float32 else 5e-2) * max(
            1.0, float(want.abs().max())
        )
        if not err <= tol:
            return f"its logits differ from the model's forward by {err:.3g} (tolerance {tol:.3g})"
        return None

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_request(prompts, params, self.vocab_size)

    # ---------------------------------------------------------------- shared helpers

    def _finish(self, row: Row, reason: str) -> Completion:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return Completion(
            prompt_index=row.prompt_index,
            response_ids=row.tokens,
            logprobs=row.logprobs,
            finish_reason=reason,
            text=text,
            extra={"weight_version": self.version, "kv_age": row.kv_age},
            versions=row.versions,
        )

    def _append(self, row: Row, token: int, logprob: float, params: SamplingParams, window: int) -> str | None:
        """Record one sampled token; return the finish reason if the sample ends here."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(self.version)
        if token in self._eos_set:
            return "stop"
        stop = params.stop if row.stop is None else row.stop
        if stop:
            if row.stop is not None:  # the row's own: the call's window does not cover them
                window = 4 * max(len(s) for s in stop) + 4
            # A stop string newly completed by the last token lies within the last `window` tokens
            # (every token decodes to >= 1 byte, a character is <= 4 bytes); decoding only that tail
            # keeps the check O(1) per step instead of O(length).
            tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
            if any(s in tail for s in stop):
                return "stop"
        if len(row.tokens) >= row.limit:
            return "length"
        return None
