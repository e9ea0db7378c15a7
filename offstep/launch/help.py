"""``offstep train --help [KEY_OR_PREFIX]``: the configuration keys with their type, default and
help, grouped by section.

The help of a key is the string literal right after its field in ``schema.py`` (or ``training.py``) (cleanrl's field
docstrings); Python keeps no such strings at run time, so they are read by parsing the module's
source with ``ast``, once. Defaults are the schema's; ``offstep train [overrides] --cfg`` prints
the values that a preset and overrides give.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

from offstep.config import schema, training

USAGE = """\
usage: offstep train [key=value ...] [--cfg] [--help [KEY_OR_PREFIX]]

  key=value              set a key (Hydra overrides: rollout.n=8, data.train_files=[a.parquet])
  preset=NAME            start from offstep/config/preset/NAME.yaml (default, tiny)
  --cfg                  print the resolved configuration and exit
  --help [KEY_OR_PREFIX] this help; with a key (rollout.n) or a prefix (rollout) only those keys;
                         with a verl key (actor_rollout_ref.actor.ppo_mini_batch_size) what it becomes
"""


@dataclass(frozen=True)
class KeyHelp:
    """One configuration key: a value (``section`` False) or a group of keys (True)."""

    key: str  # dotted, e.g. "rollout.n"
    type: str  # as the schema writes it, ``Optional[X]`` as ``X | null``
    default: str  # in command-line syntax: null, true, [a, b]
    help: str
    section: bool = False


@functools.cache
def field_docs() -> dict[tuple[str, str], str]:
    """``{(class name, field name): docstring}`` for the fields of the classes of ``schema.py`` and
    ``training.py`` that have one."""
    docs = {}
    for node in (n for module in (schema, training) for n in ast.parse(inspect.getsource(module)).body):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, after in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[(node.name, stmt.target.id)] = inspect.cleandoc(after.value.value)
    return docs


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v or '""'
    if isinstance(v, list):
        return "[" + ", ".join(map(_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _type(annotation: str) -> str:
    return re.sub(r"^Optional\[(.*)\]$", r"\1 | null", annotation)


def all_keys(node=None, prefix: str = "") -> list[KeyHelp]:
    """Every key of the config tree below ``node`` (default: the whole ``Config``), depth first, a
    group of keys (``algorithm``, ``algorithm.kl_ctrl``) before its keys."""
    node = schema.Config() if node is None else node
    docs = field_docs()
    out = []
    for f in dataclasses.fields(node):
        key, value = prefix + f.name, getattr(node, f.name)
        doc = docs.get((type(node).__name__, f.name), "")
        if dataclasses.is_dataclass(value):
            out.append(KeyHelp(key, f.type, "", doc, section=True))
            out.extend(all_keys(value, key + "."))
        else:
            out.append(KeyHelp(key, _type(f.type), _value(value), doc))
    return out


def select(query: str | None) -> list[KeyHelp]:
    """The keys named by ``query``: a key (``rollout.n``), a prefix of whole parts (``rollout``,
    ``algorithm.kl_ctrl``), or everything for None. ``KeyError`` (with close matches) if none."""
    keys = all_keys()
    if query is None:
        return keys
    q = query.strip(".")
    found = [k for k in keys if k.key == q or k.key.startswith(q + ".")]
    if not found:
        close = difflib.get_close_matches(q, [k.key for k in keys], n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; `offstep train --help` lists every key"
        raise KeyError(f"no configuration key {query!r}{hint}")
    return found


def format_keys(keys: list[KeyHelp], width: int = 100) -> str:
    """The keys as text: a top-level section as a heading, each key as ``key: type = default``
    with its help wrapped below it."""
    lines = []
    for k in keys:
        if k.section and "." not in k.key:
            lines += ["", f"{k.key}: {k.help}" if k.help else f"{k.key}:"]
            continue
        head = f"  {k.key}.*: {k.help}" if k.section else f"  {k.key}: {k.type} = {k.default}"
        lines.append(head)
        if not k.section and k.help:
            lines += textwrap.wrap(k.help, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines).lstrip("\n")


def help_text(query: str | None = None, verl: Callable[[str], str | None] | None = None) -> str:
    """``offstep train --help [query]``: the usage and every key, or only the keys of ``query``.
    ``verl`` (``offstep.launch.verl.keyhelp.describe``, passed in by the command: this module sits
    below the translation) says what a verl key becomes; it answers a query that is no offstep key
    or prefix, and is added to an offstep key that verl has too (data.train_batch_size)."""
    width = min(100, shutil.get_terminal_size((100, 24)).columns)
    if not query:
        return USAGE + "\n" + format_keys(select(query), width)
    try:
        keys = select(query)
    except KeyError:
        mapped = verl(query) if verl else None
        if mapped is None:
            raise
        return mapped
    mapped = verl(query) if verl and any(k.key == query.strip(".") for k in keys) else None
    return format_keys(keys, width) + (f"\n\n{mapped}" if mapped else "")


def print_help(argv: list[str], verl: Callable[[str], str | None] | None = None) -> int:
    """Print the help asked for by ``argv`` (the arguments of ``offstep train``, holding ``--help``
    or ``-h``, the word after it the key or prefix, if any); return the exit status. ``verl``: as
    for ``help_text``."""
    i = next(j for j, a in enumerate(argv) if a in ("--help", "-h"))
    query = argv[i + 1] if i + 1 < len(argv) and "=" not in argv[i + 1] and not argv[i + 1].startswith("-") else None
    try:
        print(help_text(query, verl), flush=True)
    except KeyError as e:
        print(f"offstep: {e.args[0]}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `offstep train --help | head`: the reader left; as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
