"""The page ``benchmarks/README.md``, owned by code: each section is written by the script that
measures it, from its stored results file in ``benchmarks/results/``, between markers; nothing on the
page is typed by hand.

    python -m benchmarks.readme            # rebuild the whole page from the stored results
    python -m benchmarks.readme --check    # exit 1 if the page differs from what the results give

A benchmark script ends a real run with ``refresh(NAME)`` or ``publish(NAME, ...)`` (its results file
is written first), which rebuilds that one section. A section shows the fixed description of
``SECTIONS``, the command, the CPU kind and the date as its results file records them ("not
recorded" where it does not), a link to the file, and the file's tables (or tables computed from its
JSON). New results files carry the line of ``benchmarks.common.provenance()`` so that all three are
recorded.

This module and the two it takes the sections from (``benchmarks.readme_sections``, the registry;
``benchmarks.readme_parts``, the pieces) build the page only: they read stored results files and import
nothing from the package but ``benchmarks.common`` and each other, never a script (the scripts import
this one, for ``refresh``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import HERE, RESULTS
from benchmarks.readme_parts import (  # noqa: F401 (the page's pieces, for its users)
    Section,
    blocks,
    recorded_command,
    recorded_cpu,
    recorded_dates,
    slug,
    tables_of,
)
from benchmarks.readme_sections import SECTIONS

README = HERE / "README.md"

BY_NAME = {s.name: s for s in SECTIONS}

INTRO = """# Benchmarks and measured results

Every section below is written by the script that measured it (`refresh` in
[readme.py](readme.py)), from the results file it stored in [results/](results): its command, CPU
and date as that file records them, a link to the file, and its tables. Each script runs from the
checkout's root as `python -m benchmarks.NAME` (`--help` says what it measures);
`python -m benchmarks.readme` rebuilds the page from the stored results; nothing here is typed by
hand.

The machines: 2-core x86_64 CPUs, no GPU (none was lent while offstep was built). "AVX2" is the
development machine (AMD EPYC, AVX2 only: `model.compute_dtype=auto` trains in float32); "AVX-512
BF16" is a machine with native bf16 (the trainer computes in bf16: a different computation, so its
runs are never pooled with AVX2 ones; see [reproducibility](../docs/running.md#reproducibility)).
Other work often shared the cores, so ratios measured side by side are more reliable than
absolute times.
"""


# ------------------------------------------------------------------ the page
def record(name: str) -> str:
    """What results file ``name`` records of its run (a JSON file: its Markdown twin, if any)."""
    twin = RESULTS / Path(name).with_suffix(".md").name
    text = (
        twin.read_text(encoding="utf-8")
        if name.endswith(".json") and twin.exists()
        else (RESULTS / name).read_text(encoding="utf-8")
    )
    return (
        f"- [{name}](results/{name}): command {recorded_command(text)}; CPU: {recorded_cpu(text)}; date: "
        f"{recorded_dates(text)}."
    )


def section(s: Section) -> str:
    """Section ``s`` from its stored results, markers included."""
    lines = [s.begin, f"## {s.title}", "", s.about + (f" Target: {s.target}." if s.target else "")]
    stored = [r for r in s.results if (RESULTS / r).exists()]
    if not stored:
        lines += [
            "",
            s.missing
            or f"Not measured yet: `python -m benchmarks.{Path(s.script).stem}` writes "
            f"`results/{s.results[0]}` and this section.",
        ]
    else:
        lines += [""] + [record(r) for r in stored] + ["", s.build()]
    return "\n".join([*lines, "", s.end])


def index() -> str:
    rows = [
        f"| [{s.title}](#{slug(s.title)}) | `{s.script}` | {', '.join(f'`{r}`' for r in s.results)} |" for s in SECTIONS
    ]
    return "\n".join(["| section | written by | from |", "| --- | --- | --- |", *rows])


def page() -> str:
    """The whole page from the stored results."""
    return "\n\n".join([INTRO.rstrip("\n"), index(), *(section(s) for s in SECTIONS)]) + "\n"


def write_section(name: str, body: str, path: Path = README) -> None:
    """Put ``body`` (markers included) in place of section ``name``; a section not on the page yet goes
    after the nearest earlier registered section that is, or first."""
    s = BY_NAME[name]
    text = path.read_text(encoding="utf-8") if path.exists() else INTRO
    if s.begin in text and s.end in text:
        head, rest = text.split(s.begin, 1)
        text = head + body + rest.split(s.end, 1)[1]
    else:
        earlier = [e for e in SECTIONS[: SECTIONS.index(s)] if e.end in text]
        if earlier:
            head, tail = text.split(earlier[-1].end, 1)
            text = head + earlier[-1].end + "\n\n" + body + tail
        else:
            first = next((e.begin for e in SECTIONS if e.begin in text), None)
            text = text.replace(first, body + "\n\n" + first, 1) if first else text.rstrip("\n") + "\n\n" + body + "\n"
    path.write_text(text, encoding="utf-8")


def publish(name: str, out: str | Path, lines: list[str]) -> None:
    """A script's last step: write its results file ``out`` from ``lines``, print it, and rebuild
    section ``name`` of the page from it."""
    text = "\n".join(lines) + "\n"
    Path(out).write_text(text)
    print(text)
    refresh(name, out)


def refresh(name: str, written: str | Path | None = None) -> None:
    """Rebuild section ``name`` of the page from its stored results: a script's last step, after it
    wrote ``written`` (skipped when that is not one of the section's results files, e.g. ``--out``)."""
    s = BY_NAME[name]
    if written is not None and Path(written).resolve() not in {(RESULTS / r).resolve() for r in s.results}:
        print(f"{written} is not a results file of {README.name}; its section {s.title!r} is left as it is")
        return
    write_section(name, section(s))
    print(f"wrote the section {s.title!r} of {README}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from the stored results")
    args = ap.parse_args()
    text = page()
    if args.check:
        same = README.exists() and README.read_text(encoding="utf-8") == text
        print("benchmarks/README.md is " + ("up to date" if same else "not what the stored results give"))
        return 0 if same else 1
    README.write_text(text, encoding="utf-8")
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
