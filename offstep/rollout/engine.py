"""Rollout engines: the protocol, and the built-in PyTorch engine over a transformers causal LM.

``TorchEngine`` generates with a KV cache: the unique prompts of a sub-batch are prefilled once
(left-padded, with attention mask and position ids), their cache rows are repeated for the ``n``
samples, then tokens are decoded one at a time. Rows that finish leave the batch (the cache and
all per-row state are compacted), so finished samples cost nothing and cannot influence the
others.

Randomness: every sample ``i`` (prompt-major index over ``prompt x n``) draws its uniforms from its
own ``torch.Generator`` seeded from ``(seed, i)``; a token is sampled on the device by inverting the
CDF of the final (temperature/top-k/top-p) distribution with that uniform. A sample's random stream
therefore does not depend on the batch it shares, on ``max_batch_size``, on when the others finish,
or on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from offstep.rollout.types import Completion, SamplingParams

__all__ = ["RolloutEngine", "TorchEngine", "sample_tokens"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker needs from an inference engine."""

    version: int

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[Completion], None] | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt, prompt-major; call ``on_finish`` as each finishes."""
        ...

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy new policy weights in place and record their version (resets any cache)."""
        ...

    def reset_cache(self) -> None:
        """Drop any cached state (KV / prefix cache) that depends on the weights."""
        ...


# --------------------------------------------------------------------------------------------------
# sampling


