"""benchmarks/gpu_check.py, the check a lent GPU runs, kept from rotting: its CPU form at tiny shapes
runs here word for word, as on the GPU machine without Ray, Hydra, OmegaConf or vLLM (they are
made unimportable), and prints its table with the engine, update and LoRA rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m benchmarks.gpu_check --device cpu --tiny"
ABSENT = ("ray", "hydra", "omegaconf", "vllm")  # not on the lent GPU machine


@pytest.mark.heavy
def test_the_cpu_form_runs_without_ray_and_prints_every_check(tmp_path):
    blocked = tmp_path / "absent"
    for name in ABSENT:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not installed on the GPU machine')\n"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked), str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    results = ROOT / "benchmarks" / "results" / "results_gpu.md"
    before = results.read_text(encoding="utf-8") if results.exists() else None
    argv = COMMAND.split()
    p = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "Ray not installed (stand-in module)" in out
    assert f"Command: `{COMMAND}`." in out and re.search(r"Date: 20\d\d-\d\d-\d\d\.", out)
    assert re.search(r"torch \S+, transformers \S+, peft \S+", out)
    rows = {
        m.group(1): m.group(0) for m in re.finditer(r"^\| tiny \| [\d.]+ M \| (engine|update|lora) \|.*$", out, re.M)
    }
    assert set(rows) == {"engine", "update", "lora"}, out
    for check, row in rows.items():
        tokens, seconds, per_s = row.split(" | ")[3:6]
        assert int(tokens) > 0 and float(seconds) > 0 and float(per_s) > 0, row
    diff_max, diff_mean = (float(x) for x in rows["engine"].split(" | ")[7].split(" / "))
    assert 0 <= diff_mean <= diff_max < 0.5, rows["engine"]  # the engine and the trainer score the same tokens alike
    assert "Skipped" not in out
    # The CPU form writes no results file and leaves benchmarks/README.md alone.
    assert (results.read_text(encoding="utf-8") if results.exists() else None) == before
    assert "wrote" not in out
