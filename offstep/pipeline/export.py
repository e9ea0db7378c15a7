"""From a run checkpoint to a Hugging Face model folder (``offstep export``, and ``offstep eval``
of a run directory): the actor's DCP shards are reassembled into the base model's architecture and
saved as safetensors, with the tokenizer beside them."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from offstep.models.forward import DTYPES
from offstep.models.loading import load_causal_lm, load_tokenizer, resolve_model
from offstep.pipeline.checkpoints import STATE_FILE, resolve_path
from offstep.train.checkpoint import load_model_weights


def export_checkpoint(run_or_checkpoint: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the policy of a checkpoint (a run's latest, or ``step``) to ``out`` as a model
    folder that ``AutoModelForCausalLM.from_pretrained`` loads. Returns ``out``."""
    ckpt = resolve_path(run_or_checkpoint, step)
    cfg = OmegaConf.load(ckpt / "config.yaml")
    base = resolve_model(cfg.model.path)
    model = load_causal_lm(base, dtype=DTYPES[cfg.model.dtype])
    load_model_weights(ckpt / "actor", model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(base).save_pretrained(out)
    return out


def is_run_or_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / STATE_FILE).is_file() or (p / "checkpoints").is_dir()


def model_for_eval(path: str | Path) -> str:
    """A model folder for ``offstep eval``: run directories and checkpoints are exported once
    into ``<checkpoint>/hf``; anything else is returned as it is (a model folder or an alias)."""
    if not is_run_or_checkpoint(path):
        return str(path)
    ckpt = resolve_path(path)
    hf = ckpt / "hf"
    if not (hf / "config.json").is_file():
        export_checkpoint(ckpt, hf)
    return str(hf)
