"""Whether vLLM can serve here, and this model: vLLM imports, its CPU backend serves the model's
attention head size, and the checkpoint's tensor shapes that a weight reload is checked against."""

from __future__ import annotations

import json
import os
from pathlib import Path

from offstep.rollout.engines import vllm_internals

CPU_HEAD_SIZES = vllm_internals.CPU_HEAD_SIZES


def vllm_unavailable_reason() -> str | None:
    """``None`` if ``import vllm`` works, else why not (for skips and config checks)."""
    # vLLM logs every request's and every load's progress at INFO; a run keeps its warnings. Read
    # when vllm is first imported; a value the user set wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (e.g. a CUDA torchvision)
        return f"vllm cannot be imported ({type(exc).__name__}: {exc})"
    return None


def attention_head_dim_problem(model_path: str | os.PathLike, device: str = "cpu") -> str | None:
    """Why vLLM's ``device`` backend cannot serve the model in ``model_path``, judged from its
    ``config.json`` (``None``: no known problem). Only the CPU backend's head sizes are checked."""
    cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
    if device == "cpu" and head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        return (
            f"attention head size {head_dim} is not one that vLLM-CPU serves ({', '.join(map(str, CPU_HEAD_SIZES))}); "
            "use rollout.engine=builtin for this model"
        )
    return None


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face folder's safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors checkpoint; vLLM's weight reload checks names against it")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes
