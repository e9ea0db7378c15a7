"""The fallback forward of the rollout engine: the model's own forward over a transformers
``DynamicCache``, for architectures the slot runner (``offstep.rollout.engines.llama_runner``) does not
serve (sliding-window or hybrid attention, q/k norms, ...).

A static batch of rows decodes together: the unique prompts of the batch are prefilled once,
left-padded, and each row gets a copy of its prompt's cache; rows that finish are dropped from
the cache (``HFBatch.select``). The scheduling (which rows form a batch, sampling, when a row
finishes) is ``offstep.rollout.engines.torch_engine``'s.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from offstep.models.vision import ImageInputs, concat_images, mrope_positions

__all__ = ["HFBatch", "HFRunner"]


class HFBatch:
    """Decoding state of a static batch: the KV cache, the attention mask ``[B, T]`` (0 on left
    padding) and the position ``[B]`` of each row's next token."""

    __slots__ = ("cache", "mask", "next_pos")

    def __init__(self, cache, mask: Tensor, next_pos: Tensor):
        self.cache = cache
        self.mask = mask
        self.next_pos = next_pos

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` (a long tensor on the device), in that order."""
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]


class HFRunner:
    """Prefill and decode steps of a transformers causal LM over its own KV cache; ``pad_id`` fills
    the left padding of shorter prompts."""

    def __init__(self, model: torch.nn.Module, pad_id: int, device: torch.device):
        self.model = model
        self.pad_id = pad_id
        self.device = device
        # transformers >= 5.24 names the forward's KV-cache argument `cache` (`past_key_values` is deprecated).
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(
        self, prompts: list[list[int]], expand: list[int], images: list[ImageInputs | None] | None = None
    ) -> tuple[Tensor, HFBatch]:
        """Prefill ``prompts`` once (left-padded) and give batch row ``r`` the cache of prompt
        ``expand[r]``. Returns the next-token logits ``[len(expand), V]`` (float32) and the batch.
        ``images[u]``: prompt ``u``'s images (a vision-language model), whose positions are 3-D;
        decoding then goes on with 1-D positions, which the model broadcasts (text after the images)."""
        from transformers.cache_utils import DynamicCache

        dev = self.device
        plen = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), plen), dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, plen - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[u, plen - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        pics = concat_images(images or [], dev)
        if pics is None:
            pos = (mask.cumsum(-1) - 1).clamp_(min=0)
            logits = self._forward(ids, mask, pos, cache)
            next_pos = pos[:, -1] + 1
        else:
            pos, next_pos = mrope_positions(self.model, ids, mask, pics.grid_thw)
            logits = self._forward(ids, mask, pos, cache, pixel_values=pics.pixel_values, image_grid_thw=pics.grid_thw)

        # ---- one cache row per batch row
        rows = torch.tensor(expand, dtype=torch.long, device=dev)
        if len(expand) != len(prompts) or not torch.equal(rows, torch.arange(len(expand), device=dev)):
            cache.batch_select_indices(rows)
            logits, mask, next_pos = logits[rows], mask[rows], next_pos[rows]
        return logits, HFBatch(cache, mask, next_pos)

    def decode(self, batch: HFBatch, tokens: Tensor) -> Tensor:
        """Feed one token ``[B]`` per row; returns the next-token logits ``[B, V]`` (float32)."""
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], dim=1)
        logits = self._forward(tokens[:, None], batch.mask, batch.next_pos[:, None], batch.cache)
        batch.next_pos = batch.next_pos + 1
        return logits

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache, **images) -> Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **images,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1, :].float()
