"""Compose the configuration with Hydra: schema defaults, a preset, then command-line overrides."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from offstep.config.schema import Config

_registered = False


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""


def _register() -> None:
    global _registered
    if not _registered:
        ConfigStore.instance().store(name="schema", node=Config)
        _registered = True


def load_config(overrides: list[str] | None = None) -> Config:
    """Return the typed config for ``offstep train`` with ``overrides`` (``key=value``) applied."""
    _register()
    overrides = list(overrides or [])
    try:
        with initialize_config_module(config_module="offstep.config", version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"bad override in {overrides}: {e}".strip()) from None
    return OmegaConf.to_object(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
