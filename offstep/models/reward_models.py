"""Reward models on disk (``reward.model``): the checks made before any worker starts, and the
loading of a sequence-classification reward model with its own tokenizer.

Weights load only from safetensors, and a folder with its own Python code (``auto_map`` in
``config.json``) is refused unless ``reward.model.trust_remote_code`` allows it. Every message
names the key and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from offstep.errors import ModelError
from offstep.models.builtin import normalise_alias, quiet_transformers
from offstep.models.loading import check_model_path, resolve_model

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

KEY = "reward.model.path"


def _config(folder: Path, shown: str) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"{KEY}={shown!r}: config.json cannot be read ({exc}). Fix: re-save the model with `save_pretrained`"
        ) from exc
    if not isinstance(cfg, dict):
        raise ModelError(
            f"{KEY}={shown!r}: config.json is not a JSON object. Fix: re-save the model with `save_pretrained`"
        )
    return cfg


def _check_folder(folder: Path, shown: str, cfg: dict, trust_remote_code: bool) -> None:
    """safetensors weights, a tokenizer, and no code of its own unless allowed."""
    if cfg.get("auto_map") and not trust_remote_code:
        raise ModelError(
            f"{KEY}={shown!r} ships its own model code (auto_map in config.json), which loading would run. "
            f"Fix: set reward.model.trust_remote_code=true if you trust its source, or use a folder of a "
            f"transformers architecture"
        )
    if not any(folder.glob("*.safetensors")):
        bins = sorted(p.name for p in folder.glob("*.bin"))
        raise ModelError(
            f"{KEY}={shown!r} has no safetensors weights{f' (only {bins})' if bins else ''}; reward models "
            f"load from safetensors only (a .bin file can run code). Fix: re-save it with "
            f"`save_pretrained(folder, safe_serialization=True)`"
        )
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise ModelError(
            f"{KEY}={shown!r} has no tokenizer (tokenizer_config.json / tokenizer.json): the chat is "
            f"rendered with the reward model's own tokenizer and template. Fix: save its tokenizer into "
            f"the folder (AutoTokenizer.from_pretrained(<source>).save_pretrained(folder))"
        )


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(tok_cfg, dict) and bool(tok_cfg.get("chat_template"))


def check_reward_model(kind: str, path: str, trust_remote_code: bool = False) -> None:
    """Raise ModelError unless ``path`` holds a usable model of ``kind`` (cheap: files only)."""
    shown = str(path)
    if kind == "generative" and normalise_alias(shown) is not None:
        check_model_path(shown)
        return
    folder = Path(os.path.expanduser(shown))
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "is not a model folder (no config.json)"
        raise ModelError(
            f"{KEY}={shown!r} {what}. Fix: give the folder written by `save_pretrained`"
            f"{' (or an alias: tiny, smollm2-135m-instruct)' if kind == 'generative' else ''}; "
            f"nothing is downloaded"
        )
    cfg = _config(folder, shown)
    archs = [str(a) for a in cfg.get("architectures") or []]
    if kind == "discriminative":
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ModelError(
                f"{KEY}={shown!r} holds {archs or 'an unnamed architecture'}, not a sequence-classification "
                f"reward model. Fix: for reward.model.kind=discriminative give a folder saved from "
                f"AutoModelForSequenceClassification with one label, or set reward.model.kind=generative to "
                f"use a causal LM as a judge"
            )
        labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
        if labels != 1:
            raise ModelError(
                f"{KEY}={shown!r} has {labels} labels; a reward model gives one score (num_labels=1). Fix: "
                f"give a reward model with a one-label head (e.g. a Skywork-style RM)"
            )
        if not _has_chat_template(folder):
            raise ModelError(
                f"{KEY}={shown!r}: its tokenizer has no chat template, and the policy's chat is rendered "
                f"with the reward model's own template. Fix: add the template it was trained with "
                f"(tokenizer.chat_template = ...; save_pretrained)"
            )
    elif not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ModelError(
            f"{KEY}={shown!r} holds {archs or 'an unnamed architecture'}, which has no language-model head "
            f"to write a judgement with. Fix: for reward.model.kind=generative give a causal-LM folder or "
            f"an alias, or set reward.model.kind=discriminative for a sequence-classification model"
        )
    _check_folder(folder, shown, cfg, trust_remote_code)


def load_reward_model(
    path: str, dtype: "torch.dtype", trust_remote_code: bool = False
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """A sequence-classification reward model in eval mode and its own tokenizer (right padding,
    left truncation: the response end is kept). The model's ``pad_token_id`` is the tokenizer's
    when its config has none, so that batches pool at each row's last real token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = os.path.expanduser(path)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side, tok.truncation_side = "right", "left"
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model.eval().requires_grad_(False), tok


def judge_folder(path: str) -> str:
    """The local folder of a generative judge (an alias is built once, as for the policy)."""
    return resolve_model(path)
