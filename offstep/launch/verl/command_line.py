"""verl's launch line before translation: a config file named by ``--config-path DIR
--config-name NAME`` (or ``--config-path=DIR``, ``-cp``/``-cn``) becomes verl ``key=value``
overrides, the command line's on top; ``~key`` (Hydra's delete) removes the key's earlier
overrides, so its default applies, as in verl.

A config's ``defaults`` list is followed to the files of DIR it names; verl's packaged configs
(``ppo_trainer``) are not here, so the file's own keys become overrides on offstep's translation
of verl's defaults, with a note. ``hydra:`` settings and ``_target_`` markers are dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from offstep.errors import VerlKeyError
from offstep.launch.verl.translate import _literal

FLAGS = {
    "--config-path": "path",
    "-cp": "path",
    "--config-dir": "path",
    "-cd": "path",
    "--config-name": "name",
    "-cn": "name",
}


def _key(arg: str) -> str:
    return arg.lstrip("+").split("=", 1)[0]


def delete_keys(args: list[str]) -> tuple[list[str], list[str]]:
    """``~key`` (or ``~key=value``) drops the earlier overrides of ``key`` and itself."""
    out, notes = [], []
    for arg in args:
        if arg.startswith("~"):
            key = _key(arg[1:])
            out = [a for a in out if _key(a) != key]
            notes.append(
                f"~{key}: deleted: its earlier values on the command line are dropped, so the preset's (or the default) applies"
            )
        else:
            out.append(arg)
    return out, notes


def _flags(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """verl's Hydra flags (both spellings) and the other arguments."""
    found, rest, i = {}, [], 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in FLAGS and eq:
            found[FLAGS[name]] = value.strip("'\"")
        elif arg in FLAGS and i + 1 < len(args):
            found[FLAGS[arg]] = args[i + 1].strip("'\"")
            i += 1
        else:
            rest.append(arg)
        i += 1
    return found, rest


def _compose(folder: Path, name: str, missing: list[str]) -> DictConfig:
    """The file ``name`` of ``folder`` merged with the configs of its defaults list found there."""
    raw = OmegaConf.load(folder / f"{name.removesuffix('.yaml')}.yaml")
    if not isinstance(raw, DictConfig):
        raise VerlKeyError(f"--config-name={name}: {folder / name} is not a mapping of keys")
    defaults = raw.pop("defaults", []) or []
    raw.pop("hydra", None)
    merged: Any = OmegaConf.create()
    own_done = False
    for entry in defaults:
        if entry == "_self_":
            merged, own_done = OmegaConf.merge(merged, raw), True
            continue
        if isinstance(entry, (dict, DictConfig)):  # group: option (optionally group@package)
            ((group, option),) = entry.items()
            group, _, package = str(group).partition("@")
            file = folder / group / f"{option}.yaml"
            if file.is_file():
                node = _compose(folder / group, str(option), missing)
                place = package or group.replace("/", ".")
                merged = OmegaConf.merge(merged, OmegaConf.create({}) if not place else _nest(place, node))
            else:
                missing.append(f"{group}: {option}")
            continue
        if (folder / f"{entry}.yaml").is_file():
            merged = OmegaConf.merge(merged, _compose(folder, str(entry), missing))
        else:
            missing.append(str(entry))
    return OmegaConf.merge(merged, raw) if not own_done else merged


def _nest(dotted: str, node: Any) -> DictConfig:
    for part in reversed(dotted.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def _flatten(root: DictConfig, node: DictConfig, prefix: str, out: list[str], notes: list[str]) -> None:
    for key in node:
        full = f"{prefix}{key}"
        if key == "_target_":
            continue
        try:
            value = OmegaConf.select(root, full, throw_on_resolution_failure=True)
        except OmegaConfBaseException:
            notes.append(
                f"{full}: its interpolation refers to verl's defaults, which are not loaded here; offstep's "
                f"translation of the default applies"
            )
            continue
        if isinstance(value, DictConfig) and len(value):
            _flatten(root, value, f"{full}.", out, notes)
        else:
            plain = (
                OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
            )
            out.append(f"{full}={_literal(plain)}")


def _command_line_on(cfg: DictConfig, args: list[str]) -> None:
    """Set the file's keys that the command line overrides too, before the file's interpolations
    resolve (``gen_batch_size: ${data.train_batch_size}`` follows a train_batch_size given on the
    command line, as in verl); the command line's overrides still come after the file's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = [a for a in args if "=" in a and not a.startswith(("-", "~"))]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except Exception:  # a malformed override is reported by translate, with its key
        return
    for o in parsed:
        key = o.key_or_group
        if OmegaConf.select(cfg, key, throw_on_resolution_failure=False) is not None:
            OmegaConf.update(cfg, key, o.value(), merge=False)


def expand_config_files(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` with verl's ``--config-path``/``--config-name`` file, when it is there, as
    overrides before the others (which win); the flags are kept otherwise (translate notes them).
    ``--config-name`` stays where translate reads the entry point from it (fully-async, Megatron)."""
    found, rest = _flags(args)
    if "name" not in found:
        return [f"--config-path={found['path']}", *rest] if "path" in found else rest, []
    name = found["name"].removesuffix(".yaml")
    folder = Path(found.get("path", ".")).expanduser()
    keep = [f"--config-name={name}"]
    if not (folder / f"{name}.yaml").is_file():
        path = [f"--config-path={found['path']}"] if "path" in found else []
        return [*path, *keep, *rest], []
    missing: list[str] = []
    try:
        cfg = _compose(folder, name, missing)
    except (OSError, OmegaConfBaseException) as e:
        raise VerlKeyError(
            f"--config-name={name}: {folder / name}.yaml cannot be read as a verl config ({e}). "
            f"Fix: correct the file, or give its keys on the command line"
        ) from None
    _command_line_on(cfg, rest)
    out: list[str] = []
    notes = [
        f"--config-path={folder} --config-name={name}: {name}.yaml read; its keys are translated as verl "
        f"overrides, the command line's on top"
    ]
    if missing:
        notes.append(
            f"{name}.yaml defaults [{', '.join(missing)}]: verl's packaged configs, not here; the file's own "
            f"keys apply over offstep's translation of verl's defaults"
        )
    _flatten(cfg, cfg, "", out, notes)
    entry = keep if name.startswith("fully_async_") or "megatron" in name else []
    return [*entry, *out, *rest], notes


def command_line(args: list[str]) -> tuple[list[str], list[str]]:
    """verl's launch line as plain overrides: config files expanded, ``~key`` applied."""
    args, notes = expand_config_files(args)
    args, deleted = delete_keys(args)
    return args, notes + deleted