def sample_tokens(logits: Tensor, params: SamplingParams, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Sample one token per row and return ``(tokens, logprobs)``.

    ``logits`` is ``[B, V]`` float32; ``uniforms`` is ``[B]`` float64 in ``[0, 1)`` (ignored when greedy).
    The log-prob is that of the sampled token under the final distribution (temperature, top-k, top-p
    applied); for greedy decoding (``temperature == 0``) it is under the untempered softmax.
    """
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the most likely token is always kept).
        sorted_x = sorted_x.masked_fill(mass_before >= params.top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    tokens = _inverse_cdf(probs, uniforms.to(device=probs.device, dtype=torch.float64))
    chosen = probs.gather(-1, tokens[:, None]).squeeze(-1)
    bad = chosen <= 0  # only reachable through float rounding at the very top of the CDF
    if bool(bad.any()):
        tokens = torch.where(bad, probs.argmax(dim=-1), tokens)
        chosen = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, torch.log(chosen)


_CDF_BLOCK = 256


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Index ``i`` per row with ``cdf[i - 1] <= u * total < cdf[i]``, in two levels.

    A float64 cumulative sum over the whole vocabulary costs several times the softmax; summing blocks
    of 256 probabilities first and then scanning only the selected block is exact enough (float64
    accumulation) and ~5x cheaper on CPU.
    """
    b, v = probs.shape
    nb = -(-v // _CDF_BLOCK)
    if nb * _CDF_BLOCK != v:
        probs = torch.nn.functional.pad(probs, (0, nb * _CDF_BLOCK - v))
    blocks = probs.view(b, nb, _CDF_BLOCK)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]
    target = (u * block_cdf[:, -1])[:, None]
    bidx = torch.searchsorted(block_cdf, target, right=True).clamp_(max=nb - 1)  # [B, 1]
    before = torch.where(bidx > 0, block_cdf.gather(-1, (bidx - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, bidx[:, :, None].expand(b, 1, _CDF_BLOCK)).squeeze(1).to(torch.float64).cumsum(-1)
    rest = torch.minimum(target - before, inner[:, -1:] * (1 - 1e-12))  # stay inside the chosen block
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=_CDF_BLOCK - 1)
    return (bidx * _CDF_BLOCK + j).squeeze(-1).clamp_(max=v - 1)


def _mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread 63-bit seeds for per-sample generators."""
    mask = (1 << 64) - 1
    z = (int(seed) * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------------
# KV cache


def _make_cache_classes():
    """A DynamicLayer variant that writes into a pre-allocated buffer (no per-step concatenation).

    The buffer starts at ``capacity`` positions and doubles when full, up to ``limit`` (prompt +
    ``max_new_tokens``), so short answers to a long ``max_new_tokens`` do not reserve the worst case.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int, limit: int):
            super().__init__()
            self.capacity = int(capacity)
            self.limit = max(int(limit), self.capacity)
            self.length = 0
            self._kbuf: Tensor | None = None
            self._vbuf: Tensor | None = None

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h = key_states.shape[:2]
            cap = max(self.capacity, key_states.shape[-2])
            self._kbuf = key_states.new_empty((b, h, cap, key_states.shape[-1]))
            self._vbuf = value_states.new_empty((b, value_states.shape[1], cap, value_states.shape[-1]))
            self.length = 0
            self.is_initialized = True

        def _views(self) -> None:
            self.keys = self._kbuf[:, :, : self.length]
            self.values = self._vbuf[:, :, : self.length]

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self._kbuf.shape[2]:  # grow geometrically, up to the limit
                new_cap = max(end, min(2 * self._kbuf.shape[2], self.limit))
                for name in ("_kbuf", "_vbuf"):
                    old = getattr(self, name)
                    new = old.new_empty((*old.shape[:2], new_cap, old.shape[3]))
                    new[:, :, : self.length] = old[:, :, : self.length]
                    setattr(self, name, new)
            self._kbuf[:, :, self.length : end] = key_states
            self._vbuf[:, :, self.length : end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def batch_select_indices(self, indices: Tensor) -> None:
            if not self.is_initialized:
                return
            for name in ("_kbuf", "_vbuf"):
                old = getattr(self, name)
                new = old.new_empty((indices.numel(), *old.shape[1:]))
                new[:, :, : self.length] = old[indices, :, : self.length]
                setattr(self, name, new)
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                idx = torch.arange(self._kbuf.shape[0], device=self._kbuf.device).repeat_interleave(repeats)
                self.batch_select_indices(idx)

        def reorder_cache(self, beam_idx: Tensor) -> None:
            self.batch_select_indices(beam_idx)

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop expects a negative number of tokens to remove")
            if self.is_initialized and tokens_to_remove < 0:
                self.length = max(0, self.length + tokens_to_remove)
                self._views()

        def reset(self) -> None:
            self._kbuf = self._vbuf = None
            self.length = 0
            super().reset()

    return DynamicCache, PreallocatedLayer


_CACHE_CLASSES: tuple[Any, Any] | None = None


def _cache_classes():
    global _CACHE_CLASSES
    if _CACHE_CLASSES is None:
        _CACHE_CLASSES = _make_cache_classes()
    return _CACHE_CLASSES


# --------------------------------------------------------------------------------------------------
# engine


class _Row:
    """Decoding state of one sample."""

    __slots__ = ("index", "prompt_index", "tokens", "logprobs")

    def __init__(self, index: int, prompt_index: int):
        self.index = index
        self.prompt_index = prompt_index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []


class TorchEngine:
    """Batched KV-cache generation with a transformers causal LM (CPU or CUDA).

    ``model`` is moved to ``device`` and put in eval mode. ``eos_ids`` end a sample (the eos token is
    kept in ``response_ids``). At most ``max_batch_size`` sequences are decoded together.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_ids: Sequence[int],
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
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
        self._prealloc = self._full_attention_only()

    # ---------------------------------------------------------------- public API

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        on_finish: Callable[[Completion], None] | None = None,
    ) -> list[Completion]:
        """Sample ``params.n`` completions for each prompt.

        Returns ``len(prompts) * params.n`` completions ordered prompt-major (prompt 0 samples
        ``0..n-1``, then prompt 1, ...). ``on_finish`` is called with each completion (the same object
        as in the returned list) as soon as it finishes. The same ``seed`` and inputs give the same
        outputs.
        """
        self._check(prompts, params)
        n = params.n
        order = [(pi * n + j, pi) for pi in range(len(prompts)) for j in range(n)]
        # Group similar prompt lengths into the same sub-batch (less padding); stable, so each prompt's
        # samples stay together. Results go back to prompt-major order below.
        order.sort(key=lambda item: len(prompts[item[1]]))
        results: list[Completion | None] = [None] * len(order)
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling, even if someone switched the module to train()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), self.max_batch_size):
                    chunk = order[start : start + self.max_batch_size]
                    rows = [_Row(i, pi) for i, pi in chunk]
                    uniforms = self._uniforms(rows, params, seed)
                    for c, row in self._generate_chunk(prompts, rows, params, uniforms):
                        results[row.index] = c
                        if on_finish is not None:
                            on_finish(c)
        finally:
            if was_training:
                self.model.train()
        return results  # type: ignore[return-value]

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

    def reset_cache(self) -> None:
        """No cache outlives a ``generate`` call; this releases cached device memory on CUDA."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- internals

    def _full_attention_only(self) -> bool:
        cfg = getattr(self.model, "config", None)
        if cfg is None:
            return False
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            return False
        if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
            return False
        return True

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if params.n < 1:
            raise ValueError(f"SamplingParams.n={params.n} must be >= 1")
        if params.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={params.temperature} must be >= 0 (0: greedy)")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={params.top_p} must be in (0, 1]")
        if params.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={params.top_k} must be >= 0 (0: disabled)")
        if params.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens} must be >= 0")
        if isinstance(params.stop, str):
            raise ValueError("SamplingParams.stop must be a tuple of strings, not a string")
        if any(not s for s in params.stop):
            raise ValueError("SamplingParams.stop contains an empty string")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"prompt {i} has token id {bad} outside the model's vocabulary [0, {self.vocab_size})")

    def _uniforms(self, rows: list[_Row], params: SamplingParams, seed: int) -> Tensor:
        steps = max(1, params.max_new_tokens)
        if params.temperature == 0:
            return torch.zeros((len(rows), steps), dtype=torch.float64, device=self.device)
        out = torch.empty((len(rows), steps), dtype=torch.float64)
        gen = torch.Generator()
        for r, row in enumerate(rows):
            gen.manual_seed(_mix_seed(seed, row.index))
            out[r] = torch.rand(steps, generator=gen, dtype=torch.float64)
        return out.to(self.device)

    def _new_cache(self, prompt_len: int, max_new_tokens: int):
        cache_cls, layer_cls = _cache_classes()
        if not self._prealloc:
            return cache_cls(config=self.model.config)
        n_layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        cache = cache_cls()  # a DynamicCache (some models check for it) holding pre-allocated layers
        cache.layers = [
            layer_cls(prompt_len + min(max_new_tokens, 256), prompt_len + max_new_tokens) for _ in range(n_layers)
        ]
        cache.layer_class_to_replicate = None
        return cache

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache) -> Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()

    def _finish(self, row: _Row, reason: str) -> Completion:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return Completion(
            prompt_index=row.prompt_index,
            response_ids=row.tokens,
            logprobs=row.logprobs,
            finish_reason=reason,
            text=text,
            extra={"weight_version": self.version},
        )

    def _hits_stop(self, row: _Row, stops: tuple[str, ...], window: int) -> bool:
        # A stop string newly completed by the last token lies within the last `window` tokens (every
        # token decodes to >= 1 byte, a character is <= 4 bytes); decoding only that tail keeps the check
        # O(1) per step instead of O(length).
        tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _generate_chunk(self, prompts, rows: list[_Row], params: SamplingParams, uniforms: Tensor):
        dev = self.device
        if params.max_new_tokens == 0:
            for row in rows:
                yield self._finish(row, "length"), row
            return

        # ---- prefill the unique prompts of this chunk once
        unique: dict[int, int] = {}
        for row in rows:
            unique.setdefault(row.prompt_index, len(unique))
        uniq_prompts = [prompts[pi] for pi in unique]
        plen = max(len(p) for p in uniq_prompts)
        ids = torch.full((len(uniq_prompts), plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(uniq_prompts), plen), dtype=torch.long)
        for u, p in enumerate(uniq_prompts):
            ids[u, plen - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[u, plen - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = self._new_cache(plen, params.max_new_tokens)
        logits = self._forward(ids, mask, pos, cache)

        # ---- one cache row per sample
        expand = torch.tensor([unique[row.prompt_index] for row in rows], dtype=torch.long, device=dev)
        if len(rows) != len(uniq_prompts) or not torch.equal(expand, torch.arange(len(rows), device=dev)):
            cache.batch_select_indices(expand)
            logits = logits[expand]
            mask = mask[expand]
            pos = pos[expand]
        next_pos = pos[:, -1] + 1

        stops = tuple(params.stop)
        window = 4 * max((len(s) for s in stops), default=0) + 4
        active = list(range(len(rows)))  # chunk-local row numbers still decoding, in batch order
        for step in range(params.max_new_tokens):
            tokens, logps = sample_tokens(logits, params, uniforms[active, step])
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            keep: list[int] = []
            for b, r in enumerate(active):
                row = rows[r]
                t = tok_list[b]
                row.tokens.append(t)
                row.logprobs.append(lp_list[b])
                if t in self._eos_set or (stops and self._hits_stop(row, stops, window)):
                    yield self._finish(row, "stop"), row
                elif step + 1 == params.max_new_tokens:
                    yield self._finish(row, "length"), row
                else:
                    keep.append(b)
            if not keep:
                return
            if len(keep) != len(active):
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(sel)
                tokens, mask, next_pos = tokens[sel], mask[sel], next_pos[sel]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
