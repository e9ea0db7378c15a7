"""Vision-language models (the Qwen2-VL family), shared by the built-in engine and the trainer.

offstep never builds Hugging Face's ``Qwen2VLProcessor``/``AutoProcessor``: both need torchvision (for
the video processor) even for images. A prompt's image placeholders are expanded in token space
instead (``offstep.data.images``), and the pixel values come from the image processor alone.

Positions are 3-D (mrope): ``mrope_positions`` always computes them explicitly, so the model never
falls back to its cached ``rope_deltas`` state. The vision special tokens are banned when sampling
and in the trainer's logits alike (``ban_vision_tokens``): a sampled ``<|image_pad|>`` would break
the next forward ("image features and image tokens do not match")."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offstep.models.vl_types import VL_MODEL_TYPES, is_vision_language  # noqa: F401 (their home for the heavy side)

if TYPE_CHECKING:
    import torch

_VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class ImageInputs:
    """One prompt's images as the vision tower takes them: ``pixel_values`` ``[patches, C*T*p*p]`` and
    ``grid_thw`` ``[images, 3]`` (long)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor


def load_image_processor(folder: str | os.PathLike):
    """The image processor of a vision-language model folder (the Pillow backend when torchvision is
    missing); ``None`` for a text model."""
    if not is_vision_language(folder):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(os.fspath(folder))


def vision_token_ids(config: Any) -> list[int]:
    """The ids of the vision special tokens of a (VL) config, which no response may contain; ``[]``
    for a text model."""
    if config is None or not is_vision_language(config):
        return []
    return sorted({int(v) for k in _VISION_TOKEN_KEYS if (v := getattr(config, k, None)) is not None})


def ban_vision_tokens(logits: torch.Tensor, banned: Sequence[int]) -> torch.Tensor:
    """``logits [..., V]`` with the ``banned`` ids set to the dtype's minimum, in place. The minimum,
    not -inf: ``softmax * logits`` (the entropy) stays finite. Apply it after any temperature division."""
    if banned:
        import torch

        logits[..., list(banned)] = torch.finfo(logits.dtype).min
    return logits


def pixel_inputs(image_processor, images: Sequence[bytes]) -> ImageInputs | None:
    """The processor's pixel values and grids of a prompt's (already fitted) image files; ``None``
    for no images."""
    if not images:
        return None
    from PIL import Image

    pics = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    out = image_processor(images=pics, return_tensors="pt")
    return ImageInputs(out["pixel_values"], out["image_grid_thw"].long())


def concat_images(items: Sequence[ImageInputs | None], device=None) -> ImageInputs | None:
    """The images of several rows in row order (the order the model consumes them in); ``None`` if
    no row has any."""
    import torch

    have = [x for x in items if x is not None]
    if not have:
        return None
    pv = torch.cat([x.pixel_values for x in have])
    grid = torch.cat([x.grid_thw for x in have])
    return ImageInputs(pv.to(device) if device is not None else pv, grid.to(device) if device is not None else grid)


def mrope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: torch.Tensor | None):
    """3-D positions ``[3, B, L]`` of left-padded rows (their images' grids in row order) and the
    position of each row's next token ``[B]``. ``model``: the transformers VL model (its ``.model``
    has ``get_rope_index``, plain Python over the config)."""
    inner = model.model
    image_id = int(model.config.image_token_id)
    pos, _ = inner.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == image_id).int(),
        image_grid_thw=grids,
        attention_mask=attention_mask,
    )
    pos = pos.to(input_ids.device)
    return pos, pos.max(0).values[:, -1] + 1


def vision_tower(model):
    """A VL transformers model's vision tower (``model.model.visual``; a peft model's base's), or None.
    (``offstep.models.lora`` imports this module: peft's ``get_base_model`` is called here directly.)"""
    get = getattr(model, "get_base_model", None)
    base = get() if callable(get) else model
    return getattr(getattr(base, "model", None), "visual", None)


def freeze_vision_tower(model) -> int:
    """Stop the vision tower of ``model`` from training (``actor.freeze_vision_tower``): its parameters
    get no gradient, so the optimizer (built over the parameters that train) holds no state for them
    and a checkpoint leaves them out. Returns how many parameters it froze; raises ``ValueError`` for a
    model without a tower."""
    visual = vision_tower(model)
    if visual is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (model.visual) to freeze")
    visual.requires_grad_(False)
    return sum(1 for _ in visual.parameters())


def unused_tower_term(model):
    """``0 * sum(vision tower weights)`` of a VL model whose tower trains, to add to the loss of a
    micro-batch without images: every tower weight then gets a (zero) gradient. Under FSDP a rank
    whose micro-batch had no image would otherwise reduce fewer gradients than the others, and the
    collective would fail. ``None`` for a text model or a frozen tower."""
    visual = vision_tower(model)
    params = [p for p in visual.parameters() if p.requires_grad] if visual is not None else []
    if not params:
        return None
    return 0.0 * sum(p.sum() for p in params)


def decoder_layers(model) -> Sequence:
    """The decoder layers of a transformers LM (``model.model.layers``), or of a VL model's language
    model (``model.model.language_model.layers``). A VL model's vision blocks are left to the root
    FSDP unit: a rank whose micro-batch has no image skips the tower, and its own all-gathers would hang."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
