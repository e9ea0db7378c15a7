"""benchmarks/README.md is written by code: every section sits between the markers of a section that
benchmarks/readme.py registers, each section's script writes it, and the stored results give the
committed page exactly (a hand edit fails here; `python -m benchmarks.readme` rewrites the page).
And the package's shape: scripts run as `python -m benchmarks.NAME`, no sys.path edits, the page
builder imports no script."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from benchmarks import common, readme

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def test_every_heading_is_inside_the_markers_of_its_registered_section():
    text = readme.README.read_text(encoding="utf-8")
    spans = {}
    for s in readme.SECTIONS:
        assert text.count(s.begin) == 1 and text.count(s.end) == 1, f"{s.name}: markers missing or repeated"
        start, end = text.index(s.begin), text.index(s.end)
        assert start < end
        spans[s.name] = (start, end, s.title)
    order = sorted(spans, key=lambda n: spans[n][0])
    assert order == [s.name for s in readme.SECTIONS], "sections out of the registry's order"
    for m in re.finditer(r"^## (.+)$", text, re.M):
        inside = [n for n, (a, b, _) in spans.items() if a < m.start() < b]
        assert inside, f"'## {m.group(1)}' is outside every registered section's markers"
        assert spans[inside[0]][2] == m.group(1), f"'## {m.group(1)}' sits in section {inside[0]}"


def test_every_section_is_written_by_its_script():
    for s in readme.SECTIONS:
        script = BENCH / s.script
        assert script.exists(), f"{s.name}: {s.script} does not exist"
        text = script.read_text(encoding="utf-8")  # readme.publish writes the results file, then refreshes
        assert f'refresh("{s.name}"' in text or f'publish("{s.name}"' in text, f"{s.script} never writes {s.name}"
        assert s.results and all(r.startswith("results") for r in s.results)
        number = re.search(r"(?<![\w.-])\d+(?:\.\d+)?(?![\w-])", s.about)  # a figure, not AVX-512 or bf16
        assert not number, f"{s.name}: the fixed description quotes a number ({number.group(0) if number else ''})"


def test_the_stored_results_give_the_committed_page():
    assert readme.README.read_text(encoding="utf-8") == readme.page(), (
        "benchmarks/README.md differs from what the stored results give: run `python -m benchmarks.readme` "
        "(sections are written by the benchmark scripts, not by hand)"
    )


def test_write_section_replaces_in_place_and_inserts_in_registry_order(tmp_path):
    page = tmp_path / "README.md"
    first, middle, last = readme.SECTIONS[0], readme.SECTIONS[1], readme.SECTIONS[2]
    page.write_text("intro\n")
    readme.write_section(last.name, f"{last.begin}\nC\n{last.end}", page)
    readme.write_section(first.name, f"{first.begin}\nA\n{first.end}", page)
    readme.write_section(middle.name, f"{middle.begin}\nB\n{middle.end}", page)
    readme.write_section(middle.name, f"{middle.begin}\nB2\n{middle.end}", page)
    text = page.read_text()
    assert text.startswith("intro\n")
    assert [line for line in text.splitlines() if line in {"A", "B", "B2", "C"}] == ["A", "B2", "C"]
    assert text.count(middle.begin) == 1


def test_a_results_file_records_command_cpu_and_date():
    text = "# t\n\nCommand: `python -m benchmarks.x --n 2`. CPU: AVX2. Date: 2026-12-05.\n\n| a |\n| --- |\n| 1 |\n"
    assert readme.recorded_command(text) == "`python -m benchmarks.x --n 2`"
    assert readme.recorded_cpu(text) == "AVX2" and readme.recorded_dates(text) == "2026-12-05"
    assert readme.recorded_cpu("Machine: x86_64 (AVX2, no AVX-512 BF16)") == "AVX2"
    assert readme.recorded_cpu("Machine: x86_64 (AVX-512 BF16)") == "AVX-512 BF16"
    assert readme.recorded_cpu("Machine: AMD EPYC") == common.NOT_RECORDED == readme.recorded_dates("no date")
    assert readme.blocks("# t\n\ncaption\n\n| a |\n| --- |\n| 1 |\n\n## sub\n\nsecond\n\n| b |\n|---|\n") == [
        ("caption", "| a |\n| --- |\n| 1 |"),
        ("**sub**\n\nsecond", "| b |\n|---|"),
    ]


@pytest.mark.parametrize(
    "labels, cpu, rows_file",
    [
        ("default,fully_async", "AVX2", "results_presets.jsonl"),
        ("long_tail,long_tail_fully_async", "AVX2", "results_presets.jsonl"),
        ("default,fully_async", "AVX-512 BF16", "results_presets.jsonl"),
        ("t19_const", "AVX2", "results_recipe.jsonl"),  # README's plot of the default run
    ],
)
def test_preset_runs_draws_the_committed_rows(tmp_path, labels, cpu, rows_file):
    """`preset_runs.py --plot` draws the labels the docs plot from the stored rows, and names a missing label."""
    import json
    import subprocess

    rows = [json.loads(line) for line in (common.RESULTS / rows_file).read_text().splitlines() if line.strip()]
    assert set(labels.split(",")) <= {r["label"] for r in rows if r.get("cpu") == cpu}
    out = tmp_path / "p.png"
    subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.preset_runs", "--rows", str(common.RESULTS / rows_file)),
            *("--plot", labels, "--plot-cpu", cpu, "--plot-out", str(out)),
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from benchmarks import preset_runs

    with pytest.raises(SystemExit, match="no rows labelled 'nope'"):
        preset_runs.plot_labels(rows, ["nope"], tmp_path / "q.png")


def test_every_results_file_and_plot_lives_in_results():
    """Scripts write into benchmarks/results/, and only the page and the code sit beside them."""
    stray = sorted(
        p.name for p in BENCH.iterdir() if p.is_file() and (p.name.startswith("results") or p.suffix == ".png")
    )
    assert not stray, f"results outside benchmarks/results/: {stray}"


def test_no_script_edits_sys_path_and_the_page_imports_no_script():
    """Run as `python -m benchmarks.NAME` from the checkout's root, the scripts import each other as
    `benchmarks.NAME`; the page builder (readme, readme_parts, readme_sections) imports only
    benchmarks.common and itself, so no script that refreshes its section is imported back by it (no import circle)."""
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*[+=]", text), f"{path.name} edits sys.path"
        here = {p.stem for p in BENCH.glob("*.py")}
        for node in ast.walk(ast.parse(text)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            )
            for name in names:
                assert name.split(".")[0] not in here, (
                    f"{path.name} imports {name} (a module of benchmarks/ by its bare name)"
                )
    page_modules = {"benchmarks.readme", "benchmarks.readme_parts", "benchmarks.readme_sections"}
    for module in sorted(page_modules):
        imported = {
            node.module
            for node in ast.walk(ast.parse((BENCH / f"{module.split('.')[1]}.py").read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmarks")
        }
        assert imported <= {"benchmarks.common"} | page_modules, (module, imported)
    common_imports = {
        node.module
        for node in ast.walk(ast.parse((BENCH / "common.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmarks")
    }
    assert not common_imports, common_imports


def test_the_recorded_command_is_the_module_form(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "lora.py"), "--parts", "runs", "--only", "r0 x"])
    assert common.command() == "python -m benchmarks.lora --parts runs --only 'r0 x'"
    monkeypatch.setattr(sys, "argv", ["/elsewhere/tool.py", "--n", "2"])
    assert common.command() == "python /elsewhere/tool.py --n 2"


def test_a_results_file_names_the_commands_that_rerun_every_stored_row():
    rows = [{"label": a, "seed": s} for a, s in [("b", 0), ("b", 1), ("a", 0), ("a", 1), ("c", 2)]]
    assert common.rows_command(BENCH / "staleness_runs.py", rows) == (
        "python -m benchmarks.staleness_runs --only b,a --seeds 0,1; "
        "python -m benchmarks.staleness_runs --only c --seeds 2"
    )
    assert common.provenance("python -m benchmarks.x --seeds 0").startswith(
        "Command: `python -m benchmarks.x --seeds 0`."
    )


def test_mean_and_range_of_the_seeds():
    assert common.mean_range([0.5, 0.6, 0.7]) == "60.0 (50.0–70.0)"
    assert common.mean_range([3, 7], scale=1, digits=0) == "5 (3–7)"
    assert common.mean_range([0.425]) == "42.5"
    assert common.mean_range([]) == "—"


def test_a_stored_row_replaces_its_label_and_seed_on_the_same_cpu_only(tmp_path):
    from benchmarks.preset_runs import read_rows, store_row

    path = tmp_path / "rows.jsonl"
    rows = store_row([], {"label": "b", "seed": 0, "cpu": "AVX2", "v": 1}, path)
    rows = store_row(rows, {"label": "a", "seed": 0, "cpu": "AVX2", "v": 2}, path)
    rows = store_row(rows, {"label": "b", "seed": 0, "cpu": "AVX-512 BF16", "v": 3}, path)
    rows = store_row(rows, {"label": "b", "seed": 0, "cpu": "AVX2", "v": 4}, path)
    assert read_rows(path) == rows
    assert [(r["label"], r["cpu"], r["v"]) for r in rows] == [
        ("a", "AVX2", 2),
        ("b", "AVX-512 BF16", 3),
        ("b", "AVX2", 4),
    ]


def test_the_recipe_tables_row_t19_const_is_the_default_preset():
    """The README's result and the recipe table's row ``t19_const`` describe the same runs: its
    overrides change nothing in the default preset (a preset edit that breaks this must add a row)."""
    from benchmarks.recipe_runs import CANDIDATES
    from offstep.config.schema import to_yaml
    from offstep.launch.loader import load_config

    default = to_yaml(load_config(["preset=default"]))
    assert to_yaml(load_config(["preset=default", *CANDIDATES["t19_const"][1]])) == default
    assert to_yaml(load_config(["preset=default", *CANDIDATES["t19_cosine"][1]])) != default
