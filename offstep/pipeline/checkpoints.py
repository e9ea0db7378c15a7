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
``trainer_state.json`` carries this run's id, never the one just written, nor (``trainer.keep_best``)
the one whose step scored best at its validation, as the run's ``metrics.jsonl`` records it
(:func:`best_checkpoint`; the step's record is on disk before its checkpoint is committed).

Reading runs no code of the checkpoint's: ``trainer_state.json`` is JSON decoded field by field,
each value's type checked (``offstep/pipeline/trainer_state.py``), ``config.yaml`` is read as plain YAML data with no aliases (an OmegaConf
interpolation such as ``${oc.env:...}`` stays a string and is never expanded), and the role folders
are read by ``offstep/train/checkpoint.py``'s restricted reader. The state lists every other file
of the checkpoint with its size and SHA-256 (``files``), so bytes garbled after the write are
caught before a worker loads them. No file of a checkpoint is read through a symbolic link.
:func:`open_checkpoint` checks all of it before a resume or an export uses a checkpoint, and names
the step and path of a damaged one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offstep.errors import CheckpointError, ConfigError, LinkRefused, NotAFile, OffstepError
from offstep.files import (
    MAX_CONFIG_BYTES,
    loads_json,
    loads_yaml,
    open_regular,
    read_text,
    refuse_links,
    refuse_links_under,
    remove_tree,
    short,
    walk,
)
from offstep.pipeline.trainer_state import STATE_FILE, TrainerState, decode_state, encode_state
from offstep.telemetry.names import Role
from offstep.train.checkpoint import check_role, fsync_tree, replace_dir, write_durably, write_failed

_NAME = re.compile(r"^step_(\d+)(\.replaced)?$")
LEGACY_STATE_FILE = "trainer_state.pt"  # offstep before the JSON format: a pickle, never loaded
# The phases of a checkpoint write, in order: ``begin`` (the step's records on disk, nothing of the
# checkpoint yet), ``staged`` (the ``step_<N>.partial`` folder made, no shard yet), ``shards`` (the
# roles' shards written), ``state`` (``trainer_state.json`` written and everything fsynced, not yet
# renamed), ``published`` (renamed to ``step_<N>``, not yet pruned).
PHASES = ("begin", "staged", "shards", "state", "published")
ROLES = (Role.ACTOR, Role.CRITIC)  # a checkpoint's role folders, named after the role groups
# Keys a resumed run must share with the run that wrote the checkpoint, or it would not be the
# same run continued (the rest, e.g. total_steps, logging, may change).
MUST_MATCH = (
    "model.path",
    "data.train_files",
    "data.task",
    "data.task_options",
    "data.train_batch_size",
    "rollout.n",
    "pipeline.max_staleness",
    "trainer.seed",
    "algorithm.adv_estimator",
)


@dataclass
class Loaded:
    """A checkpoint that passed :func:`open_checkpoint`'s checks."""

    path: Path
    state: TrainerState
    run_id: str  # the run that wrote it
    config_yaml: str


def read_run_id(path: Path) -> str | None:
    """The run id in a checkpoint's state, or ``None`` when it cannot be read."""
    try:
        doc = loads_json(read_text(path / STATE_FILE))
        return doc["run_id"] if isinstance(doc, dict) and isinstance(doc.get("run_id"), str) else None
    except (OSError, ValueError, KeyError):
        return None


def read_config(text: str) -> dict:
    """A saved ``config.yaml`` as plain data: no YAML tags, no aliases, no OmegaConf
    interpolation (``ValueError`` otherwise)."""
    saved = loads_yaml(text)
    if not isinstance(saved, dict):
        raise ValueError("not a YAML mapping")
    return saved


