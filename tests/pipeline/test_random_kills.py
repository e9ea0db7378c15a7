"""The random-kill harness (``benchmarks/random_kills.py``): its record comparison, the pause hook
inside a checkpoint write, and a reduced run of it (3 kills at k = 1: one before the first
checkpoint, one inside a checkpoint write, one at a random moment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import random_kills as rk

ROOT = Path(__file__).resolve().parents[2]


def _write(run: Path, metrics: list[dict], events: list[dict], rows: list[dict], torn: str = "") -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + torn)
    (run / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(s: int, **extra) -> dict:
    return {
        "step": s,
        "reward/mean": s / 10,
        "timing_s/step": 1.0 + s,
        "perf/tokens_per_s": 9.0,
        "agent/tool_time_s": 0.1,
        **extra,
    }


def _events(s: int, t: float = 0.0) -> list[dict]:
    return [
        {"role": "rollout/0", "stage": "gen", "step": s, "start": t, "end": t + 1, "version": s - 1},
        {"role": "trainer", "stage": "checkpoint", "step": s, "start": t, "end": t + 2},
    ]


@pytest.fixture
def reference(tmp_path):
    _write(
        tmp_path / "ref",
        [_step(s) for s in (1, 2, 3)],
        [e for s in (1, 2, 3) for e in _events(s)],
        [{"step": s, "response": f"r{s}", "reward": 0.5} for s in (1, 2, 3)],
    )
    return rk.Records.read(tmp_path / "ref")


def test_records_equal_but_for_wall_clock_pass(tmp_path, reference):
    # Other times, the same everything else: equal.
    _write(
        tmp_path / "run",
        [{**_step(s), "timing_s/step": 99.0, "agent/tool_time_s": 7.0} for s in (1, 2, 3)],
        [e for s in (1, 2, 3) for e in _events(s, t=50.0)],
        [{"step": s, "response": f"r{s}", "reward": 0.5} for s in (1, 2, 3)],
    )
    assert rk.check_records(rk.Records.read(tmp_path / "run"), reference, final=True) == []


def test_records_catch_a_repeat_a_gap_a_difference_and_a_torn_line(tmp_path, reference):
    rows = [{"step": s, "response": f"r{s}", "reward": 0.5} for s in (1, 2, 3)]
    cases = {
        "repeated": ([_step(1), _step(2), _step(2), _step(3)], [e for s in (1, 2, 3) for e in _events(s)], rows, ""),
        "missing": ([_step(1), _step(3)], [e for s in (1, 2, 3) for e in _events(s)], rows, ""),
        "differs": (
            [_step(1), _step(2, **{"reward/mean": 0.25}), _step(3)],
            [e for s in (1, 2, 3) for e in _events(s)],
            rows,
            "",
        ),
        "event twice": ([_step(s) for s in (1, 2, 3)], [e for s in (1, 2, 2, 3) for e in _events(s)], rows, ""),
        "event lost": ([_step(s) for s in (1, 2, 3)], [e for s in (1, 2, 3) for e in _events(s)][1:], rows, ""),
        "row twice": ([_step(s) for s in (1, 2, 3)], [e for s in (1, 2, 3) for e in _events(s)], rows + rows[:1], ""),
        "torn": ([_step(s) for s in (1, 2, 3)], [e for s in (1, 2, 3) for e in _events(s)], rows, '{"step": 4, "rew'),
    }
    for name, (metrics, events, sample_rows, torn) in cases.items():
        _write(tmp_path / name, metrics, events, sample_rows, torn)
        assert rk.check_records(rk.Records.read(tmp_path / name), reference, final=True), name


def test_records_of_a_killed_run_may_stop_short_but_not_repeat(tmp_path, reference):
    # Killed after step 2's record: step 2's checkpoint event and step 3 not there yet, a torn line.
    events = _events(1) + _events(2)[:1] + _events(3)[:1]
    rows = [{"step": s, "response": f"r{s}", "reward": 0.5} for s in (1, 2, 3)]
    _write(tmp_path / "cut", [_step(1), _step(2)], events, rows, torn='{"step": 3, "re')
    cut = rk.Records.read(tmp_path / "cut")
    assert cut.torn == ["metrics.jsonl"]
    assert rk.check_records(cut, reference, final=False) == []
    assert rk.check_records(cut, reference, final=True)  # as a final record it is incomplete
    # Step 1's checkpoint event lost (step 2's record came after it): caught even mid-run.
    _write(tmp_path / "lost", [_step(1), _step(2)], _events(1)[:1] + _events(2), rows)
    assert any(
        "step 1 lacks" in p for p in rk.check_records(rk.Records.read(tmp_path / "lost"), reference, final=False)
    )


def test_the_launcher_holds_the_named_phase_only(tmp_path):
    import kill_points

    from offstep.pipeline.checkpoints import Checkpoints

    marker = tmp_path / "paused"
    Checkpoints(tmp_path).phase("state", 2)  # a run without the seam: returns at once
    with pytest.raises(ValueError, match="must be one of"):
        kill_points.parse(f"nowhere:2:{marker}")
    code = (
        f"import kill_points; from offstep.pipeline.checkpoints import Checkpoints; "
        f"c = Checkpoints({str(tmp_path)!r}, on_phase=kill_points.arm('state:2:' + {str(marker)!r})); "
        "c.phase('state', 1); c.phase('shards', 2); print('passed'); c.phase('state', 2)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        t0 = time.time()
        while not marker.exists() and time.time() - t0 < 60:
            time.sleep(0.05)
        assert marker.read_text() == "state:2\n"
        time.sleep(0.3)
        assert proc.poll() is None, "the process should be held at the point"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.stdout.read() == "passed\n"  # the other points (and steps) went by


@pytest.mark.ray
@pytest.mark.slow
def test_two_kills_at_k1_resume_exactly(tmp_path):
    """A reduced harness run: 4 steps, a checkpoint every 2; killed once held at the start of the
    first checkpoint (steps recorded, nothing of a checkpoint written: the restart starts afresh;
    a kill timed off the first record landed inside that write once the steps got fast), once paused inside a
    checkpoint write just after its rename (where a kill lost the step's timeline entry, before it
    was written ahead of the rename); each resume exact, no process left. Kills at a random moment:
    ``benchmarks.random_kills`` and the mid-step kills of ``tests/pipeline/test_checkpoint.py``."""
    r = rk.run_setup(
        rk.SETUPS["builtin-k1"],
        2,
        seed=0,
        steps=4,
        save_freq=2,
        work=tmp_path,
        timeout=300,
        plan=["early", "pause:published"],
    )
    assert r["failure"] is None, r["kill_list"]
    assert r["exact"] == r["kills"] == 2, r["kill_list"]
    landed = Counter(k["landed"] for k in r["kill_list"])
    assert landed["before first checkpoint"] >= 1 and landed["during checkpoint write"] >= 1, landed
    assert r["kill_list"][0]["resumed"] == "afresh" and r["kill_list"][1]["resumed"].startswith("from step")


def test_no_kill_is_drawn_once_the_last_checkpoint_is_written(tmp_path):
    """After the last step's checkpoint a restart only exits: no kill is drawn for it (the round
    ends), and a kill while running is drawn over the training the start has left."""
    import random

    prof = rk.Profile(startup_s=30.0, train_s=8.0, checkpoint_s=0.2, wall_s=38.0)
    run, marker = tmp_path / "run", tmp_path / "paused"
    rng = random.Random(0)
    assert rk.draw(rng, prof, run, 8, 2, marker, "running")[0] == "running"  # nothing saved yet
    for step in (2, 4, 6):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    drawn = [rk.draw(rng, prof, run, 8, 2, marker, "running")[1] for _ in range(200)]
    assert max(drawn) <= 2.0 and max(drawn) > 1.5  # a quarter of the training is left
    kind, _, hook, _ = rk.draw(rng, prof, run, 8, 2, marker, "pause")
    assert kind == "pause" and hook.split(":")[1] == "8"  # the one write left
    (run / "checkpoints" / "step_8").mkdir()
    (run / "checkpoints" / "step_8" / "trainer_state.json").write_text("{}")
    assert all(rk.draw(rng, prof, run, 8, 2, marker, kind) is None for kind in ("running", "startup", "pause", "early"))
