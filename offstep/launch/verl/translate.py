"""verl's command line as offstep overrides, before Hydra composes the config (``translate``): each
verl key by its entry of ``offstep.launch.verl.table``; every refusal is collected and reported
at once, in one message (``refusals``). What needs the composed config is left, in the
``Translation``, for ``offstep.launch.verl.derive.apply_derived``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from offstep.config.schema import Config
from offstep.errors import VerlKeyError
from offstep.launch.verl.convert import DOC
from offstep.launch.verl.table import (
    DERIVED_TARGETS,
    MEGATRON,
    TABLE,
    VERL_ONLY_ROOTS,
    Derived,
    Note,
    Refuse,
    prefix_of,
    rule_for,
)


@dataclass
class Translation:
    """What ``translate`` made of a command line: the overrides Hydra composes, the verl values the
    derivations need (``verl``), the offstep keys the verl keys set (for conflicts), and the notes."""

    overrides: list[str] = field(default_factory=list)
    verl: dict[str, Any] = field(default_factory=dict)  # the values of the Derived keys
    given: set[str] = field(default_factory=set)  # every verl key of the command line
    origin: dict[str, str] = field(default_factory=dict)  # offstep key -> the verl key that set it
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every refusal, reported together (refusals())

    @property
    def used(self) -> bool:
        return bool(self.verl or self.origin)


def _literal(v: Any) -> str:
    """A Python value as a Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_literal(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as an override")


def is_offstep_key(key: str) -> bool:
    from omegaconf import OmegaConf

    node: Any = OmegaConf.structured(Config)
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _is_bool_key(key: str) -> bool:
    from omegaconf import OmegaConf
    from omegaconf.nodes import BooleanNode

    node: Any = OmegaConf.structured(Config)
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    return isinstance(node._get_node(leaf), BooleanNode)


def refusals(errors: list[str]) -> str:
    """Every refusal of a command line as one message (one refusal: its own message)."""
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} verl keys cannot run as given (each with its fix):\n  - " + "\n  - ".join(errors)


# verl's Hydra flags on its launch line: the config folder, and the config, which for
# verl's fully-async entry point (fully_async_main) is fully_async_ppo_trainer (or _megatron_).
ENTRY_FLAGS = ("--config-path=", "--config-dir=", "--config-name=")
ASYNC_CONFIG = "fully_async_"


def is_entry_flag(arg: str) -> bool:
    return arg.startswith(ENTRY_FLAGS)


def _entry_flag(out: Translation, arg: str) -> None:
    flag, value = arg.split("=", 1)
    name = value.strip("'\"")
    if flag != "--config-name":
        out.notes.append(
            f"{flag}={name}: accepted, no effect (verl's config folder; offstep's configuration is its "
            f"schema, which `offstep train --cfg` prints)"
        )
        return
    name = name.removesuffix(".yaml")
    if "megatron" in name:
        out.errors.append(f"verl's {flag}={name} is refused: {MEGATRON} ({DOC})")
    elif name.startswith(ASYNC_CONFIG):
        out.given.add(flag)
        out.verl[flag] = name
    else:
        out.notes.append(
            f"{flag}={name}: accepted (verl's trainer config; offstep composes its own, and translates the keys given)"
        )


