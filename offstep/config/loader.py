"""Compose the configuration with Hydra: schema defaults, a preset, then command-line overrides."""

from __future__ import annotations

import difflib

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

from offstep.config.schema import Config

_registered = False


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


def _register() -> None:
    global _registered
    if not _registered:
        ConfigStore.instance().store(name="schema", node=Config)
        _registered = True


def _explain(e: Exception, overrides: list[str]) -> str:
    """One message for a failed composition: which key, what is wrong, how to fix it (Hydra's own
    text suggests ``+key=value``, which a typed config rejects anyway)."""
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    key = getattr(cause, "full_key", None)
    text = str(cause).split("\n    full_key:")[0].split("\nConfig search path")[0].strip().rstrip(".")
    if isinstance(cause, ConfigAttributeError) and key:
        parent, _, name = key.rpartition(".")
        node = OmegaConf.structured(Config)
        for part in filter(None, parent.split(".")):
            node = node.get(part) if hasattr(node, "get") else None
        known = [str(k) for k in node] if hasattr(node, "keys") else []
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {' or '.join(f'{parent}.{c}' if parent else c for c in close)}? Otherwise " if close else ""
        return (f"unknown configuration key {key!r}. Fix: {hint}check the spelling; `offstep train --cfg` "
                "prints every key with its value")
    if key:
        return f"bad value for {key}: {text}. Fix: give a value of the key's type (`offstep train --cfg` prints them)"
    return f"bad override in {overrides}: {text}"


def load_config(overrides: list[str] | None = None) -> Config:
    """Return the typed config for ``offstep train`` with ``overrides`` (``key=value``) applied."""
    _register()
    overrides = list(overrides or [])
    try:
        with initialize_config_module(config_module="offstep.config", version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain(e, overrides)) from None
    return OmegaConf.to_object(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
