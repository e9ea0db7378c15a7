"""From a run checkpoint to a Hugging Face model folder (``offstep export``, and ``offstep eval``
of a run directory): the actor's DCP shards are reassembled into the base model's architecture and
saved as safetensors, with the tokenizer beside them. A LoRA run's checkpoint holds the adapters
only: it is written as a peft adapter folder (``adapter_config.json``,
``adapter_model.safetensors``; ``PeftModel.from_pretrained`` loads it onto the base), or with
``merge`` as the base model with the adapters merged in (a plain Hugging Face folder). ``offstep
eval`` takes either; an adapter folder is merged once into the offstep cache.

The folder is written next to its destination under a temporary name, fsynced, finished with the
marker ``.offstep-export`` and then renamed into place, so a crash never leaves a half-written
model under the destination's name; an existing destination is replaced only with ``force``, and
deleted only after the new folder is in place. A destination that is, holds or lies inside the
checkpoint read, or that holds a run (its marker or checkpoints), is refused even with ``force``.
``offstep eval`` of a run exports into the offstep cache under the digest of the checkpoint's
files, so it never trusts an ``hf/`` folder that came with a run, and never writes into the run. The base model is the checkpoint's ``model.path``
(read as plain data from its ``config.yaml``) only if that is a built-in alias or a local folder,
or the one given as ``base``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import fields
from pathlib import Path

from offstep.config.schema import LoRAConfig
from offstep.errors import CheckpointError, ConfigError, ModelError, NotAFile
from offstep.files import remove_tree, temp_name, walk
from offstep.models.builtin import ALIASES, normalise_alias
from offstep.models.forward import DTYPES
from offstep.models.loading import cache_dir, load_causal_lm, load_tokenizer, resolve_model
from offstep.models.lora import adapter_base, adapter_parameters, add_adapters, is_adapter_folder, merged_model
from offstep.models.vision import freeze_vision_tower, load_image_processor
from offstep.pipeline.checkpoints import (
    LEGACY_STATE_FILE,
    STATE_FILE,
    best_checkpoint,
    complete_checkpoints,
    earlier_intact,
    file_digests,
    open_checkpoint,
    read_config,
    resolve_path,
    select,
)
from offstep.telemetry.names import Role
from offstep.train.checkpoint import fsync_tree, load_model_weights, replace_dir, write_durably, write_failed

DONE = ".offstep-export"  # written last: an export folder without it is incomplete
# What marks a folder as a run or a checkpoint; an --out that holds one at any depth is never replaced.
_RUN_NAMES = {".offstep-run", ".offstep-lock", "checkpoints", STATE_FILE, LEGACY_STATE_FILE}
_MAX_OUT_ENTRIES = 10_000  # a model folder holds a few dozen files


def _base_model(ckpt: Path, config_yaml: str, base: str | None) -> tuple[str, str]:
    """(base model folder, master dtype) for a checkpoint, trusting its config.yaml only with a
    built-in alias or a local folder that exists."""
    saved = read_config(config_yaml)
    dtype = select(saved, "model.dtype") or "float32"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConfigError(f"{ckpt / 'config.yaml'} names model.dtype {dtype!r}; it must be one of {sorted(DTYPES)}")
    name = base or select(saved, "model.path")
    where = "--model" if base else f"the checkpoint's config.yaml ({ckpt / 'config.yaml'})"
    if not isinstance(name, str) or (normalise_alias(name) is None and not Path(name).expanduser().is_dir()):
        raise ConfigError(
            f"{where} names the base model {name!r}, which is neither a built-in alias ({', '.join(ALIASES)}) nor a "
            f"local folder; give the base model's folder with --model (offstep export) or model.path"
        )
    try:
        return resolve_model(name), dtype
    except ModelError as e:
        raise ConfigError(f"{where} names the base model {name!r}: {e}") from None


def _lora_of(config_yaml: str) -> LoRAConfig | None:
    """The ``actor.lora`` a checkpoint was trained with (``None``: full fine-tuning)."""
    saved = select(read_config(config_yaml), "actor.lora")
    if not isinstance(saved, dict) or not saved.get("rank"):
        return None
    known = {f.name for f in fields(LoRAConfig)}
    return LoRAConfig(**{k: v for k, v in saved.items() if k in known})


def export_checkpoint(
    run_or_checkpoint: str | Path,
    out: str | Path,
    step: int | None = None,
    force: bool = False,
    base: str | None = None,
    merge: bool = False,
) -> Path:
    """Write the policy of a checkpoint (a run's latest, or ``step``) to ``out`` as a model
    folder that ``AutoModelForCausalLM.from_pretrained`` loads, or, for a LoRA run without
    ``merge``, as a peft adapter folder. A non-empty ``out`` is refused unless ``force``.
    Returns ``out``."""
    out = Path(out)
    path = resolve_path(run_or_checkpoint, step)
    try:
        loaded = open_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {earlier_intact(path, 'export', '--step ')}") from None
    _check_destination(out, loaded.path)
    if (out.exists() or out.is_symlink()) and not force and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(
            f"{out} exists and is not empty; give another --out, or --force to replace it (the old "
            f"folder is deleted only once the new one is in place)"
        )
    folder, dtype = _base_model(loaded.path, loaded.config_yaml, base)
    model = load_causal_lm(folder, dtype=DTYPES[dtype])
    lora = _lora_of(loaded.config_yaml)
    try:
        if lora is None and select(read_config(loaded.config_yaml), "actor.freeze_vision_tower") is True:
            freeze_vision_tower(model)  # the checkpoint holds what trained; the tower is the base model's
            load_model_weights(
                loaded.path / Role.ACTOR, model, names={n for n, p in model.named_parameters() if p.requires_grad}
            )
        elif lora is None:
            load_model_weights(loaded.path / Role.ACTOR, model)
        else:
            model = add_adapters(model, lora, base_path=folder)
            load_model_weights(loaded.path / Role.ACTOR, model, names={n for n, _ in adapter_parameters(model)})
    except CheckpointError as e:  # bytes that only a load reveals
        raise CheckpointError(f"{e}; {earlier_intact(loaded.path, 'export', '--step ')}") from None
    if lora is not None and merge:
        model = model.merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_folder(out)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(folder).save_pretrained(tmp)
        image_processor = load_image_processor(folder)  # a vision-language model's, None otherwise
        if image_processor is not None:
            image_processor.save_pretrained(tmp)
        done = {
            "checkpoint": str(loaded.path.resolve()),
            "step": loaded.state.step,
            "base_model": folder,
            "form": "model" if lora is None else "merged" if merge else "adapter",
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_durably(tmp / DONE, json.dumps(done) + "\n")
        fsync_tree(tmp)
        replace_dir(tmp, out, out.with_name(f".{out.name}.old-{os.getpid()}"))
    except OSError as e:
        raise write_failed(tmp, e) from None
    finally:
        remove_tree(tmp)  # what a failed export left (gone after a rename)
    return out


def new_folder(out: Path) -> Path:
    """A new empty folder beside ``out`` to write its replacement into (made here, so nothing that
    was at that name, a link say, is written through)."""
    while True:
        tmp = temp_name(out)
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def _check_destination(out: Path, ckpt: Path) -> None:
    """Refuse an ``--out`` whose replacement would destroy what is read or a run: the checkpoint
    itself, a folder inside it or holding it, or any folder holding a run (even with ``--force``)."""
    dest, src = out.absolute().resolve(), ckpt.resolve()
    if dest == src or src in dest.parents or dest in src.parents:
        raise ConfigError(
            f"--out {out} is, holds or lies inside the checkpoint being exported ({ckpt}); replacing it "
            f"would destroy that checkpoint, even with --force. Give an --out outside it, e.g. "
            f"{src.parents[1] / 'hf'}"
        )
    if not dest.is_dir() or dest.is_symlink():
        return
    try:
        held = next(
            (
                Path(folder)
                for folder, dirs, others in walk(dest, limit=_MAX_OUT_ENTRIES)
                if {e.name for e in dirs + others} & _RUN_NAMES
            ),
            None,
        )
    except (NotAFile, OSError) as e:
        raise ConfigError(
            f"--out {out} cannot be checked for runs and checkpoints ({e}); export replaces only a "
            f"model folder, even with --force. Give another --out"
        ) from None
    if held is not None:
        raise ConfigError(
            f"--out {out} holds an offstep run or checkpoint ({held}); export never replaces one, at any "
            f"depth, even with --force. Give another --out"
        )


def is_run_or_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / STATE_FILE).is_file() or (p / "checkpoints").is_dir()


def best_step(run: str | Path, metric: str = "val/acc") -> int:
    """The step of the run's best-scoring checkpoint (``--best``), or an error that names the fix."""
    if (Path(run) / STATE_FILE).is_file():
        raise ConfigError(f"--best picks among a run's checkpoints: give the run directory, not the checkpoint {run}")
    found = best_checkpoint(run, metric)
    if found is None:
        raise ConfigError(
            f"{run} has no checkpoint of a step whose {metric} its metrics.jsonl records: train with "
            f"trainer.save_freq a multiple of trainer.val_freq (trainer.keep_best=true keeps the best "
            f"one when trainer.keep_checkpoints prunes), or name a checkpoint with --step"
        )
    return found[0]


def model_for_eval(path: str | Path, step: int | None = None) -> str:
    """A model folder for ``offstep eval``: run directories and checkpoints are exported once
    into the offstep cache, under the digest of the checkpoint's files (a LoRA run's merged), and
    that export is reused while the files are the same; a peft adapter folder is merged onto its
    base once, into the offstep cache; anything else is returned as it is (a model folder or an
    alias)."""
    if is_adapter_folder(path):
        return str(merge_adapter_folder(path))
    if not is_run_or_checkpoint(path):
        return str(path)
    p = Path(path)
    if not (p / STATE_FILE).is_file() and not complete_checkpoints(p / "checkpoints"):
        raise ConfigError(
            f"the run {path} has no checkpoint, so it kept no trained policy to evaluate: it ran with "
            f"trainer.save_last=false and trainer.save_freq=0. Train with trainer.save_last=true (the "
            f"default) or trainer.save_freq=N, or give a model folder"
        )
    loaded = open_checkpoint(resolve_path(path, step))
    digest = hashlib.sha256(loaded.config_yaml.encode())
    for name, (size, sha) in sorted(file_digests(loaded.path / Role.ACTOR, skip=()).items()):
        digest.update(f"{name} {size} {sha}\n".encode())
    out = cache_dir() / "exports" / digest.hexdigest()[:24]
    if not (out / DONE).is_file():
        export_checkpoint(loaded.path, out, force=True, merge=True)  # an unfinished earlier export is replaced
    return str(out)


def merge_adapter_folder(path: str | Path) -> Path:
    """The base model named by the adapter folder ``path`` with the adapters merged in, written
    once under ``<offstep cache>/merged/<digest of the adapter files>`` (marker last, atomic rename)."""
    path = Path(path).expanduser().resolve()
    digest = hashlib.sha256(str(path).encode())
    for f in sorted(path.glob("adapter_*")):
        digest.update(f.name.encode() + f.read_bytes())
    out = cache_dir() / "merged" / digest.hexdigest()[:16]
    if (out / DONE).is_file():
        return out
    name = adapter_base(path)
    if normalise_alias(name) is None and not Path(name).expanduser().is_dir():
        raise ConfigError(
            f"the adapter folder {path} names the base model {name!r} (base_model_name_or_path in "
            f"adapter_config.json), which is neither a built-in alias ({', '.join(ALIASES)}) nor a local "
            f"folder; set it to the base model's folder"
        )
    folder = resolve_model(name)
    model = merged_model(path, load_causal_lm(folder))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_folder(out)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        (
            load_tokenizer(path) if (path / "tokenizer_config.json").is_file() else load_tokenizer(folder)
        ).save_pretrained(tmp)
        write_durably(tmp / DONE, json.dumps({"adapter": str(path), "base_model": folder}) + "\n")
        fsync_tree(tmp)
        replace_dir(tmp, out, out.with_name(f".{out.name}.old-{os.getpid()}"))
    except OSError as e:
        raise write_failed(tmp, e) from None
    finally:
        remove_tree(tmp)
    return out
