"""Kills at random moments: a tiny run is SIGKILLed (its whole process group) again and again and
resumed each time, until it completes; every record must equal an uninterrupted run's.

    .venv/bin/python -m benchmarks.random_kills --only builtin-k0 builtin-k1 builtin-k2 [--kills 20] [--seed 0]

Per configuration (``SETUPS``): one uninterrupted reference run, then runs of the same command
(``offstep train``, in its own session, so the process group of the driver is what is killed)
killed at moments drawn by a seeded RNG, each followed by a restart of the same command, until
``--kills`` kills are done and the last run completes (a run that completes before its kill is due
ends a round, and so does the start after the last step's checkpoint is written, with no kill;
the next round starts in a fresh folder). The kinds of moment (``KINDS``):

``startup``    uniform over the reference's start-up (before the first record)
``running``    uniform over the training this start has left (the reference's training time, in
               proportion to the steps after the checkpoint it resumes from), from its first new
               timeline line
``partial``    uniform over the reference's checkpoint write, from when a new ``.partial`` appears
``pause``      inside a checkpoint write on purpose: the driver pauses there (started through the
               launcher ``tests/kill_points.py``) at a drawn point and step
``early``      in a fresh folder, the driver held (as for ``pause``) at the first checkpoint's
               ``begin``: steps recorded, nothing of a checkpoint written, so the restart cannot
               resume and starts afresh (elsewhere: as soon as a new step record is on disk)

The first two kills are ``PLAN``'s (an ``early`` one and a ``pause`` one), the rest drawn.
Every restart is the same command: with an intact checkpoint it resumes; killed before the first
checkpoint, with records already written, it moves them aside (``<folder>.old-<time>``) and starts
afresh, as ``trainer.resume=auto`` does for a run of the folder with no intact checkpoint.

After each kill: no process of the run's session (``pgrep -s``), nor any process that descended
from the driver, is left once Ray's workers have noticed (within ``kill_processes.LEFTOVER_S``); where the kill
landed, read off the folder (a new ``.partial`` or a paused write: during a checkpoint write; no
complete checkpoint: before the first; else between); and the records so far must be the
reference's (``check_records``). A resume is exact when the records after the run that follows it
(killed again, or complete) pass. The last run's records must equal the reference's in full.

Writes ``benchmarks/results/results_random_kills.json`` (every kill) and ``.md`` (per configuration:
kills, where they landed, exact resumes, time); rows of other configurations are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from benchmarks.common import RESULTS, cpu_kind
from benchmarks.kill_processes import count_lines, spawn, wait_gone
from benchmarks.random_kills_report import write_report
from benchmarks.readme import refresh
from benchmarks.run_records import Records, check_records, checkpoint_steps, partial_writes, read_lines
from offstep.pipeline.checkpoints import PHASES

STORE = RESULTS / "results_random_kills"  # .json: every kill; .md: the tables
KINDS = ("startup", "running", "partial", "pause")
POINTS = PHASES[1:]  # where a ``pause`` holds a write; at ``begin`` none has begun (the ``early`` kill)
# The first two kills of every configuration, so that each has one before the first checkpoint
# (the restart starts afresh) and one paused inside a checkpoint write (a drawn point and step).
PLAN = ["early", "pause"]
WEIGHTS = (0.15, 0.45, 0.15, 0.25)
# A deterministic reward that is not constant (the tiny model earns nothing on arithmetic).
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (len(solution_str) % 3) / 2.0
'''


@dataclass
class Setup:
    name: str
    k: int
    kills: int  # the default count (--kills overrides)
    engine: str = "builtin"
    lora: int = 0
    agent: str = "single_turn_agent"
    mode: str = "batch"  # pipeline.mode


SETUPS = {
    s.name: s
    for s in [
        Setup("builtin-k0", 0, 20),
        Setup("builtin-k1", 1, 20),
        Setup("builtin-k2", 2, 20),
        # Fewer: a vLLM start takes about a minute here; LoRA and tool rows add state to a resume but
        # no new kind of moment.
        Setup("vllm-k1", 1, 3, engine="vllm"),
        Setup("lora-k1", 1, 5, lora=8),
        Setup("tools-k1", 1, 5, agent="tool_agent"),
        # The fully asynchronous mode with k = 0, the setting in which its records are reproducible (with
        # k >= 1 where a load lands inside a sample depends on timing; tests/pipeline/test_fully_async.py checks
        # that a resume there trains every stored group once).
        Setup("fully-async-k0", 0, 10, mode="fully_async"),
    ]
}


def overrides(s: Setup, out: Path, reward: Path, steps: int, save_freq: int) -> list[str]:
    return [
        "preset=tiny",
        f"pipeline.mode={s.mode}",
        f"rollout.engine={s.engine}",
        f"actor.lora.rank={s.lora}",
        f"rollout.agent.default_agent={s.agent}",
        f"pipeline.max_staleness={s.k}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        f"trainer.save_freq={save_freq}",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress=plain",
        f"reward.custom_path={reward}",
        "reward.num_threads=1",
    ]


# ------------------------------------------------------------------ one run, maybe killed
@dataclass
class Profile:
    """The reference run's times: start-up (to its first timeline line), training (from there to
    the end), a checkpoint write."""

    startup_s: float
    train_s: float
    checkpoint_s: float
    wall_s: float


@dataclass
class Kill:
    round: int
    kind: str  # what the moment was drawn as (KINDS, or early)
    detail: str  # the delay drawn, or the paused point
    landed: str = ""  # before first checkpoint / during checkpoint write / between checkpoints
    at: str = ""  # the last step recorded and the last checkpoint at the kill
    leftover_s: float = 0.0  # seconds until no process of the run was left
    leftovers: list = field(default_factory=list)
    resumed: str = ""  # how the run that followed started: "from step N" / "afresh"
    problems: list = field(default_factory=list)  # after the run that followed

    @property
    def exact(self) -> bool:
        return not self.problems and not self.leftovers


class Attempt:
    """One start of the command: ``wait_moment`` waits for the drawn moment (``True``: reached,
    the run still going), ``kill`` kills its process group and checks what is left."""

    def __init__(self, args: list[str], run: Path, log: Path, pause: str | None = None):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}
        self.run, self.log = run, log
        self.partials0 = partial_writes(run)
        self.timeline0 = count_lines(run / "timeline.jsonl")
        self.checkpoints0 = checkpoint_steps(run)
        self.t0 = time.time()
        self.proc = spawn(args, env, log, pause)

    def _until(self, ready, timeout: float) -> bool:
        t0 = time.time()
        while not ready():
            if self.proc.poll() is not None:
                return False
            if time.time() - t0 > timeout:
                raise TimeoutError(f"the moment did not come within {timeout:.0f} s (log: {self.log})")
            time.sleep(0.005)
        return self.proc.poll() is None

    def _training(self) -> bool:
        """Training has begun: resumed (its log says so), or a fresh run's first timeline line
        (after a folder with records was moved aside)."""
        text = self.log.read_text()
        if "offstep: resumed from" in text:
            return True
        if self.checkpoints0 or (self.timeline0 and "moved the previous contents" not in text):
            return False
        return count_lines(self.run / "timeline.jsonl") > 0

    def wait_moment(self, kind: str, arg, timeout: float) -> bool:
        if kind == "startup":
            return self._until(lambda: time.time() - self.t0 >= arg, timeout)
        if kind == "running":
            if not self._until(self._training, timeout):
                return False
            t = time.time()
            return self._until(lambda: time.time() - t >= arg, timeout)
        if kind == "partial":
            if not self._until(lambda: bool(partial_writes(self.run) - self.partials0), timeout):
                return False
            t = time.time()
            return self._until(lambda: time.time() - t >= arg, timeout)
        if kind == "pause":
            return self._until(lambda: Path(arg).exists(), timeout)
        if kind == "early" and arg is not None:  # held at the first checkpoint's start
            return self._until(lambda: Path(arg).exists(), timeout)
        if kind == "early":
            if not self._until(self._training, timeout):
                return False
            n = count_lines(self.run / "metrics.jsonl")
            return self._until(lambda: count_lines(self.run / "metrics.jsonl") > n, timeout)
        raise ValueError(kind)

    def kill(self, marker: Path | None) -> tuple[str, str, float, list[str]]:
        try:
            seen = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            seen = set()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        seconds, left = wait_gone(self.proc.pid, seen)
        ckpts = checkpoint_steps(self.run)
        if (marker is not None and marker.exists()) or (partial_writes(self.run) - self.partials0):
            landed = "during checkpoint write"
        elif not ckpts:
            landed = "before first checkpoint"
        else:
            landed = "between checkpoints"
        steps = [m.get("step") for m in read_lines(self.run / "metrics.jsonl")[0]]
        at = f"step {max(steps, default=0)} recorded, checkpoint {max(ckpts, default=0)}"
        return landed, at, seconds, left

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise TimeoutError(f"the run did not end within {timeout:.0f} s (log: {self.log})") from None

    def started(self) -> str:
        text = self.log.read_text()
        for line in text.splitlines():
            if "offstep: resumed from" in line:
                return "from step " + line.split("(step ")[1].split(",")[0]
        return "afresh"


def reference_run(
    s: Setup, work: Path, reward: Path, steps: int, save_freq: int, timeout: float
) -> tuple[Records, Profile]:
    run = work / "reference"
    a = Attempt(overrides(s, run, reward, steps, save_freq), run, work / "reference.log")
    rc = a.finish(timeout)
    wall = time.time() - a.t0
    if rc != 0:
        raise RuntimeError(f"the reference run of {s.name} failed (rc {rc}): {a.log.read_text()[-3000:]}")
    events, _ = read_lines(run / "timeline.jsonl")
    first = min(e["start"] for e in events)
    last = max(e["end"] for e in events)
    ckpt = [e["end"] - e["start"] for e in events if e["stage"] == "checkpoint"]
    # The timeline's clock starts in the driver, a little after the process did: start-up is the
    # process's wall time less the training time.
    return Records.read(run), Profile(max(0.5, wall - (last - first)), last - first, sum(ckpt) / len(ckpt), wall)


# ------------------------------------------------------------------ a configuration
def draw(
    rng: random.Random, prof: Profile, run: Path, steps: int, save_freq: int, marker: Path, forced: str | None
) -> tuple[str, object, str | None, str] | None:
    """A moment: (kind, its argument for ``wait_moment``, the pause hook's value, how to print it),
    or ``None`` once the last step's checkpoint is written: the restart then has no step left and
    only exits, so it runs to completion and ends the round (kills there tested the exit alone)."""
    have = max(checkpoint_steps(run), default=0)
    if have >= steps:
        return None
    saves = [s for s in range(save_freq, steps + 1, save_freq) if s > have]
    if steps % save_freq and steps > have:
        saves.append(steps)
    kind = forced or rng.choices(KINDS, WEIGHTS)[0]
    if kind.startswith("pause"):
        point = kind.split(":")[1] if ":" in kind else rng.choice(POINTS)
        kind = "pause"
        if saves:
            step = rng.choice(saves)
            marker.unlink(missing_ok=True)
            return kind, str(marker), f"{point}:{step}:{marker}", f"{point} of step {step}"
        kind = "running"  # every checkpoint is written: no write left to pause in
    if kind == "partial" and not saves:
        kind = "running"
    if kind == "startup":
        d = rng.uniform(0, prof.startup_s)
    elif kind == "running":  # over the training this start has left (it resumes at ``have``)
        d = rng.uniform(0, prof.train_s * (steps - have) / steps)
    elif kind == "partial":
        d = rng.uniform(0, prof.checkpoint_s)
    elif kind == "early" and have == 0 and saves:
        marker.unlink(missing_ok=True)
        return kind, str(marker), f"begin:{saves[0]}:{marker}", f"held before step {saves[0]}'s checkpoint"
    else:
        return kind, None, None, "a step recorded"
    return kind, d, None, f"{d:.2f} s"


def run_setup(
    s: Setup,
    kills: int,
    seed: int = 0,
    steps: int = 8,
    save_freq: int = 2,
    work: Path | None = None,
    plan: list[str] | None = None,
    timeout: float = 900,
    log=print,
) -> dict:
    """Reference, then ``kills`` kills (``plan``: the kinds of the first ones, in order; the rest
    drawn), each followed by a restart, in rounds until the last run completes. Returns the
    summary; stops at the first problem."""
    work = Path(work or tempfile.mkdtemp(prefix=f"random-kills-{s.name}-"))
    work.mkdir(parents=True, exist_ok=True)
    reward = work / "reward.py"
    reward.write_text(REWARD)
    t_start = time.time()
    ref, prof = reference_run(s, work, reward, steps, save_freq, timeout)
    log(
        f"{s.name}: reference {prof.wall_s:.1f} s (start-up {prof.startup_s:.1f} s, training {prof.train_s:.1f} s, "
        f"a checkpoint {prof.checkpoint_s:.2f} s)"
    )
    rng = random.Random(f"{seed}:{s.name}")
    marker = work / "paused"
    done: list[Kill] = []
    starts = rounds = 0
    failure = None
    while failure is None and (rounds == 0 or len(done) < kills):
        rounds += 1
        run = work / f"round{rounds}"
        pending: Kill | None = None  # the kill whose restart is the next start
        while failure is None:
            starts += 1
            forced = plan[len(done)] if plan and len(done) < len(plan) else None
            moment = draw(rng, prof, run, steps, save_freq, marker, forced) if len(done) < kills else None
            a = Attempt(
                overrides(s, run, reward, steps, save_freq), run, work / f"start{starts}.log", moment and moment[2]
            )
            if moment is not None and a.wait_moment(moment[0], moment[1], timeout):
                landed, at, secs, left = a.kill(marker if moment[2] and moment[0] == "pause" else None)
                problems = check_records(Records.read(run), ref, final=False)
                if pending is not None:
                    pending.resumed, pending.problems = a.started(), problems
                elif problems:
                    failure = f"the run before kill {len(done) + 1}: {problems}"
                kill = Kill(rounds, moment[0], moment[3], landed, at, round(secs, 2), left)
                done.append(kill)
                log(
                    f"  kill {len(done):2d}: {moment[0]:8s} {moment[3]:22s} -> {landed:24s} ({at}); gone in {secs:.1f} s"
                    + (f"; LEFT: {left}" if left else "")
                    + (f"; PROBLEMS: {problems}" if problems else "")
                )
                if left or problems:
                    failure = failure or f"kill {len(done)}"
                pending = kill
            else:
                rc = a.finish(timeout)
                problems = (
                    check_records(Records.read(run), ref, final=True)
                    if rc == 0
                    else [f"the run failed (rc {rc}): {a.log.read_text()[-2000:]}"]
                )
                if pending is not None:
                    pending.resumed, pending.problems = a.started(), problems
                log(
                    f"  round {rounds} complete after {sum(k.round == rounds for k in done)} kill(s)"
                    + (f"; PROBLEMS: {problems}" if problems else ": every record equals the reference's")
                )
                if problems:
                    failure = f"round {rounds}"
                break
            for old in work.glob(f"round{rounds}.old-*"):  # the records a restart moved aside
                shutil.rmtree(old, ignore_errors=True)
    landed = Counter(k.landed for k in done)
    summary = {
        "setup": asdict(s),
        "kills": len(done),
        "exact": sum(k.exact for k in done),
        "rounds": rounds,
        "starts": starts,
        "landed": dict(landed),
        "seconds": round(time.time() - t_start, 1),
        "reference_s": round(prof.wall_s, 1),
        "steps": steps,
        "save_freq": save_freq,
        "seed": seed,
        "failure": failure,
        "max_leftover_s": max((k.leftover_s for k in done), default=0.0),
        "excluded": sorted(
            {k for m in read_lines(work / "reference" / "metrics.jsonl")[0] for k in m}
            - {k for m in ref.metrics for k in m}
        ),
        "kill_list": [{**asdict(k), "exact": k.exact} for k in done],
    }
    log(
        f"{s.name}: {summary['exact']}/{summary['kills']} exact resumes, landed {dict(landed)}, "
        f"{summary['seconds']:.0f} s" + (f"; FAILED at {failure}" if failure else "")
    )
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=sorted(SETUPS), default=["builtin-k0", "builtin-k1", "builtin-k2"])
    p.add_argument("--kills", type=int, help="kills per configuration (default: its own count, SETUPS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-freq", type=int, default=2)
    p.add_argument("--work", type=Path, help="where the runs go (default: a temporary folder, deleted after)")
    p.add_argument(
        "--no-write",
        action="store_true",
        help="print only; leave benchmarks/results/results_random_kills.* as they are",
    )
    a = p.parse_args()
    store = STORE.with_suffix(".json")
    results = json.loads(store.read_text()) if store.exists() and not a.no_write else {}
    ok = True
    for name in a.only:
        s = SETUPS[name]
        work = a.work / name if a.work else Path(tempfile.mkdtemp(prefix=f"random-kills-{name}-"))
        r = run_setup(s, a.kills or s.kills, a.seed, a.steps, a.save_freq, work, plan=PLAN)
        passed = r["failure"] is None and r["exact"] == r["kills"]
        ok &= passed
        r["command"] = (
            f"python -m benchmarks.random_kills --only {name}"
            + (f" --kills {a.kills}" if a.kills else "")
            + (f" --seed {a.seed}" if a.seed else "")
        )
        r["cpu"], r["date"] = cpu_kind(), time.strftime("%Y-%m-%d")
        results[name] = r
        if not a.work and passed:
            shutil.rmtree(work, ignore_errors=True)
        elif not passed:
            print(f"{name}: the runs and their logs are in {work}")
        if not a.no_write:
            store.write_text(json.dumps(results, indent=1) + "\n")
            write_report(results, STORE.with_suffix(".md"))
    if not a.no_write:
        refresh("random-kills")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
