"""tests/scheduling.py: the order the two pytest processes take the files in, and the timeline that
measures it."""

import json
from types import SimpleNamespace

import pytest

from tests import scheduling


class Item:
    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_files_go_longest_first_whole_and_in_their_own_order(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"t/measured.py": 50.0}))
    monkeypatch.setattr(scheduling, "DURATIONS", durations)
    items = [
        Item("t/many.py::a"),  # 100 unit tests: 10 s by the guess
        *[Item(f"t/many.py::u{i}") for i in range(99)],
        Item("t/kills.py::one", "slow", "ray"),  # one slow test: 60 s
        Item("t/ray.py::b", "ray"),  # 20 + 3 s
        Item("t/ray.py::a", "heavy"),
        Item("t/measured.py::z", "slow"),  # measured 50 s, whatever its markers say
        Item("t/measured.py::y"),
    ]
    scheduling.longest_files_first(items)
    files = [i.nodeid.split("::")[0] for i in items]
    assert list(dict.fromkeys(files)) == ["t/kills.py", "t/measured.py", "t/ray.py", "t/many.py"]
    assert [i.nodeid for i in items][1:5] == ["t/measured.py::z", "t/measured.py::y", "t/ray.py::b", "t/ray.py::a"]
    assert [i.nodeid for i in items][5:7] == ["t/many.py::a", "t/many.py::u0"]


def test_the_timeline_gives_seconds_per_file_and_each_process_span(tmp_path, capsys):
    timeline = tmp_path / "timeline.jsonl"
    report = lambda nodeid, when, start, seconds: SimpleNamespace(  # noqa: E731
        nodeid=nodeid, when=when, start=start, duration=seconds
    )
    for worker, reports in {
        "gw0": [report("t/a.py::x", "setup", 1000.0, 0.5), report("t/a.py::x", "call", 1000.5, 99.5)],
        "gw1": [report("t/b.py::y", "call", 1000.0, 30.0), report("t/c.py::z", "call", 1030.0, 10.0)],
    }.items():
        with pytest.MonkeyPatch.context() as m:
            m.setenv("PYTEST_XDIST_WORKER", worker)
            for r in reports:
                scheduling.record(r, str(timeline))
    assert scheduling.summarize(timeline) == {"t/a.py": 100.0, "t/b.py": 30.0, "t/c.py": 10.0}
    out = capsys.readouterr().out
    assert "gw0: 100 s" in out and "gw1: 40 s" in out and "the last process ran on alone for 60 s" in out
