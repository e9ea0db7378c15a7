"""The pieces of ``benchmarks/README.md`` (``benchmarks.readme``): what a stored results file records
(its command, CPU kind and dates), its tables, the bodies computed from JSON results, and the
:class:`Section` record that ``benchmarks.readme_sections`` lists. Imports nothing from the package but
``benchmarks.common``."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.common import AVX2_FLOAT32, NOT_RECORDED, RESULTS


# ------------------------------------------------------------------ what a results file records
def recorded_command(text: str) -> str:
    """The command a results file names: its first ``Command:`` or ``Regenerate:`` line, else its
    indented command lines, else its first backquoted ``python -m benchmarks.NAME ...``."""
    if m := re.search(r"^(?:Command: `([^`]+)`|Regenerate: (.+?)\.?$)", text, re.M):
        return f"`{m.group(1)}`" if m.group(1) else m.group(2)
    if lines := re.findall(r"^ {4}(\S*python3? -m benchmarks\.\w+.*)$", text, re.M):
        return "; ".join(f"`{c}`" for c in lines)
    if m := re.search(r"`(\S*python3? -m benchmarks\.[^`]+)`", text):
        return f"`{m.group(1)}`"
    return NOT_RECORDED


def recorded_cpu(text: str) -> str:
    if m := re.search(r"^Command: .*? CPU: (.+?)\. Date:", text, re.M):
        return m.group(1)
    kinds = [
        kind
        for kind, pattern in (("AVX2", r"AVX2|no AVX-512"), ("AVX-512 BF16", r"(?<!no )AVX-512 BF16"))
        if re.search(pattern, text)
    ]
    return " and ".join(kinds) or NOT_RECORDED


def recorded_dates(text: str) -> str:
    return ", ".join(sorted(set(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)))) or NOT_RECORDED


# ------------------------------------------------------------------ the tables of a results file
def blocks(text: str) -> list[tuple[str, str]]:
    """Each Markdown table of ``text`` with its caption: the paragraph just before it, led by the
    heading above it (as bold text) where a heading comes between it and the previous table."""
    out, heading, para, table = [], "", [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            caption = "\n\n".join(x for x in (f"**{heading}**" if heading else "", " ".join(filter(None, para))) if x)
            out.append((caption, "\n".join(table)))
            heading, para, table = "", [], []
        if line.startswith("#"):  # the file's title (``# ``) is the section's own heading
            heading, para = ("" if line.startswith("# ") else line.lstrip("#").strip()), []
        elif not line.strip():
            para = [] if para and para[-1] == "" else para + [""]
        elif line.startswith("    "):
            para = []
        else:
            para = [] if para and para[-1] == "" else para
            para.append(line.strip())
    return out


def tables_of(*picks: tuple[str, tuple[int, ...] | None]) -> Callable[[], str]:
    """A section body: the tables (by index; None: all) of each named results file, with captions."""

    def build() -> str:
        parts = []
        for name, which in picks:
            found = blocks((RESULTS / name).read_text(encoding="utf-8"))
            for i in range(len(found)) if which is None else which:
                caption, table = found[i]
                parts += [caption, table] if caption else [table]
        return "\n\n".join(parts)

    return build


# ------------------------------------------------------------------ derived tables
def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """Mean, with the range in brackets where there is more than one value."""
    mean = fmt.format(statistics.mean(values))
    return mean if len(values) == 1 else f"{mean} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def default_runs() -> str:
    """The default preset (full fine-tuning at the preset's lr) per CPU kind, from lora.py's JSON:
    mean and range over seeds, then each seed's validation curve. CPU kinds are never pooled."""
    parts = []
    for name in ("results_lora.json", "results_lora_avx512.json"):
        runs = [r for r in json.loads((RESULTS / name).read_text())["runs"].values() if r["rank"] == 0]
        lr = min(r["lr"] for r in runs)
        by_cpu: dict[str, list[dict]] = {}
        for r in sorted((r for r in runs if r["lr"] == lr), key=lambda r: r["seed"]):
            by_cpu.setdefault(
                "AVX-512 BF16" if r.get("cpu", AVX2_FLOAT32).startswith("AVX-512") else "AVX2", []
            ).append(r)
        for cpu, rs in by_cpu.items():
            n, first, last = rs[0]["steps"], [r["rewards"][:5] for r in rs], [r["rewards"][-5:] for r in rs]
            steps = [s for s, _ in rs[0]["val"]]
            parts += [
                f"**{cpu}** ([{name}](results/{name})): seed{'s' * (len(rs) > 1)} {', '.join(str(r['seed']) for r in rs)}, "
                f"{n} steps, lr {lr:g}, started {', '.join(r['started'] for r in rs)} UTC. Mean over the seeds, range in "
                "brackets.",
                "\n".join(
                    [
                        f"| | before (step 0 / first 5 steps) | after (step {n} / last 5 steps) |",
                        "| --- | --- | --- |",
                        f"| validation accuracy | {spread([r['val'][0][1] for r in rs])} | **{spread([r['val'][-1][1] for r in rs])}** |",
                        f"| training reward | {spread([statistics.mean(x) for x in first])} | "
                        f"**{spread([statistics.mean(x) for x in last])}** |",
                        f"| median step s | | {spread([r['step_s'] for r in rs], '{:.1f}')} |",
                        f"| wall minutes | | {spread([r['wall_s'] / 60 for r in rs], '{:.1f}')} |",
                    ]
                ),
                "\n".join(
                    [
                        "| seed | " + " | ".join(f"val acc step {s}" for s in steps) + " | peak |",
                        "| --- " * (len(steps) + 2) + "|",
                        *(
                            f"| {r['seed']} | "
                            + " | ".join(f"{a:.3f}" for _, a in r["val"])
                            + f" | {max(a for _, a in r['val']):.3f} |"
                            for r in rs
                        ),
                        "| mean | "
                        + " | ".join(f"{statistics.mean(r['val'][i][1] for r in rs):.3f}" for i in range(len(steps)))
                        + f" | {statistics.mean(max(a for _, a in r['val']) for r in rs):.3f} |",
                    ]
                ),
            ]
    return "\n\n".join(parts)


def slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


# ------------------------------------------------------------------ the sections, in page order
@dataclass(frozen=True)
class Section:
    name: str  # its markers' name
    title: str  # its ``## `` heading (docs link to its anchor)
    script: str  # the script in benchmarks/ that measures it and calls refresh(name) or publish(name, ...)
    results: tuple[str, ...]  # its results files in benchmarks/results/, the first the one it names
    about: str  # what is measured and how to read it: fixed prose, no numbers
    build: Callable[[], str]  # the body from the stored results
    target: str = ""  # what the benchmark was built to show, where it has a target
    missing: str = ""  # what the section says while no results file is stored (default: not measured yet)

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}: begin (written by benchmarks/{self.script}) -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}: end -->"
