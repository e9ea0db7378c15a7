"""Run checkpoints on disk: their format, how they are committed, which one a resume picks, and
how many are kept.

A checkpoint of step ``s`` is the folder ``<output_dir>/checkpoints/step_<s:06d>``::

    actor/              the actor's model and optimizer shards (DCP: .metadata, __<rank>_0.distcp)
                        and rank<i>.json (scheduler, RNG states, counters); offstep/train/checkpoint.py
    critic/             the same for the critic (GAE only)
    config.yaml         the configuration of the run that wrote it
    trainer_state.json  written last: the run id, step, policy version, clock origin, prompt stream
                        position, KL controller, rollout restarts, and the batches generating ahead

Committing: it is written into ``step_<s>.partial``, every file and folder is fsynced, and then
the folder is renamed to ``step_<s>``. Re-saving a step that exists renames the old folder to
``step_<s>.replaced`` first and deletes it once the new one is in, so at every moment one complete
copy exists (a ``.replaced`` folder left by a crash counts as that step until the next save cleans
it up). A crash while writing leaves at most a ``.partial`` folder, which no resume picks and the
next save clears away. Pruning (``trainer.keep_checkpoints``) deletes only checkpoints whose
``trainer_state.json`` carries this run's id, never the one just written.

Reading runs no code of the checkpoint's: ``trainer_state.json`` is JSON decoded field by field
(floats round-trip exactly; NaN and infinities are written as Python's json writes them),
``config.yaml`` is read with ``yaml.safe_load`` as plain data (an OmegaConf interpolation such as
``${oc.env:...}`` stays a string and is never expanded), and the role folders are read by
``offstep/train/checkpoint.py``'s restricted reader. :func:`open_checkpoint` checks all of it before
a resume or an export uses a checkpoint, and names the step and path of a damaged one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from offstep.batch import GenTiming, Sample, Span
from offstep.config.loader import ConfigError
from offstep.pipeline.batching import Generated
from offstep.pipeline.faults import pause_point
from offstep.train.checkpoint import CheckpointError, check_role, fsync_tree, replace_dir, write_durably, write_failed

_NAME = re.compile(r"^step_(\d+)(\.replaced)?$")
STATE_FILE = "trainer_state.json"
LEGACY_STATE_FILE = "trainer_state.pt"  # offstep before the JSON format: a pickle, never loaded
FORMAT = 1
ROLES = ("actor", "critic")
# Keys a resumed run must share with the run that wrote the checkpoint, or it would not be the
# same run continued (the rest, e.g. total_steps, logging, may change).
MUST_MATCH = (
    "model.path", "data.train_files", "data.task", "data.task_options", "data.train_batch_size",
    "rollout.n", "pipeline.max_staleness", "trainer.seed", "algorithm.adv_estimator",
)


@dataclass
class TrainerState:
    """The driver's share of a checkpoint (the trainer roles write their own shards)."""

    step: int  # the last step done
    version: int  # the trainer's policy version
    t0: float  # the run's clock origin (timeline.jsonl is relative to it)
    stream: dict  # PromptStream.state_dict(): epoch, position, order
    in_flight: list  # (batch index, epoch, prompt indices, Generated) of each batch generating ahead
    restarts: int  # rollout replicas replaced so far
    kl_ctrl: dict | None = None  # the KL-in-reward controller's state


@dataclass
class Loaded:
    """A checkpoint that passed :func:`open_checkpoint`'s checks."""

    path: Path
    state: TrainerState
    run_id: str  # the run that wrote it
    config_yaml: str


# ------------------------------------------------------------------ trainer_state.json
def _span(s: Span | None) -> list | None:
    return None if s is None else [s.start, s.end, s.version]


def _unspan(v: list | None) -> Span | None:
    return None if v is None else Span(float(v[0]), float(v[1]), v[2])


_SAMPLE_FIELDS = {f.name for f in fields(Sample)}