def translate(overrides: list[str], collect: bool = False) -> Translation:
    """Split ``overrides`` into offstep overrides (verl keys translated) and the verl values left
    for ``apply_derived``. Raises ``VerlKeyError`` listing every refused key or value, unless
    ``collect``: then they are in ``errors`` (``apply_derived`` reports them with its own)."""
    out = Translation()
    for arg in overrides:
        if is_entry_flag(arg):
            _entry_flag(out, arg)
    overrides = [a for a in overrides if not is_entry_flag(a)]
    parsed = OverridesParser.create().parse_overrides(overrides)
    for line, o in zip(overrides, parsed):
        key = o.key_or_group
        root = key.split(".")[0]
        is_verl = key in TABLE or root in VERL_ONLY_ROOTS or (rule_for(key) is not None and not is_offstep_key(key))
        if not is_verl:
            out.overrides.append(line)
            continue
        value = o.value()
        rule = rule_for(key)
        out.given.add(key)
        if rule is None:
            out.errors.append(
                f"{key}: a verl key that offstep does not know; it is neither translated nor "
                f"noted, so it is refused rather than ignored. Fix: drop it ({DOC} lists the verl "
                f"keys offstep translates, notes and refuses)"
            )
        elif isinstance(rule, Refuse):
            if value not in rule.allow:
                out.errors.append(
                    f"verl key {key}={value!r} is refused: {rule.why}. Fix: drop it"
                    + (f" or set {rule.allow[0]!r}" if rule.allow else "")
                    + f" ({DOC})"
                )
            else:
                out.notes.append(f"{key}={value!r}: accepted, no effect (other values are refused: {rule.why})")
        elif isinstance(rule, Note):
            _note_once(out, key, rule.why)
        elif isinstance(rule, Derived):
            out.verl[key] = value
        elif rule.key.endswith("."):  # a group of keys under one offstep dict (override_config.*)
            target = rule.key + key[len(prefix_of(key)) :]
            out.origin[target] = key
            out.overrides.append(f"+{target}={line.split('=', 1)[1]}")
            out.notes.append(f"{key} -> {target}" + (f" ({rule.note})" if rule.note else ""))
        else:
            try:
                _claim(out, rule.key, key)
                if value == "" and rule.convert is None and _is_bool_key(rule.key):
                    out.notes.append(
                        f"{key}='' (empty, as an unset shell variable gives) -> {rule.key}=false, as "
                        f"verl's untyped config reads it"
                    )
                    out.overrides.append(f"{rule.key}=false")
                    continue
                converted = value if rule.convert is None else rule.convert(key, value)
            except VerlKeyError as e:
                out.errors.append(str(e))
                continue
            if isinstance(converted, dict):  # one +key per entry: Hydra adds keys to a dict field only so
                out.overrides += [f"+{rule.key}.{k}={_literal(x)}" for k, x in converted.items()]
            elif rule.convert is None:
                out.overrides.append(f"{rule.key}={line.split('=', 1)[1]}")
            else:
                out.overrides.append(f"{rule.key}={_literal(converted)}")
                if converted != value and converted != [value]:
                    out.notes.append(f"{key}={value!r} -> {rule.key}={converted!r}")
            if rule.note:
                out.notes.append(f"{key} -> {rule.key}: {rule.note}")
    given = {o.key_or_group for o in parsed}
    claims = [(target, verl_key) for target, verl_key in out.origin.items()]
    claims += [(target, verl_key) for verl_key in out.verl for target in DERIVED_TARGETS.get(verl_key, ())]
    for target, verl_key in claims:
        if target in given and target != verl_key:
            out.errors.append(f"{target} is given twice: directly and as verl's {verl_key}. Fix: keep one of them")
    if out.errors and not collect:
        raise VerlKeyError(refusals(out.errors))
    return out


def _note_once(out: Translation, key: str, why: str, what: str = "accepted, no effect") -> None:
    """One note per cause: verl's keys of the same name for other roles (actor, ref, critic), or
    of one group, given for the same reason, join the first one's note."""
    for i, note in enumerate(out.notes):
        keys, sep, rest = note.partition(": ")
        if sep and rest.endswith(f"({why})") and keys.split(", ")[0].rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]:
            out.notes[i] = f"{keys}, {key}: {rest}"
            return
    out.notes.append(f"{key}: {what} ({why})")


# offstep keys that verl spells two ways for one thing: clip_grad / grad_clip, and the DAPO
# recipe's reward_model.overlong_buffer.* / its reward manager's reward_kwargs.overlong_buffer_cfg.*
SAME_THING = (
    "actor.optim.grad_clip",
    "critic.optim.grad_clip",
    "algorithm.overlong_penalty",
    "algorithm.overlong_buffer_len",
    "algorithm.overlong_penalty_factor",
)


def _claim(out: Translation, target: str, verl_key: str) -> None:
    """Record that ``verl_key`` sets ``target``; two verl keys for one target is a conflict, except
    verl's own pairs for the same thing (``SAME_THING``)."""
    other = out.origin.get(target)
    if other is not None and other != verl_key and target not in SAME_THING:
        raise VerlKeyError(f"{other} and {verl_key} both set {target}. Fix: keep one of them")
    out.origin[target] = verl_key


# verl's keys that only its fully-async trainer has (besides async_training.*)
ASYNC_ONLY = ("rollout.total_rollout_steps", "rollout.total_epochs", "rollout.test_freq")


def async_signals(t: Translation) -> list[str]:
    """The keys of the command line that make it verl's fully-async one (none: not one)."""
    return sorted(k for k in t.given if k.startswith("async_training.") or k in ASYNC_ONLY or k == "--config-name")
