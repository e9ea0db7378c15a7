"""Which models are vision-language ones offstep serves, from a config or a model folder's
``config.json`` alone: light enough for the checks that run before anything starts
(``offstep.data.vision_refusals``), so it imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_MAX_CONFIG_BYTES = 4 * 2**20  # a model's config.json is a few KB


def _folder_config(folder: str | os.PathLike) -> dict | None:
    """The folder's ``config.json`` as a mapping; None when there is none, or it is not a regular file
    (a FIFO, a device: never waited on), too large or not JSON. A link is followed: model folders
    (Hugging Face's cache among them) link their files."""
    try:
        fd = os.open(Path(folder) / "config.json", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_CONFIG_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            cfg = json.loads(f.read(_MAX_CONFIG_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return cfg if isinstance(cfg, dict) else None


def is_vision_language(config_or_folder: Any) -> bool:
    """Whether a config (or a model folder's config.json) is a vision-language model offstep serves."""
    if isinstance(config_or_folder, (str, os.PathLike)):
        cfg = _folder_config(config_or_folder)
        return cfg is not None and cfg.get("model_type") in VL_MODEL_TYPES
    return getattr(config_or_folder, "model_type", None) in VL_MODEL_TYPES