def _sample(d: dict) -> Sample:
    if not isinstance(d, dict) or not set(d) <= _SAMPLE_FIELDS:
        raise ValueError(f"a sample with fields {sorted(d) if isinstance(d, dict) else type(d).__name__}")
    return Sample(**d)


def _encode_generated(g: Generated) -> dict:
    """Every sample once: those of the rounds in order, then the training samples as indices into
    them (they are the same objects), so a decoded batch shares samples as the original did."""
    flat: list[dict] = []
    where: dict[int, int] = {}
    rounds = []
    for results in g.rounds:
        per_replica = []
        for samples, timing in results:
            for s in samples:
                where[id(s)] = len(flat)
                flat.append(dataclasses.asdict(s))
            per_replica.append([len(samples), _span(timing.gen), _span(timing.ref)])
        rounds.append(per_replica)
    chosen = [where[id(s)] if id(s) in where else dataclasses.asdict(s) for s in g.samples]
    return {"round_samples": flat, "rounds": rounds, "samples": chosen, "prompt_of": [[u, i] for u, i in g.prompt_of.items()],
            "kept_groups": g.kept_groups, "filled_groups": g.filled_groups}


def _decode_generated(d: dict) -> Generated:
    flat = [_sample(s) for s in d["round_samples"]]
    pos, rounds = 0, []
    for per_replica in d["rounds"]:
        results = []
        for n, gen, ref in per_replica:
            results.append((flat[pos : pos + n], GenTiming(_unspan(gen), _unspan(ref))))
            pos += n
        rounds.append(results)
    if pos != len(flat):
        raise ValueError(f"the rounds hold {pos} samples, the file {len(flat)}")
    samples = [flat[x] if isinstance(x, int) else _sample(x) for x in d["samples"]]
    return Generated(rounds, samples, {int(u): int(i) for u, i in d["prompt_of"]}, int(d["kept_groups"]),
                     int(d["filled_groups"]))


def _plain(o):
    """json's hook for what it cannot write: NumPy scalars and arrays (e.g. in reward_extra)."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"a {type(o).__name__} cannot be stored in {STATE_FILE}")


def encode_state(state: TrainerState, run_id: str) -> str:
    in_flight = [{"batch": b, "epoch": e, "prompts": list(idx), "generated": _encode_generated(g)}
                 for b, e, idx, g in state.in_flight]
    doc = {"format": FORMAT, "run_id": run_id, "step": state.step, "version": state.version, "t0": state.t0,
           "restarts": state.restarts, "stream": state.stream, "kl_ctrl": state.kl_ctrl, "in_flight": in_flight}
    return json.dumps(doc, default=_plain)


def decode_state(text: str) -> tuple[TrainerState, str]:
    """(state, run id) from ``trainer_state.json``; ``ValueError`` (or ``KeyError``/``TypeError``)
    for anything that is not what :func:`encode_state` writes."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a trainer state of format {FORMAT}")
    in_flight = [(int(b["batch"]), int(b["epoch"]), [int(i) for i in b["prompts"]], _decode_generated(b["generated"]))
                 for b in doc["in_flight"]]
    stream, kl = doc["stream"], doc["kl_ctrl"]
    if not isinstance(stream, dict) or not (kl is None or isinstance(kl, dict)):
        raise ValueError("stream / kl_ctrl are not objects")
    state = TrainerState(int(doc["step"]), int(doc["version"]), float(doc["t0"]), stream, in_flight,
                         int(doc["restarts"]), kl)
    return state, str(doc["run_id"])


def read_run_id(path: Path) -> str | None:
    """The run id in a checkpoint's state, or ``None`` when it cannot be read."""
    try:
        doc = json.loads((path / STATE_FILE).read_text())
        return str(doc["run_id"]) if isinstance(doc, dict) else None
    except (OSError, ValueError, KeyError):
        return None


