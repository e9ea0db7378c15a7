"""Compose the configuration with Hydra: schema defaults, a preset, then command-line overrides."""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from offstep.config.schema import Config
from offstep.errors import ConfigError, VerlKeyError
from offstep.launch.verl.command_line import command_line
from offstep.launch.verl.derive import apply_derived
from offstep.launch.verl.translate import is_entry_flag, refusals, translate

_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        ConfigStore.instance().store(name="schema", node=Config)
        _registered = True


def _unknown_key(key: str) -> str:
    """The message for a key the schema does not have, with the closest keys it does have."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.structured(Config)
    for part in filter(None, parent.split(".")):
        node = node.get(part) if hasattr(node, "get") else None
    if node is not None and OmegaConf.get_type(node) is dict:  # an open mapping (data.task_options, ...)
        return (
            f"{key!r} is a new key in the open mapping {parent!r}, which Hydra adds only with a plus. "
            f"Fix: write +{key}=VALUE, or the mapping whole with a plus: +{parent}={{KEY: VALUE, ...}}"
        )
    known = [str(k) for k in node] if hasattr(node, "keys") else []
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {' or '.join(f'{parent}.{c}' if parent else c for c in close)}? Otherwise " if close else ""
    return (
        f"unknown configuration key {key!r}. Fix: {hint}check the spelling; `offstep train --cfg` "
        "prints every key with its value (verl's keys: docs/from-verl.md lists those offstep translates)"
    )


def _explain(e: Exception, overrides: list[str], origin: dict[str, str] | None = None) -> str:
    """One message for a failed composition: which key, what is wrong, how to fix it (Hydra's own
    text suggests ``+key=value``, which a typed config rejects anyway). ``origin``: the verl key
    that set an offstep key, named too."""
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    key = getattr(cause, "full_key", None)
    if key and origin and origin.get(key, key) != key:
        key = f"{key} (given as verl's {origin[key]})"
    text = str(cause).split("\n    full_key:")[0].split("\nConfig search path")[0].strip().rstrip(".")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:  # Key: an open mapping's, given whole
        return _unknown_key(key)
    if isinstance(cause, InterpolationResolutionError):
        env = re.search(r"Environment variable '([^']+)' not found", text)
        if env:
            return (
                f"{key}: the environment variable {env.group(1)} in ${{oc.env:{env.group(1)}}} is not set. Fix: "
                f"export {env.group(1)}=..., or give a default: ${{oc.env:{env.group(1)},VALUE}}"
            )
        return f"{key}: cannot resolve its interpolation ({text}). Fix: give a plain value, or an interpolation that resolves"
    if key:
        return f"bad value for {key}: {text}. Fix: give a value of the key's type (`offstep train --cfg` prints them)"
    return f"bad override in {overrides}: {text}"


def _refuse_hydra_overrides(overrides: list[str]) -> None:
    """Hydra applies ``hydra.*`` overrides to its own node, which ``compose`` drops: refuse them
    rather than ignore them."""
    for o in OverridesParser.create().parse_overrides(overrides):
        group = o.key_or_group
        if group == "hydra" or group.startswith(("hydra.", "hydra/")):
            raise ConfigError(
                f"{o.input_line}: offstep does not use Hydra's own settings (hydra.*): it writes the config, "
                f"metrics and checkpoints of a run to trainer.output_dir and has no launcher or sweeper. Fix: "
                f"drop {group}, and set trainer.output_dir=DIR for where the run writes"
            )


def _added_keys(node, key: str = "") -> list[str]:
    """Keys that a ``+key=value`` override added to a dataclass node of the schema (Hydra accepts
    them in struct mode and ``to_object`` keeps them as stray attributes; nothing reads them)."""
    out = []
    if is_dataclass(node):
        names = {f.name for f in fields(node)}
        out += [f"{key}{k}" for k in vars(node) if k not in names]
        for name in names:
            out += _added_keys(getattr(node, name), f"{key}{name}.")
    return out


def resolve(cfg: Config) -> Config:
    """Fill in, in place, the keys whose default is derived from other keys, so that every consumer
    (actor, critic, the saved ``config.yaml``) sees one value: ``algorithm.loss_agg_horizon`` 0 is
    ``rollout.max_new_tokens`` (Dr. GRPO's constant divisor); ``model.compute_dtype=auto`` is
    bfloat16 on GPUs and on CPUs with native bf16, else float32 (``cpu_has_native_bf16``);
    ``actor.micro_token_budget=-1`` is ``actor.micro_batch_size`` x the longest possible sample, so
    that a micro-batch never holds more tokens than the padded fixed-count one could, and the
    padding is cut (``benchmarks/update_throughput.py``)."""
    a = cfg.actor
    if a.micro_token_budget == -1:
        a.micro_token_budget = a.micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    cfg.algorithm.loss_agg_horizon = cfg.algorithm.loss_agg_horizon or cfg.rollout.max_new_tokens
    if cfg.model.compute_dtype == "auto":
        on_gpu = cfg.resources.gpus_per_trainer_worker > 0 or cfg.trainer.device == "cuda"
        cfg.model.compute_dtype = "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"
    return cfg


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU multiplies bf16 natively (AVX-512 BF16 or AMX), from the kernel's
    CPU flags. Without them (AVX2 only, or no /proc/cpuinfo) torch emulates bf16 matrix products,
    and bf16 autocast makes SmolLM2-135M's forward and backward about 15x slower than float32."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _preset_options_of_another_task(cfg: Config, overrides: list[str]) -> str | None:
    """A preset's ``data.task_options`` belong to the preset's task: where the command line names
    another task, they are dropped and only the command line's own options stay (``offstep train
    data.task=gsm8k_synthetic`` on the default preset must not hand gsm8k_synthetic arithmetic's
    ``digits``). Returns the note saying so, or None."""
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("~")])
    if not any(o.key_or_group == "data.task" for o in parsed):
        return None
    path = Path(__file__).resolve().parents[1] / "config" / "preset" / f"{cfg.preset}.yaml"
    preset = (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("data", {}) if path.is_file() else {}
    options = preset.get("task_options") or {}
    if not options or preset.get("task") == cfg.data.task:
        return None
    mine: set[str] = set()  # the option names the command line sets
    for o in parsed:
        if o.key_or_group == "data.task_options" and isinstance(o.value(), dict):
            mine |= set(o.value())
        elif o.key_or_group.startswith("data.task_options."):
            mine.add(o.key_or_group.split(".")[2])
    dropped = {k: v for k, v in options.items() if k not in mine}
    if not dropped:
        return None
    cfg.data.task_options = {k: v for k, v in cfg.data.task_options.items() if k not in dropped}
    return (
        f"data.task={cfg.data.task}: the preset {cfg.preset}'s data.task_options {dropped} are its task "
        f"{preset.get('task')}'s, so they are dropped; set this task's with +data.task_options.KEY=VALUE"
    )


def load_config(
    overrides: list[str] | None = None, notes: list[str] | None = None, errors: list[str] | None = None
) -> Config:
    """Return the typed, resolved config for ``offstep train`` with ``overrides`` (``key=value``)
    applied. verl's key names are translated (``offstep.launch.verl``); what the translation
    says about them goes to ``notes`` when a list is given, else to stderr. With ``errors``, the
    refusals of verl keys go there and the config is returned (the caller reports them with its own
    checks, in one pass); without, they raise ``ConfigError``."""
    _register()
    try:
        overrides, said_first = command_line(list(overrides or []))  # verl's config files, ~key
        _refuse_hydra_overrides([o for o in overrides if not is_entry_flag(o)])  # verl's --config-name: translate
        verl = translate(overrides, collect=True)  # its refusals are reported with the derivations'
    except (HydraException, VerlKeyError) as e:
        raise ConfigError(str(e) if isinstance(e, VerlKeyError) else _explain(e, overrides)) from None
    try:
        with initialize_config_module(config_module="offstep.config", version_base="1.3"):
            cfg = compose(config_name="train", overrides=verl.overrides)
        typed = OmegaConf.to_object(cfg)  # resolves interpolations such as ${oc.env:VAR}
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(refusals([*verl.errors, _explain(e, overrides, verl.origin)])) from None
    added = _added_keys(typed)
    if added:
        raise ConfigError(refusals([*verl.errors, *(_unknown_key(k) for k in added)]))
    said = said_first + verl.notes
    dropped = _preset_options_of_another_task(typed, verl.overrides)
    said += [dropped] if dropped else []
    try:
        said += apply_derived(typed, verl, collect=errors)
    except VerlKeyError as e:
        raise ConfigError(str(e)) from None
    if notes is not None:
        notes.extend(said)
    elif said:
        print("offstep: verl keys:\n  " + "\n  ".join(said), file=sys.stderr)
    return resolve(typed)
