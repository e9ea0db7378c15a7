"""The image spec (``offstep.data.images.ImageSpec``) of a vision-language model folder, from its
image processor and config (transformers; kept out of the light data modules)."""

from __future__ import annotations

import os

from offstep.data.images import ImageSpec


def image_spec(folder: str | os.PathLike) -> ImageSpec | None:
    """The image spec of a vision-language model folder; ``None`` for a text model."""
    from offstep.models.vision import load_image_processor

    ip = load_image_processor(folder)
    if ip is None:
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(os.fspath(folder))
    size = ip.size
    return ImageSpec(
        int(cfg.image_token_id), int(size["shortest_edge"]), int(size["longest_edge"]), ip.patch_size * ip.merge_size
    )
