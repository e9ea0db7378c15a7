"""The recorded schedule of a fully asynchronous run (``schedule.jsonl`` in its folder), and replaying
it (``pipeline.replay``).

With ``pipeline.max_staleness >= 1`` where a weight load lands inside a replica's samples, which
samples share its batches and which finished groups a step trains all depend on timing, so two runs
of one config differ. Each run records them: a replica's decode-step schedule
(``offstep.rollout.engines.replica_schedule``) and the groups each step trained. A run of the same config given that
record makes every replica load, admit and suspend at the recorded decode steps and every step train
the recorded groups; everything else in a run is already a function of its seeds.

``schedule.jsonl`` holds one line when the stream starts (``{"step": s, "start": true, ...}``, ``s``:
the step it resumes after) and one per step: the admission numbers of the groups it trained and,
per replica, the events recorded since the step before. A schedule that records a resume or a
replaced replica is not replayed (the events of a new replica or of a resumed stream start again at
decode step 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from offstep.errors import ConfigError
from offstep.rollout.engines.replica_schedule import ADMIT, LOAD, SUSPEND, UNTIL

KINDS = {LOAD, SUSPEND, ADMIT, UNTIL}

SCHEDULE_FILE = "schedule.jsonl"

# Keys that may differ between a run and its replay: where it writes and how it reports.
FREE_KEYS = (
    "trainer.output_dir",
    "trainer.progress",
    "trainer.status_interval_s",
    "trainer.loggers",
    "trainer.wandb_project",
    "trainer.resume",
    "pipeline.replay",
)


@dataclass
class Recorded:
    """A run's schedule: the groups of each step, and each replica's events in order."""

    replicas: int
    batch: int
    steps: dict[int, list[int]] = field(default_factory=dict)
    events: list[list] = field(default_factory=list)


def schedule_path(replay: str) -> Path:
    """``pipeline.replay`` (a run folder or its schedule file) as the schedule file."""
    p = Path(replay)
    return p / SCHEDULE_FILE if p.is_dir() else p


def read_schedule(replay: str) -> Recorded:
    """The schedule ``pipeline.replay`` names; ``ValueError`` saying what is wrong with it."""
    from offstep.telemetry.metrics import read_jsonl

    path = schedule_path(replay)
    lines = read_jsonl(path)
    starts = [r for r in lines if r.get("start")]
    if len(starts) != 1 or lines[0] is not starts[0]:
        raise ConfigError(
            f"{path} records {len(starts)} starts of the stream (a resumed run); only an uninterrupted "
            f"run can be replayed"
        )
    try:
        rec = Recorded(int(starts[0]["replicas"]), int(starts[0]["batch"]))
        rec.events = [[] for _ in range(rec.replicas)]
        for r in lines[1:]:
            if r.get("replaced"):
                raise ConfigError(
                    f"{path}: a replica was replaced at step {r['step']} (rollout.max_restarts); a run "
                    f"with a replaced replica cannot be replayed"
                )
            rec.steps[int(r["step"])] = [int(g) for g in r["groups"]]
            if len(r["events"]) != rec.replicas:
                raise ConfigError(
                    f"{path}: step {r['step']} has events of {len(r['events'])} replicas, not {rec.replicas}"
                )
            for mine, new in zip(rec.events, r["events"]):
                mine.extend([int(e[0]), str(e[1]), *e[2:]] for e in new)
                if {e[1] for e in new} - KINDS:
                    raise ConfigError(
                        f"{path}: step {r['step']} has events of kinds {sorted({e[1] for e in new} - KINDS)}"
                        f", not one of {sorted(KINDS)}"
                    )
    except (KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"{path} is not a schedule an offstep run wrote ({type(e).__name__}: {e})") from None
    return rec


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def replay_problems(cfg) -> list[str]:
    """What stops ``cfg`` from replaying ``pipeline.replay``: a missing or unreadable schedule, a
    recorded run of another config, or an output folder that is the recorded run's own."""
    replay = cfg.pipeline.replay
    if not replay:
        return []
    path = schedule_path(replay)
    if not path.is_file():
        return [
            f"pipeline.replay={replay!r}: no {SCHEDULE_FILE} there; give the folder of a run made with "
            f"pipeline.mode=fully_async (or its {SCHEDULE_FILE})"
        ]
    if path.parent.resolve() == Path(cfg.trainer.output_dir).resolve():
        return [
            f"pipeline.replay={replay!r} is this run's own trainer.output_dir; replay into another folder "
            f"(trainer.output_dir=...)"
        ]
    try:
        read_schedule(replay)
    except ValueError as e:
        return [f"pipeline.replay={replay!r}: {e}"]
    recorded_cfg = path.parent / "config.yaml"
    if not recorded_cfg.is_file():
        return [f"pipeline.replay={replay!r}: no config.yaml beside {SCHEDULE_FILE}, so the run it records is unknown"]
    from omegaconf import OmegaConf

    mine = _flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    theirs = _flat(OmegaConf.to_container(OmegaConf.load(recorded_cfg)))
    differ = sorted(k for k in mine.keys() | theirs.keys() if k not in FREE_KEYS and mine.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k}={theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ[:6])
        return [
            f"pipeline.replay={replay!r}: the recorded run had another config ({shown}"
            f"{' ...' if len(differ) > 6 else ''}); replay it with its own config (its config.yaml)"
        ]
    return []
