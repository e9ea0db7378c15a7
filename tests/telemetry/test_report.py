"""`offstep report`: plots and summary.md from a short tiny run, compared with a second run."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest

from offstep.cli import main
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Reward, Rollout, Val
from offstep.telemetry.report import write_report


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_session):
    dirs = []
    for k in (0, 1):
        out = tmp_path_factory.mktemp(f"k{k}")
        train(
            load_config(
                [
                    "preset=tiny",
                    f"pipeline.max_staleness={k}",
                    "trainer.total_steps=3",
                    f"trainer.output_dir={out}",
                    "trainer.progress=off",
                ]
            )
        )
        dirs.append(out)
    return dirs


@pytest.mark.ray
def test_report_files_and_numbers(two_runs, tmp_path):
    out = write_report(two_runs, tmp_path / "rep")
    for name in ("reward.png", "timing.png", "timeline.png", "offpolicy.png", "health.png"):
        f = out / name
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(f)
        assert img.shape[0] > 100 and img.shape[1] > 100
    text = (out / "summary.md").read_text()
    rows = [
        line.split("|")[1:-1]
        for line in text.splitlines()
        if line.startswith("| ") and "run |" not in line and "---" not in line
    ]
    assert len(rows) == 2
    for row, run_dir in zip(rows, two_runs):
        cells = [c.strip() for c in row]
        steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 1]
        rewards = [m[Reward.MEAN] for m in steps]
        val = [m for m in read_jsonl(run_dir / "metrics.jsonl") if Val.ACC in m]
        assert cells[0] == run_dir.name and int(cells[1]) == 3
        assert float(cells[2]) == pytest.approx(sum(rewards) / 3, abs=1e-3)
        assert float(cells[4]) == pytest.approx(val[0][Val.ACC], abs=1e-3)
        assert float(cells[5]) == pytest.approx(val[-1][Val.ACC], abs=1e-3)
        assert int(cells[8]) == max(m[Rollout.STALENESS_MAX] for m in steps)


@pytest.mark.ray
def test_report_cli(two_runs, capsys):
    assert main(["report", str(two_runs[1])]) == 0
    assert (two_runs[1] / "report" / "summary.md").exists()


def test_report_of_missing_run_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
