"""The kinds of entry of verl's key table (``offstep.launch.verl.table``), and the notes several
entries share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class To:
    """Translated: the value goes to ``key``, through ``convert`` when the conventions differ."""

    key: str
    convert: Callable[[str, Any], Any] | None = None  # (verl key, value) -> offstep value
    note: str = ""  # said when the key is used (a difference worth knowing)


def schedule_name(key: str, value: Any) -> Any:
    """verl's ``lr_scheduler_type`` or its older ``warmup_style``, where null means constant."""
    return "constant" if value is None else value


@dataclass(frozen=True)
class Derived:
    """Translated with other keys or the composed config (a function of ``DERIVATIONS``)."""

    targets: str  # the offstep keys it sets, as the docs say them
    how: str


@dataclass(frozen=True)
class Note:
    """Accepted; it has no effect in offstep, for the reason given."""

    why: str


@dataclass(frozen=True)
class Refuse:
    """Refused (naming what offstep does instead), unless the value is one of ``allow``."""

    why: str
    allow: tuple = ()


# ------------------------------------------------------------------ notes several entries share
FSDP = "FSDP tuning: offstep shards with FSDP2 and keeps parameters and optimizer state on the device (no offload)"
ENGINE = "rollout engine tuning that offstep's engines choose themselves"
PROFILE = "profiling: offstep records its own stage timeline (timeline.jsonl, timing_s/*)"
LOGPROB_MB = "offstep's log-prob passes use actor.micro_batch_size (or actor.micro_token_budget)"
ULYSSES = (
    "offstep has no sequence parallelism: each device holds whole sequences; the run is otherwise the same, "
    "and actor.micro_batch_size or actor.micro_token_budget bound the memory"
)
MEGATRON = "offstep trains with FSDP2 only; drop the megatron keys (and use strategy=fsdp2)"
