"""``offstep train --help VERL_KEY``: what a verl key becomes in offstep, read from the one table
(``offstep.launch.verl.table``): translated (To), derived from several keys (Derived), accepted with
no effect (Note) or refused (Refuse), with the entry's own text; a group of verl keys
(``actor_rollout_ref.actor``) lists the entry of each key under it."""

from __future__ import annotations

import re

from offstep.launch.help import format_keys, select
from offstep.launch.verl.table import PREFIXES, TABLE, VERL_ONLY_ROOTS, Derived, Note, Refuse, To, prefix_of, rule_for

DOC = "docs/from-verl.md"


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def entry(key: str, rule: To | Derived | Note | Refuse) -> str:
    """One line for ``key`` under ``rule``: what it becomes and why."""
    if isinstance(rule, To):
        target = rule.key + key[len(prefix_of(key)) :] if rule.key.endswith(".") else rule.key
        how = " ".join((rule.convert.__doc__ or "").split()) if rule.convert else ""
        text = f"translated to {target}" + (
            f", the value converted ({how.rstrip('.')})"
            if how
            else ", the value converted to offstep's convention"
            if rule.convert
            else ""
        )
        return text + (f"; {rule.note}" if rule.note else "")
    if isinstance(rule, Derived):
        return f"derived: sets {rule.targets}: {rule.how}"
    if isinstance(rule, Note):
        return f"accepted, no effect: {rule.why}"
    allow = f"; accepted with a note when it is {' or '.join(map(_value, rule.allow))}" if rule.allow else ""
    return f"refused: {rule.why}{allow}"


def targets(rule: To | Derived | Note | Refuse, key: str) -> list[str]:
    """The offstep keys ``rule`` sets (for their own help)."""
    if isinstance(rule, To):
        return [rule.key + key[len(prefix_of(key)) :] if rule.key.endswith(".") else rule.key]
    if isinstance(rule, Derived):
        return re.findall(r"[a-z_]+(?:\.[a-z_]+)+", rule.targets)
    return []


def describe(query: str) -> str | None:
    """The help of the verl key (or group of keys) ``query``; None if it is not verl's."""
    key = query.strip(".").lstrip("+~")
    rule = rule_for(key)
    if rule is not None:
        where = "" if key in TABLE else f" (the rule for {prefix_of(key)}*)"
        text = f"verl key {key}{where}: {entry(key, rule)} ({DOC})"
        for target in (t for t in targets(rule, key) if t != key):  # the same name: offstep's help is above it
            try:
                text += "\n" + format_keys([k for k in select(target) if k.key == target])
            except KeyError:  # a key of a dict (model.override_config.NAME): its own help has none
                pass
        return text
    under = sorted(k for k in TABLE if k.startswith(key + "."))
    groups = sorted((p, r) for p, r in PREFIXES if p.startswith(key + "."))
    if under or groups:
        lines = [f"verl keys under {key} ({DOC}):"]
        lines += [f"  {k}: {entry(k, TABLE[k])}" for k in under]
        lines += [f"  {p}*: {entry(p, r)}" for p, r in groups]
        return "\n".join(lines)
    if key.split(".")[0] in VERL_ONLY_ROOTS:
        return (
            f"verl key {key}: not in offstep's table, so a command line with it is refused rather than ignored "
            f"({DOC} lists the verl keys offstep translates, notes and refuses)"
        )
    return None
