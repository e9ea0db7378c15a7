"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) with ``peft``, shared by the trainer, the rollout
engines, export and the config check.

One model holds the base weights and the adapters: the actor trains the adapters only, the rollout
engine holds the same peft modules and receives the adapters at every sync, and the reference
policy is that model with its adapters switched off (``peft``'s ``disable_adapter``), so no second
copy of the base weights is ever loaded for LoRA.

Names. Adapter tensors travel under the names the peft model gives them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``), identical on both
ends since both build the model with :func:`add_adapters`; :func:`file_names` turns them into the
names of a peft folder's ``adapter_model.safetensors`` (the adapter name dropped), which
``PeftModel.from_pretrained`` and vLLM read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from offstep.config.schema import LoRAConfig
from offstep.errors import ModelError

if TYPE_CHECKING:
    import torch

ADAPTER = "default"  # peft's name for the one adapter
# A vision-language model's vision tower (``model.visual``; Qwen2.5-VL's blocks have gate/up/down_proj as
# its language model does): no adapter goes there, the default target modules included.
VISION_TOWER = r"(.*\.)?visual\..*"
ADAPTER_CONFIG = "adapter_config.json"
_LORA_PARAM = re.compile(r"\.lora_[AB]\.")


def peft_config(cfg: LoRAConfig, base_path: str | None = None, vision: bool = False):
    """``peft.LoraConfig`` for ``actor.lora`` (bias untouched, no modules saved besides the adapters);
    ``vision``: a vision-language model, whose vision tower gets no adapters (``VISION_TOWER``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
        exclude_modules=VISION_TOWER if vision else None,
    )


def _has_tower(model_or_folder) -> bool:
    from offstep.models.vision import is_vision_language

    if model_or_folder is None or isinstance(model_or_folder, (str, Path)):
        return model_or_folder is not None and is_vision_language(model_or_folder)
    return is_vision_language(getattr(base_of(model_or_folder), "config", None))


def add_adapters(model: torch.nn.Module, cfg: LoRAConfig, base_path: str | None = None) -> torch.nn.Module:
    """``model`` wrapped by peft with fresh adapters (A random, B zero: the policy is still the
    base's). The random draw of A uses torch's generator: seed it the same on every rank."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(cfg, base_path, _has_tower(model)))


def is_adapter_name(name: str) -> bool:
    return bool(_LORA_PARAM.search(name))


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every LoRA A and B matrix, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def file_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under the names of a peft folder (``...q_proj.lora_A.weight``)."""
    return {n.replace(f".{ADAPTER}.", "."): t for n, t in state_dict.items()}


def target_problems(model: torch.nn.Module, cfg: LoRAConfig) -> list[str]:
    """What is wrong with ``actor.lora`` for ``model`` (a model on the meta device will do):
    target modules that match no linear layer, or a rank larger than a matched layer's width."""
    import torch
    from peft.tuners.tuners_utils import check_target_module_exists

    vision = _has_tower(model)
    config = peft_config(cfg, vision=vision)
    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not (vision and re.fullmatch(VISION_TOWER, n))
    }
    matched = {n: m for n, m in linears.items() if check_target_module_exists(config, n)}
    problems = []
    where = "the language model (the vision tower gets no adapters)" if vision else "the model"
    for target in cfg.target_modules:
        if not any(n == target or n.endswith("." + target) for n in matched):
            names = sorted({n.rsplit(".", 1)[-1] for n in linears})
            problems.append(
                f"actor.lora.target_modules entry {target!r} matches no linear layer of {where}; its "
                f"linear layers are named {names}"
            )
    too_narrow = sorted(
        {
            (n.rsplit(".", 1)[-1], min(m.in_features, m.out_features))
            for n, m in matched.items()
            if min(m.in_features, m.out_features) < cfg.rank
        },
        key=lambda item: item[1],
    )
    if too_narrow:
        layers = ", ".join(f"{name} ({width})" for name, width in too_narrow)
        problems.append(
            f"actor.lora.rank={cfg.rank} is larger than the width (the smaller of in/out features) of "
            f"these target layers: {layers}; a rank beyond a layer's width adds parameters and no "
            f"capacity. Use actor.lora.rank <= {too_narrow[0][1]}, or leave those layers out of "
            f"actor.lora.target_modules"
        )
    return problems


def meta_model(folder: str, cfg: LoRAConfig | None = None) -> torch.nn.Module:
    """The model of ``folder`` on the meta device (no weights read), with adapters for ``cfg``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from offstep.models.builtin import quiet_transformers
    from offstep.models.vision import is_vision_language

    auto = AutoModelForImageTextToText if is_vision_language(folder) else AutoModelForCausalLM
    with quiet_transformers(), torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(folder))
        return model if cfg is None else add_adapters(model, cfg)


def check_for_model(folder: str, cfg: LoRAConfig) -> list[str]:
    """:func:`target_problems` for the model folder ``folder``."""
    return target_problems(meta_model(folder), cfg)


def adapter_shapes(folder: str, cfg: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every adapter tensor the trainer's peft model of ``folder`` has (built on
    the meta device): what an engine that does not hold a peft model (vLLM) expects at a sync."""
    return {n: tuple(p.shape) for n, p in adapter_parameters(meta_model(folder, cfg))}


def write_adapter_folder(
    out: str | Path, adapters: Mapping[str, torch.Tensor], cfg: LoRAConfig, base_path: str
) -> None:
    """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) from the
    adapter tensors under the peft model's names: what ``PeftModel.from_pretrained`` and vLLM load."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(cfg, base_path, _has_tower(base_path)).save_pretrained(str(out))
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in file_names(adapters).items()},
        str(out / "adapter_model.safetensors"),
    )


# ------------------------------------------------------------------ peft folders
def is_adapter_folder(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter folder names (``base_model_name_or_path``)."""
    cfg = json.loads((Path(path).expanduser() / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str) or not base:
        raise ModelError(f"{Path(path) / ADAPTER_CONFIG} names no base_model_name_or_path")
    return base


def merged_model(path: str | Path, base: torch.nn.Module) -> torch.nn.Module:
    """The base model with the adapter folder ``path`` merged into its weights (a plain model)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(path)).merge_and_unload()