def file_digests(root: Path, skip: tuple[str, ...] = (STATE_FILE,)) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under ``root`` but ``skip`` (links refused)."""
    refuse_links(root)
    out = {}
    for _, _, others in walk(root):
        for entry in others:
            f = Path(entry.path)
            rel = f.relative_to(root).as_posix()
            if rel in skip:
                continue
            h = hashlib.sha256()
            with os.fdopen(open_regular(f), "rb") as fh:  # a link, FIFO or device: refused, never read
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
                out[rel] = [os.fstat(fh.fileno()).st_size, h.hexdigest()]
    return dict(sorted(out.items()))


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
        refuse_links_under(path)
    except (LinkRefused, NotAFile, OSError) as e:
        raise damaged(str(e)) from None
    try:
        state, run_id, files = decode_state(read_text(path / STATE_FILE))
    except (OSError, ValueError, KeyError, TypeError, IndexError, OverflowError) as e:
        raise damaged(f"{STATE_FILE} cannot be read ({type(e).__name__}: {str(e)[:300]})") from None
    if step is not None and state.step != step:
        raise damaged(f"{STATE_FILE} is of step {state.step}")
    try:
        config_yaml = read_text(path / "config.yaml", limit=MAX_CONFIG_BYTES)
        check_saved_config(read_config(config_yaml))
    except (OSError, ValueError) as e:
        raise damaged(f"config.yaml cannot be read ({type(e).__name__}: {str(e)[:300]})") from None
    if not (path / Role.ACTOR).is_dir():
        raise damaged("it has no actor/ folder")
    for role in ROLES:
        if (path / role).is_dir() and (problem := check_role(path / role)):
            raise damaged(problem)
    if files:  # format 2: every file as it was written
        try:
            found = file_digests(path)  # a file added since is not read by a resume or an export
        except (LinkRefused, NotAFile, OSError) as e:
            raise damaged(str(e)) from None
        changed = sorted(f for f in files if found.get(f) != files[f])
        if changed:
            raise damaged(
                f"{changed[0]} is not the file that was written (its size or SHA-256 differs, or it is "
                f"missing{f'; {len(changed)} files differ' if len(changed) > 1 else ''})"
            )
    return Loaded(path, state, run_id, config_yaml)


# What the saved config's fields that offstep reads back must be (resume compares them; export
# builds the model from them).
_SAVED_TYPES = {
    "model.path": (str,),
    "model.dtype": (str,),
    "actor.lora.rank": (int,),
    "actor.lora.alpha": (int, float),
    "actor.lora.dropout": (int, float),
    "trainer.seed": (int,),
    "data.train_batch_size": (int,),
    "rollout.n": (int,),
    "pipeline.max_staleness": (int,),
    "algorithm.adv_estimator": (str,),
}


def check_saved_config(saved: dict) -> None:
    """``ValueError`` naming a field of a saved config whose value has the wrong type."""
    for key, types in _SAVED_TYPES.items():
        v = select(saved, key)
        if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
            raise ValueError(f"{key} is {short(v)}, not a {' or '.join(t.__name__ for t in types)}")
    modules = select(saved, "actor.lora.target_modules")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        raise ValueError(f"actor.lora.target_modules is {short(modules)}, not a list of module names")


def best_checkpoint(run_dir: str | Path, metric: str = "val/acc") -> tuple[int, Path, float] | None:
    """(step, folder, score) of the complete checkpoint whose step scored the highest ``metric``
    in ``<run_dir>/metrics.jsonl`` (the later of equals: the more trained of two policies that
    score the same); ``None`` where no checkpointed step has a finite score."""
    run_dir = Path(run_dir)
    found = dict(complete_checkpoints(run_dir / "checkpoints"))
    path = run_dir / "metrics.jsonl"
    if not found or not (path.exists() or path.is_symlink()):
        return None
    from offstep.telemetry.metrics import read_jsonl

    try:
        records = read_jsonl(path)
    except (OSError, ValueError, OffstepError) as e:
        raise ConfigError(
            f"the best checkpoint is picked by the scores in {path}, which cannot be read ({e}); "
            f"name the checkpoint with --step instead"
        ) from None
    scores: dict[int, float] = {}
    for r in records:
        step, v = r.get("step"), r.get(metric)
        if type(step) is int and step in found and type(v) in (int, float) and math.isfinite(v):
            scores[step] = float(v)
    if not scores:
        return None
    step = max(scores, key=lambda s: (scores[s], s))
    return step, found[step], scores[step]


class Checkpoints:
    """The checkpoints of the run ``run_id`` under ``<output_dir>/checkpoints``; with ``best_metric``
    pruning spares the best-scoring one (``trainer.keep_best``). ``on_phase`` is called with
    ``(phase, step)`` as a write reaches each of ``PHASES``: a timing seam, by which the random-kill
    tests' launcher (``tests/kill_points.py``) holds the driver at one to kill it there."""

    def __init__(
        self,
        output_dir: str | Path,
        keep: int = 0,
        run_id: str = "",
        best_metric: str | None = None,
        on_phase: Callable[[str, int], None] | None = None,
    ):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep
        self.run_id = run_id
        self.best_metric = best_metric
        self.on_phase = on_phase

    def phase(self, name: str, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(name, step)

    def staging(self, step: int) -> Path:
        """A clean ``.partial`` folder to write the checkpoint of ``step`` into (clearing what an
        earlier crash left: ``.partial`` folders, and ``.replaced`` ones whose step is back)."""
        path = self.root / f"step_{step:06d}.partial"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.partial"):
                remove_tree(stale)
            for old in self.root.glob("step_*.replaced"):
                final = old.with_name(old.name.removesuffix(".replaced"))
                if final.exists():
                    remove_tree(old)
                else:
                    os.rename(old, final)
            path.mkdir()
        except OSError as e:
            raise write_failed(path, e) from None
        return path

    def commit(
        self, staging: Path, state: TrainerState, config_yaml: str, before_publish: Callable[[], None] = lambda: None
    ) -> Path:
        """Write the config and, last, the driver's state; fsync everything; rename into place.
        ``before_publish`` runs just before the rename: what must be on disk whenever the
        checkpoint is (the run's records of its step: a resume from it keeps them, and writes
        none of that step again)."""
        final = step_dir(self.root, state.step)
        try:
            write_durably(staging / "config.yaml", config_yaml)
            write_durably(staging / STATE_FILE, encode_state(state, self.run_id, file_digests(staging)))
            fsync_tree(staging)
            self.phase("state", state.step)
            before_publish()
            replace_dir(staging, final, final.with_name(final.name + ".replaced"))
        except OSError as e:
            remove_tree(staging)  # give the space back; the last commit stays
            raise write_failed(staging, e) from None
        self.phase("published", state.step)
        self._prune(state.step)
        return final

    def _prune(self, committed: int) -> None:
        """Keep the checkpoint just written, the newest ``keep - 1`` older ones of this run, and
        with ``best_metric`` the best-scoring one."""
        if self.keep <= 0:
            return
        best = best_checkpoint(self.root.parent, self.best_metric) if self.best_metric else None
        ours = [
            p
            for s, p in complete_checkpoints(self.root)
            if s < committed
            and not p.name.endswith(".replaced")
            and read_run_id(p) == self.run_id
            and (best is None or s != best[0])
        ]
        for path in ours[: max(0, len(ours) - (self.keep - 1))]:
            remove_tree(path)

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
                raise ConfigError(
                    f"{self.root} has no checkpoint of step {step} (trainer.resume_step={step}); it has steps {have}"
                )
        skipped: list[Path] = []
        for _, path in reversed(found):
            try:
                loaded = open_checkpoint(path)
                if self.run_id and loaded.run_id != self.run_id:
                    raise CheckpointError(
                        f"the checkpoint {path} was written by run {loaded.run_id}, not by this "
                        f"folder's run {self.run_id}"
                    )
            except CheckpointError as e:
                if step:
                    raise
                log(f"offstep: {e}; passing over it")
                skipped.append(path)
                continue
            if skipped:
                log(
                    f"offstep: resuming from the previous complete checkpoint instead: step {loaded.state.step} ({path})"
                )
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
        legacy = (
            " (its checkpoints are of an older offstep: trainer_state.pt, a pickle, which is not loaded)"
            if any(root.glob(f"step_*/{LEGACY_STATE_FILE}"))
            else ""
        )
        raise ConfigError(
            f"{str(path)!r} holds no complete checkpoint{legacy} (looked for {root}/step_<N>/{STATE_FILE}); give a run "
            f"directory trained with trainer.save_freq > 0, or one of its checkpoints/step_<N> folders"
        )
    if step is None:
        return found[max(found)]
    if step not in found:
        raise ConfigError(f"{str(path)!r} has no checkpoint of step {step}; it has steps {sorted(found)}")
    return found[step]


def earlier_intact(path: Path, use: str = "resume from", flag: str = "trainer.resume_step=") -> str:
    """What to do about the damaged checkpoint ``path``: the newest intact one before it, named
    with ``flag`` (``trainer.resume_step=`` for a resume, ``--step `` for an export)."""
    m = _NAME.match(path.name)
    step = int(m.group(1)) if m else None
    for s, p in reversed(complete_checkpoints(path.parent)):
        if step is not None and s < step:
            try:
                open_checkpoint(p)
            except CheckpointError:
                continue
            return f"{use} the intact checkpoint before it with {flag}{s}"
    return "there is no earlier intact checkpoint"


def load_failed(path: Path, cause: BaseException) -> CheckpointError:
    """The error for a checkpoint that passed :func:`open_checkpoint` but that a worker could not
    load (bytes that only a load reveals): names the resume step to fall back to."""
    fix = earlier_intact(path)
    if fix.startswith("there is no"):
        fix += ": start afresh with another trainer.output_dir"
    return CheckpointError(f"the checkpoint {path} could not be loaded ({str(cause)[:400]}); {fix}")


def load_state(path: Path) -> TrainerState:
    return open_checkpoint(path).state


def check_compatible(saved_yaml: str, cfg) -> None:
    """Refuse to resume a checkpoint written by a run that differs in a key that changes what
    the continued run would compute."""
    saved, now = read_config(saved_yaml), dataclasses.asdict(cfg)
    diffs = [
        f"{key}: checkpoint {short(select(saved, key))}, now {short(select(now, key))}"
        for key in MUST_MATCH
        if select(saved, key) != select(now, key)
    ]
    frozen = select(saved, "actor.freeze_vision_tower") is True  # a checkpoint from before the key: false
    if frozen != cfg.actor.freeze_vision_tower:  # a frozen tower is not in the checkpoint
        diffs.append(f"actor.freeze_vision_tower: checkpoint {frozen}, now {cfg.actor.freeze_vision_tower}")
    if diffs:
        raise ConfigError(
            "the checkpoint was written by a different run configuration (" + "; ".join(diffs) + "); resume with "
            "the same values, or start a new run with trainer.resume=off or another trainer.output_dir"
        )