def read_config(text: str) -> dict:
    """A saved ``config.yaml`` as plain data: no YAML tags, no OmegaConf interpolation."""
    saved = yaml.safe_load(text)
    if not isinstance(saved, dict):
        raise ValueError("not a YAML mapping")
    return saved


def select(tree: dict, key: str):
    """``tree["a"]["b"]`` for ``key = "a.b"``; ``None`` where a part is missing."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


# ------------------------------------------------------------------ which checkpoints there are
def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint under ``root``, oldest first (complete: its
    state file, written last, is there; whether it is intact, :func:`open_checkpoint` says)."""
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name.endswith(".replaced")):  # step_N before step_N.replaced
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.setdefault(int(m.group(1)), p)
    return sorted(found.items())


def open_checkpoint(path: Path) -> Loaded:
    """Check a checkpoint folder without running anything in it: its state decodes, its config is
    YAML, the actor (and critic) shards are all there at full length. Raises
    :class:`CheckpointError` naming the step and path of a damaged one."""
    m = _NAME.match(path.name)
    step = int(m.group(1)) if m else None

    def damaged(why: str) -> CheckpointError:
        return CheckpointError(f"the checkpoint of step {step} at {path} is damaged or incomplete: {why}")

    try:
        state, run_id = decode_state((path / STATE_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise damaged(f"{STATE_FILE} cannot be read ({type(e).__name__}: {e})") from None
    if step is not None and state.step != step:
        raise damaged(f"{STATE_FILE} is of step {state.step}")
    try:
        config_yaml = (path / "config.yaml").read_text()
        read_config(config_yaml)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise damaged(f"config.yaml cannot be read ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not (path / "actor").is_dir():
        raise damaged("it has no actor/ folder")
    for role in ROLES:
        if (path / role).is_dir() and (problem := check_role(path / role)):
            raise damaged(problem)
    return Loaded(path, state, run_id, config_yaml)


class Checkpoints:
    """The checkpoints of the run ``run_id`` under ``<output_dir>/checkpoints``."""

    def __init__(self, output_dir: str | Path, keep: int = 0, run_id: str = ""):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep
        self.run_id = run_id

    def staging(self, step: int) -> Path:
        """A clean ``.partial`` folder to write the checkpoint of ``step`` into (clearing what an
        earlier crash left: ``.partial`` folders, and ``.replaced`` ones whose step is back)."""
        path = self.root / f"step_{step:06d}.partial"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            for old in self.root.glob("step_*.replaced"):
                final = old.with_name(old.name.removesuffix(".replaced"))
                if final.exists():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(old, final)
            path.mkdir()
        except OSError as e:
            raise write_failed(path, e) from None
        return path

    def commit(self, staging: Path, state: TrainerState, config_yaml: str, before_publish: Callable[[], None] = lambda: None) -> Path:
        """Write the config and, last, the driver's state; fsync everything; rename into place.
        ``before_publish`` runs just before the rename: what must be on disk whenever the
        checkpoint is (the run's records of its step: a resume from it keeps them, and writes
        none of that step again)."""
        final = step_dir(self.root, state.step)
        try:
            write_durably(staging / "config.yaml", config_yaml)
            write_durably(staging / STATE_FILE, encode_state(state, self.run_id))
            fsync_tree(staging)
            pause_point("state", state.step)
            before_publish()
            replace_dir(staging, final, final.with_name(final.name + ".replaced"))
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)  # give the space back; the last commit stays
            raise write_failed(staging, e) from None
        pause_point("published", state.step)
        self._prune(state.step)
        return final

    def _prune(self, committed: int) -> None:
        """Keep the checkpoint just written and the newest ``keep - 1`` older ones of this run."""
        if self.keep <= 0:
            return
        ours = [p for s, p in complete_checkpoints(self.root)
                if s < committed and not p.name.endswith(".replaced") and read_run_id(p) == self.run_id]
        for path in ours[: max(0, len(ours) - (self.keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)

    def latest(self, log: Callable[[str], None] = print, step: int = 0) -> tuple[Loaded | None, list[Path]]:
        """The newest intact checkpoint of this run (of any run when ``run_id`` is empty), or that
        of ``step`` (which must be intact). A damaged or foreign one is reported and the one before
        it tried. Returns it (``None`` if
        there is none) and the folders passed over."""
        found = complete_checkpoints(self.root)
        if step:
            found = [(s, p) for s, p in found if s == step]
            if not found:
                have = [s for s, _ in complete_checkpoints(self.root)]
                raise ConfigError(f"{self.root} has no checkpoint of step {step} (trainer.resume_step={step}); "
                                  f"it has steps {have}")
        skipped: list[Path] = []
        for _, path in reversed(found):
            try:
                loaded = open_checkpoint(path)
                if self.run_id and loaded.run_id != self.run_id:
                    raise CheckpointError(f"the checkpoint {path} was written by run {loaded.run_id}, not by this "
                                          f"folder's run {self.run_id}")
            except CheckpointError as e:
                if step:
                    raise
                log(f"offstep: {e}; passing over it")
                skipped.append(path)
                continue
            if skipped:
                log(f"offstep: resuming from the previous complete checkpoint instead: step {loaded.state.step} ({path})")
            return loaded, skipped
        return None, skipped

    def set_aside_after(self, step: int, damaged: list[Path], log: Callable[[str], None] = print) -> None:
        """Rename the checkpoints of steps after ``step`` (a resume from ``step`` abandons them)
        to ``<name>.superseded`` / ``.damaged``, so that no later resume picks them and nothing
        deletes them."""
        for s, path in complete_checkpoints(self.root):
            if s > step:
                suffix = ".damaged" if path in damaged else ".superseded"
                aside, n = path.with_name(path.name + suffix), 1
                while aside.exists():
                    aside, n = path.with_name(f"{path.name}{suffix}-{n}"), n + 1
                os.rename(path, aside)
                log(f"offstep: resuming from step {step}: {path.name} moved to {aside.name} (kept, never resumed from)")

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint folder that ``trainer.resume`` names: ``off`` none; ``auto`` the latest
        intact one (none if there is none); otherwise a path, which must exist."""
        if resume == "off":
            return None
        if resume == "auto":
            loaded, _ = self.latest(lambda _: None)
            return loaded.path if loaded else None
        return resolve_path(resume)


def resolve_path(path: str | Path, step: int | None = None) -> Path:
    """A checkpoint folder from a checkpoint folder, a run directory (its latest, or ``step``)."""
    p = Path(path)
    if (p / STATE_FILE).is_file() and step is None:
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = dict(complete_checkpoints(root))
    if not found:
        legacy = " (its checkpoints are of an older offstep: trainer_state.pt, a pickle, which is not loaded)" if any(
            root.glob(f"step_*/{LEGACY_STATE_FILE}")) else ""
        raise ConfigError(
            f"{str(path)!r} holds no complete checkpoint{legacy} (looked for {root}/step_<N>/{STATE_FILE}); give a run "
            f"directory trained with trainer.save_freq > 0, or one of its checkpoints/step_<N> folders"
        )
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ConfigError(f"{str(path)!r} has no checkpoint of step {step}; it has steps {sorted(found)}")
    return found[step]


def load_state(path: Path) -> TrainerState:
    return open_checkpoint(path).state


def check_compatible(saved_yaml: str, cfg) -> None:
    """Refuse to resume a checkpoint written by a run that differs in a key that changes what
    the continued run would compute."""
    saved, now = read_config(saved_yaml), dataclasses.asdict(cfg)
    diffs = [f"{key}: checkpoint {select(saved, key)!r}, now {select(now, key)!r}"
             for key in MUST_MATCH if select(saved, key) != select(now, key)]
    if diffs:
        raise ConfigError(
            "the checkpoint was written by a different run configuration (" + "; ".join(diffs) + "); resume with "
            "the same values, or start a new run with trainer.resume=off or another trainer.output_dir"
        )
