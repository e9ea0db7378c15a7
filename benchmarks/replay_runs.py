"""How far a fully asynchronous run is reproduced by replaying its recorded schedule, on CPU.

For each configuration: one run records its schedule (``schedule.jsonl``), a second run of the same
config replays it (``pipeline.replay=<the first run>``), and a third runs the config again without
the replay. Each run is the tiny preset in ``pipeline.mode=fully_async`` (4 prompts x 4 samples a
step, up to 128 new tokens), long enough generation that weight loads land inside samples. Reported:
the partial samples of the recorded run (samples whose tokens span two policy versions), the steps
whose records (everything but wall-clock figures) equal the recorded run's, for the replay and for
the free rerun, whether the sampled texts are equal, and the wall time of each run.

    python -m benchmarks.replay_runs                       # every configuration below
    python -m benchmarks.replay_runs --only builtin-keep vllm-keep
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import publish
from benchmarks.run_records import deterministic

BASE = [
    "preset=tiny",
    "pipeline.mode=fully_async",
    "pipeline.max_staleness=1",
    "trainer.total_steps=5",
    "trainer.val_before_train=false",
    "trainer.progress=off",
    "rollout.n=4",
    "rollout.max_new_tokens=128",
]
CONFIGS = {
    "builtin-keep": [],
    "builtin-recompute": ["rollout.partial=recompute"],
    "builtin-off": ["rollout.partial=off"],
    "builtin-k2-checkpoints": ["pipeline.max_staleness=2", "trainer.save_freq=2"],
    "builtin-ref-on-rollout": ["pipeline.ref_on_rollout=true"],
    "vllm-keep": ["rollout.engine=vllm"],
    "vllm-recompute": ["rollout.engine=vllm", "rollout.partial=recompute"],
}


def records(run: Path) -> dict[int, dict]:
    """Per step, everything but wall-clock figures and the stream's when-finished counts."""
    return {m["step"]: deterministic(m) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def texts(run: Path) -> list:
    return [(s["step"], s["response"]) for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines())]


def timed_run(overrides: list[str]) -> float:
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train

    t0 = time.time()
    train(load_config(overrides))
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default=str(RESULTS / "results_replay.md"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    root = Path(tempfile.mkdtemp(prefix="offstep-replay-"))
    try:
        for name in args.only:
            cfg = BASE + CONFIGS[name]
            runs = {kind: root / name / kind for kind in ("recorded", "replayed", "free")}
            wall = {
                "recorded": timed_run(cfg + [f"trainer.output_dir={runs['recorded']}"]),
                "replayed": timed_run(
                    cfg + [f"trainer.output_dir={runs['replayed']}", f"pipeline.replay={runs['recorded']}"]
                ),
                "free": timed_run(cfg + [f"trainer.output_dir={runs['free']}"]),
            }
            rec = {kind: records(run) for kind, run in runs.items()}
            steps = sorted(rec["recorded"])
            partial = sum(int(m.get("rollout/partial_samples", 0)) for m in rec["recorded"].values())
            same = {kind: sum(rec[kind].get(s) == rec["recorded"][s] for s in steps) for kind in ("replayed", "free")}
            rows.append(
                f"| {name} | {' '.join(CONFIGS[name]) or '(the base)'} | {partial} | "
                f"**{same['replayed']}/{len(steps)}** | "
                f"{'yes' if texts(runs['replayed']) == texts(runs['recorded']) else 'no'} | "
                f"{same['free']}/{len(steps)} | {wall['recorded']:.0f} / {wall['replayed']:.0f} / {wall['free']:.0f} |"
            )
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        "# Replaying a fully asynchronous run",
        "",
        provenance(),
        "",
        f"Base: `{' '.join(BASE)}`; each configuration adds its overrides. Steps equal: the records of each step "
        "(losses, rewards, entropy, gradient norm, staleness, version spans, partial samples; not wall-clock figures) "
        "equal the recorded run's exactly. Nothing else ran on the machine.",
        "",
        "| configuration | overrides | partial samples (recorded) | steps equal, replayed | texts equal, replayed | "
        "steps equal, free rerun | wall s: recorded / replayed / free |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    publish("replay", args.out, lines)


if __name__ == "__main__":
    main()
