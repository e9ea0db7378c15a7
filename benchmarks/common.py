"""What a benchmark run records, and where: shared by every script of ``benchmarks`` and by the page
builder ``benchmarks.readme``. It imports nothing from ``benchmarks`` (no script, no page code), so
any module of the package can import it without a circle.

A script writes its results into ``RESULTS`` (``benchmarks/results/``) and heads them with the
line of ``provenance()``: the command that regenerates them (``python -m benchmarks.NAME ...``, run
from the checkout's root), the CPU kind and the date.
"""

from __future__ import annotations

import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # the package: the scripts and the page README.md
ROOT = HERE.parent  # the checkout's root, where ``python -m benchmarks.NAME`` runs
RESULTS = HERE / "results"  # every results file (results_*.md/.json/.jsonl) and plot (*.png)
NOT_RECORDED = "not recorded"

# What runs recorded before they recorded their CPU (lora.py's JSON): all ran on AVX2-only cores.
AVX2_FLOAT32 = "AVX2, no AVX-512 BF16: the trainer computes in float32"


def cpu_kind() -> str:
    """The CPU as far as the numbers depend on it: with native bf16 the trainer computes in bf16
    (``model.compute_dtype=auto``), a different computation from the float32 of an AVX2 CPU."""
    from offstep.launch.loader import cpu_has_native_bf16

    return "AVX-512 BF16" if cpu_has_native_bf16() else "AVX2"


def cpu_kind_and_dtype() -> str:
    """``cpu_kind()`` with the dtype the trainer computes in on it (see docs/running.md,
    "Reproducibility")."""
    return "AVX-512 BF16: the trainer computes in bf16" if cpu_kind() == "AVX-512 BF16" else AVX2_FLOAT32


def cpu_model() -> str:
    """The CPU's model name (``lscpu``), else what ``platform`` knows."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def script_args(script: str | Path) -> list[str]:
    """How ``python`` runs a script of this package from the checkout's root: ``-m benchmarks.NAME``
    for ``benchmarks/NAME.py``; any other script by its path."""
    path = Path(script).resolve()
    return ["-m", f"{HERE.name}.{path.stem}"] if path.parent == HERE and path.suffix == ".py" else [str(script)]


def command() -> str:
    """This process's command line, as run from the checkout's root (``python -m benchmarks.NAME ...``
    for a script of this package)."""
    return shlex.join(["python", *script_args(sys.argv[0]), *sys.argv[1:]])


def provenance(regenerate: str = "") -> str:
    """The line a results file carries: the command (this process's, unless ``regenerate`` names
    the one that reruns every row of the file), the CPU kind and the date of this run."""
    return f"Command: `{regenerate or command()}`. CPU: {cpu_kind()}. Date: {time.strftime('%Y-%m-%d')}."


def rows_command(script: str | Path, rows: list[dict]) -> str:
    """The commands of ``script`` (``--only LABELS --seeds SEEDS``) that run every (label, seed) of
    ``rows`` again: one per set of seeds, labels in their order of first appearance."""
    by_seeds: dict[str, list[str]] = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        seeds = ",".join(str(s) for s in sorted({r["seed"] for r in rows if r["label"] == label}))
        by_seeds.setdefault(seeds, []).append(label)
    run = ["python", *script_args(script)]
    return "; ".join(shlex.join([*run, "--only", ",".join(ls), "--seeds", s]) for s, ls in by_seeds.items())


def mean_range(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``mean (min–max)`` of ``values`` times ``scale``, or the one value; "—" for none."""
    if not values:
        return "—"
    f = lambda v: f"{scale * v:.{digits}f}"  # noqa: E731
    return f"{f(statistics.mean(values))} ({f(min(values))}–{f(max(values))})" if len(values) > 1 else f(values[0])


def results_arg(path: str | Path) -> str:
    """``path`` as a command run from the checkout's root names it (``benchmarks/results/NAME``
    for a file of ``RESULTS``)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)
