"""Lending the trainer's GPUs to the rollout while the trainer waits, simulated: what it would gain
over fixed pools, beside what verl reports for its own ("dynamic resource scheduling").

offstep does not lend trainer devices to the rollout; on CPUs it lends the other way
(``pipeline.lend_cores``: the rollout's idle cores to the trainer). This study says what the GPU
direction would be worth before it is built. It is a discrete-event model of the fully
asynchronous pipeline on GPUs, with the simulated engine of ``tests/fakes_stream.py`` made
load-dependent:

* **Pools.** ``devices`` GPUs: ``trainer`` of them train, the rest hold standalone rollout
  replicas of ``per_replica`` GPUs each. With ``lend``, the trainer's GPUs also hold hybrid
  replicas, asleep while the trainer trains.
* **A replica** decodes up to ``slots`` samples at once (continuous batching; a hybrid replica
  ``hybrid_slots``, its memory shared with the trainer's state); a decode step takes ``step0_s +
  step1_s x running samples`` (the weights read once a step, each sample's KV cache read).
  Queued samples go to the least-loaded replica with a free slot. Lengths are lognormal
  (``median``, ``sigma``; capped at ``cap``), drawn per sample from its own random stream, the same
  in every setting.
* **The stream** is offstep's fully asynchronous one (``offstep.pipeline.sample_stream``): group ``g`` is
  admitted while ``g < (held + k + 1) x groups``; a step takes ``groups`` finished groups earliest
  deadline first, and waits for those ``must_take`` says are due (the real function).
* **The trainer** takes ``train_s_per_token x tokens / trainer`` seconds for a batch (prompt and
  response tokens; linear scaling), then syncs: the standalone replicas pause ``sync_s`` between two
  decode steps and their samples continue (partial rollouts).
* **Lending** (verl's policy, simplified): when the trainer would wait for its batch and its last
  wait was longer than a round trip of switches (always, with no standalone replica), its hybrid
  replicas wake (``switch_in_s``: wake, load the weights), samples are rebalanced over all
  replicas (in flight ones keep their tokens; the re-prefill is not charged), and they decode
  until the batch is there. Then they are reclaimed: their samples in flight go back to the
  queue's front with their tokens (verl aborts them and retries them on the standalone replicas),
  and the trainer starts after ``switch_out_s`` (free the KV cache, reload its state).

Measured: samples/s over steps 3..N (steps 1 and 2 fill the pipeline). Everything is simulated: a
row is a schedule's ratio, not a model on a GPU.

    python -m benchmarks.lend_devices_sim             # writes results_lend_devices.md and its section of README.md
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from benchmarks.common import RESULTS
from offstep.pipeline.sample_stream import must_take  # the real admission-and-take rule

OUT = RESULTS / "results_lend_devices.md"
EPS = 1e-9


@dataclass(frozen=True)
class Setting:
    devices: int = 32  # all GPUs
    trainer: int = 16  # the trainer's GPUs; the others hold standalone replicas
    lend: bool = False  # the trainer's GPUs serve as hybrid replicas while it waits
    per_replica: int = 4  # GPUs a replica spans (tensor parallel)
    slots: int = 64  # samples a standalone replica decodes at once
    hybrid_slots: int = 32  # a hybrid replica's (less free memory: the trainer's state stays)
    step0_s: float = 0.010  # a decode step: this ...
    step1_s: float = 0.00015  # ... plus this per running sample
    groups: int = 64  # prompt groups a step
    n: int = 8  # samples a group
    prompt: int = 300  # prompt tokens
    median: float = 600.0  # lognormal response lengths: median ...
    sigma: float = 1.0  # ... and log-space spread (the tail)
    cap: int = 4096
    train_s_per_token: float = 6e-4  # trainer GPU-seconds per token of a batch (prompt and response)
    sync_s: float = 2.0  # a weight sync: the standalone replicas pause this long, and the trainer
    switch_in_s: float = 2.0  # trainer -> rollout: wake the hybrid replicas, load the weights
    switch_out_s: float = 2.0  # rollout -> trainer: abort, free the KV cache, reload the trainer's state
    k: int = 1  # pipeline.max_staleness
    steps: int = 12
    seed: int = 0

    def step_s(self, running: int) -> float:
        return self.step0_s + self.step1_s * running

    def length(self, g: int, j: int) -> int:
        rng = np.random.default_rng([self.seed, g, j])
        return max(1, min(self.cap, int(round(rng.lognormal(math.log(self.median), self.sigma)))))


@dataclass
class _Sample:
    g: int
    length: int
    done: float = 0.0  # tokens decoded (fractional between events)


@dataclass
class _Replica:
    slots: int
    hybrid: bool
    active: bool
    paused_until: float = 0.0
    running: list = field(default_factory=list)


@dataclass
class _Group:
    g: int
    version: int  # the policy the replicas held when it was admitted
    left: int  # samples not finished
    tokens: int
    finished: float | None = None


@dataclass
class Result:
    samples_per_s: float
    step_s: float  # mean over steps 3..N
    wait_s: float  # the trainer's mean wait for its batch (switches included)
    lent_s: float  # mean seconds a step the hybrid replicas decoded
    lends: int  # steps that lent
    staleness: int  # the largest version gap in a trained batch
    decoded: float  # tokens decoded in all replicas (a sample moved between replicas keeps its tokens)
    ends: list[float]  # when each step ended


def mean_length(s: Setting, draws: int = 20_000) -> float:
    """The expected response length under ``s``, by ``draws`` draws of ``s.length``."""
    return float(np.mean([s.length(10**6 + i, 0) for i in range(draws)]))


def with_share(s: Setting, share: float) -> Setting:
    """``s`` with the trainer's GPU-seconds a step ``share`` times the rollout's: a step's samples
    decoded with every slot of a standalone replica busy."""
    mean = mean_length(s)
    rollout_gpu_s = s.groups * s.n * mean * s.step_s(s.slots) / s.slots * s.per_replica
    return replace(s, train_s_per_token=share * rollout_gpu_s / (s.groups * s.n * (s.prompt + mean)))


def simulate(s: Setting) -> Result:
    """Run ``s`` (see the module's docstring) and measure it."""
    standalone = (s.devices - s.trainer) // s.per_replica
    hybrid = s.trainer // s.per_replica if s.lend else 0
    if standalone == 0 and hybrid == 0:
        raise ValueError("no replica: give the rollout GPUs, or lend the trainer's")
    reps = [_Replica(s.slots, False, True) for _ in range(standalone)]
    reps += [_Replica(s.hybrid_slots, True, False) for _ in range(hybrid)]
    queue: deque[_Sample] = deque()
    groups: dict[int, _Group] = {}
    now, version, held, admitted = 0.0, 0, 0, 0
    state, until = "wait", math.inf  # the trainer: wait | switch_in | switch_out | train | sync | done
    lending, lent_step = False, False  # hybrid replicas decoding now; lent in this step already
    wait_from, lent_from = 0.0, 0.0
    waits, lent, ends, staleness, lends, decoded = [], [], [], 0, 0, 0.0

    def admit():
        nonlocal admitted
        while admitted < min(s.steps * s.groups, (held + s.k + 1) * s.groups):
            lengths = [s.length(admitted, j) for j in range(s.n)]
            groups[admitted] = _Group(admitted, held, s.n, s.n * s.prompt + sum(lengths))
            queue.extend(_Sample(admitted, n) for n in lengths)
            admitted += 1

    def ready() -> list[_Group] | None:
        waiting = sorted(groups.values(), key=lambda a: (a.version, a.g))  # earliest deadline first
        must = waiting[: must_take(waiting, version, s.k, s.groups)]
        fill = [a for a in waiting[len(must) :] if a.finished is not None][: s.groups - len(must)]
        if all(a.finished is not None for a in must) and len(must) + len(fill) == s.groups:
            return must + fill
        return None

    def fill():
        free = [r for r in reps if r.active and len(r.running) < r.slots]
        while queue and free:
            r = min(free, key=lambda r: len(r.running) / r.slots)
            r.running.append(queue.popleft())
            if len(r.running) == r.slots:
                free.remove(r)

    def switch(on: bool):
        """Wake the hybrid replicas and rebalance every sample in flight over all replicas, or
        reclaim them: their samples go back to the queue's front, with their tokens."""
        for r in reps:
            if r.hybrid or on:
                queue.extendleft(reversed(r.running))
                r.running = []
            if r.hybrid:
                r.active = on

    def train(batch: list[_Group]) -> float:
        nonlocal staleness
        waits.append(now - wait_from)
        for a in batch:
            del groups[a.g]
        staleness = max(staleness, max(version - a.version for a in batch))
        return now + s.train_s_per_token * sum(a.tokens for a in batch) / s.trainer

    admit()
    while True:
        while True:  # the trainer's transitions at `now`
            if state == "wait" and (batch := ready()) is not None:
                if lending:  # reclaim the hybrid replicas first
                    lent.append(now - lent_from)
                    switch(False)
                    lending, state, until = False, "switch_out", now + s.switch_out_s
                else:
                    state, until = "train", train(batch)
            elif (
                state == "wait"
                and hybrid
                and not lent_step
                and (not standalone or not waits or waits[-1] > s.switch_in_s + s.switch_out_s)
            ):  # lend
                lends, lent_step = lends + 1, True
                state, until = "switch_in", now + s.switch_in_s
            elif state == "switch_in" and now >= until:
                switch(True)
                lending, lent_from, state, until = True, now, "wait", math.inf
            elif state == "switch_out" and now >= until:
                state, until = "train", train(ready())
            elif state == "train" and now >= until:
                for r in reps:
                    if not r.hybrid:
                        r.paused_until = now + s.sync_s
                state, until = "sync", now + s.sync_s
            elif state == "sync" and now >= until:
                version = held = version + 1
                ends.append(now)
                admit()
                state, until, wait_from, lent_step = ("done" if version == s.steps else "wait"), math.inf, now, False
            else:
                break
        if version == s.steps:
            break
        fill()
        nxt = until  # the next event: the trainer's stage ending, a pause ending, a sample finishing
        for r in reps:
            if r.active and r.paused_until > now:
                nxt = min(nxt, r.paused_until)
            elif r.active and r.running:
                nxt = min(nxt, now + min(x.length - x.done for x in r.running) * s.step_s(len(r.running)))
        if nxt == math.inf:
            raise RuntimeError(f"the simulation is stuck at {now:.1f} s (trainer: {state})")
        for r in reps:
            if r.active and r.paused_until <= now and r.running:
                tokens, still = (nxt - now) / s.step_s(len(r.running)), []
                for x in r.running:
                    decoded += min(tokens, x.length - x.done)
                    x.done += tokens
                    if x.length - x.done > EPS * x.length:
                        still.append(x)
                        continue
                    a = groups[x.g]
                    a.left -= 1
                    if a.left == 0:
                        a.finished = nxt
                r.running = still
        now = nxt
    first = 2  # steps 1 and 2 fill the pipeline
    span = ends[-1] - ends[first - 1]
    return Result(
        samples_per_s=(len(ends) - first) * s.groups * s.n / span,
        step_s=span / (len(ends) - first),
        wait_s=float(np.mean(waits[first:])),
        lent_s=float(np.sum(lent)) / len(ends),
        lends=lends,
        staleness=staleness,
        decoded=decoded,
        ends=ends,
    )


# ------------------------------------------------------------------ the study
SPLITS = (8, 12, 16, 24)  # the trainer's GPUs of the fixed splits (the rest roll out)
LENT = (16, 24, 32)  # the trainer's GPUs of the lending runs (32: hybrid replicas only, colocated)
VERL = [  # theirs, not ours: real models on H20/H100 GPUs, their own baselines
    (
        "verl #6556, fully_async + dynamic resource scheduling: 16 trainer + 16 rollout H20, Qwen3.5-35B-A3B, "
        "against fixed 8 + 24",
        "-15.3% wall clock (1.18x)",
    ),
    ("the same, against fixed 16 + 16", "-17.5% wall clock (1.21x)"),
    (
        "verl #7373, separate_async + lending: 16 trainer + 8 rollout H100, the same split without, 150 steps",
        "-12.6% wall clock, +10.1% tokens/s",
    ),
]


def scenario(base: Setting, sigma: float, k: int, switch_s: float) -> dict:
    """One row of the table: the fixed splits and the lending runs of one setting."""
    s = replace(base, sigma=sigma, k=k, switch_in_s=switch_s / 2, switch_out_s=switch_s / 2)
    fixed = {t: simulate(replace(s, trainer=t)) for t in SPLITS}
    lent = {t: simulate(replace(s, trainer=t, lend=True)) for t in LENT}
    best = max(fixed, key=lambda t: fixed[t].samples_per_s)
    return dict(sigma=sigma, k=k, switch=switch_s, fixed=fixed, lent=lent, best=best)


def render(rows: list[dict], base: Setting, share: float, took: float, cmd: str) -> list[str]:
    from benchmarks.common import provenance

    mean = mean_length(base)
    lines = [
        "# Lending the trainer's GPUs to the rollout, simulated",
        "",
        provenance(),
        "",
        f"`{cmd}` ({took:.0f} s). A discrete-event model of the fully asynchronous pipeline (`offstep.pipeline.sample_stream`'s "
        f"admission and `must_take`) on {base.devices} simulated GPUs, not a run of offstep's workers: offstep does not "
        f"lend trainer GPUs. Replicas of {base.per_replica} GPUs with {base.slots} slots ({base.hybrid_slots} for a "
        f"hybrid one, whose memory the trainer's state shares); a decode step takes {base.step0_s * 1000:g} ms + "
        f"{base.step1_s * 1000:g} ms per running sample. {base.groups} groups x {base.n} samples a step, prompts of "
        f"{base.prompt} tokens, lognormal lengths (median {base.median:g}, cap {base.cap}, mean {mean:.0f} at sigma "
        f"{base.sigma:g}). The trainer's GPU-seconds a step are {share:g}x the rollout's at full slots (the rollout is "
        f"the larger part, as in verl's DAPO runs), scaling linearly with its GPUs; a weight sync pauses the standalone "
        f"replicas {base.sync_s:g} s. Lending: while the trainer waits (and its last wait was longer than the switches' "
        f"round trip) its GPUs serve as hybrid replicas; the switch round trip (wake and load the weights, then free the "
        f"KV cache and reload the trainer) is the setting below, half each way. A reclaimed sample keeps its tokens and "
        f"its re-prefill is not charged, which favours lending. {base.steps} steps a run, samples/s over steps 3..N.",
        "",
        "Fixed splits: trainer + rollout GPUs of the best fixed split; `lent` rows: trainer GPUs lent while waiting "
        f"({LENT[-1]}: every GPU a hybrid replica, colocated). The ratios are against the best fixed split and against "
        "the fixed 16 + 16.",
        "",
        "| tail sigma | k | switch round trip s | best fixed split | its samples/s | fixed 16 + 16 | lent 16 + 16 | "
        "vs best | vs 16 + 16 | lent 24 + 8 | vs best | hybrid only (32) | vs best | trainer wait s, 16 + 16 fixed / lent |",
        "| --- " * 14 + "|",
    ]
    for r in rows:
        best = r["fixed"][r["best"]].samples_per_s
        f16, l16, l24, l32 = r["fixed"][16], r["lent"][16], r["lent"][24], r["lent"][32]
        lines.append(
            f"| {r['sigma']:g} | {r['k']} | {r['switch']:g} | {r['best']} + {base.devices - r['best']} | {best:.1f} | "
            f"{f16.samples_per_s:.1f} | {l16.samples_per_s:.1f} | {l16.samples_per_s / best:.2f}x | "
            f"{l16.samples_per_s / f16.samples_per_s:.2f}x | {l24.samples_per_s:.1f} | {l24.samples_per_s / best:.2f}x | "
            f"{l32.samples_per_s:.1f} | {l32.samples_per_s / best:.2f}x | {f16.wait_s:.0f} / {l16.wait_s:.0f} |"
        )
    lines += [
        "",
        "What verl reports, **theirs, not ours** (real models on GPUs, their own baselines):",
        "",
        "| run | gain |",
        "| --- | --- |",
        *(f"| {a} | {b} |" for a, b in VERL),
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share", type=float, default=0.3, help="trainer GPU-seconds / rollout GPU-seconds a step")
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--switches", type=float, nargs="+", default=[0.0, 4.0, 16.0], help="switch round trips, s")
    ap.add_argument("--no-readme", action="store_true", help="print the table only")
    args = ap.parse_args()
    t0 = time.time()
    base = with_share(Setting(), args.share)
    rows = [scenario(base, sigma, k, sw) for sigma in args.sigmas for k in args.ks for sw in args.switches]
    lines = render(rows, base, args.share, time.time() - t0, "python -m benchmarks.lend_devices_sim")
    if args.no_readme:
        print("\n".join(lines))
    else:
        from benchmarks.readme import publish

        publish("lend-devices", OUT, lines)


if __name__ == "__main__":
    main()
