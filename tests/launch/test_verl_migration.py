"""docs/from-verl.md's offstep script, run as the page says (bash, the shell's word splitting and
variables), on the built-in tiny model and synthetic GSM8K-format parquet: two steps of one-step
off-policy GRPO through `offstep train`, in this process (the session's Ray)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from offstep.cli import main
from offstep.telemetry.metrics import read_jsonl

pytestmark = pytest.mark.ray  # every test here starts Ray

DOCS = Path(__file__).resolve().parents[2] / "docs" / "from-verl.md"


def page_script() -> str:
    scripts = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S)
    return scripts[1]  # the verl script with `offstep train` as its entry point


def argv_of(script: str, env: dict[str, str], extra: list[str]) -> list[str]:
    """The arguments bash passes to `offstep` when it runs ``script`` with ``env`` and ``extra`` as
    its own arguments (``$@``): `offstep` is a shell function printing them NUL-separated."""
    wrapped = "offstep() { printf '%s\\0' \"$@\"; }\n" + script.replace("set -x\n", "")
    out = subprocess.run(
        ["bash", "-c", wrapped, "from-verl.sh", *extra], env={**os.environ, **env}, capture_output=True, check=True
    ).stdout
    return out.decode().split("\0")[:-1]


def test_page_command_runs_on_the_tiny_model(tmp_path, ray_session):
    from offstep.data.tasks import write_task

    train, val = write_task("gsm8k_synthetic", str(tmp_path / "gsm8k"), 8, 4, 0)
    run_dir = tmp_path / "run"
    env = {
        "MODEL_PATH": "tiny",
        "TRAIN_FILE": train,
        "TEST_FILE": val,
        "CKPTS_DIR": str(run_dir),
        "NGPUS_PER_NODE": "2",
        "N_GPUS_ROLLOUT": "1",
        "TRAIN_PROMPT_BSZ": "4",
        "MINI_BSZ": "4",
        "MICRO_BSZ": "8",
        "N_RESP": "2",
        "MAX_PROMPT_LEN": "256",
        "MAX_RESP_LEN": "12",
        "EPOCHS": "1",
    }
    argv = argv_of(page_script(), env, ["preset=tiny", "trainer.progress=off"])
    assert argv[0] == "train" and len([a for a in argv if "=" in a]) >= 45
    assert main(argv) == 0
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]  # total_epochs=1 x floor(8 prompts / 4)
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1]  # one-step off-policy
    assert all("actor/pg_loss" in m and "actor/kl" in m and "reward/mean" in m for m in metrics)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # trainer.logger=['console','tensorboard']
