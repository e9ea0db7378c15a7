"""The sandbox's own behaviour (offstep/sandbox): results, limits, the queue, and the refusal
before start where bubblewrap cannot run. The attacks are in test_sandbox_security.py."""

import threading

import pytest

from offstep.launch.loader import load_config
from offstep.launch.preflight import environment_problems
from offstep.sandbox import Limits, Sandbox, problem

FAST = Limits(timeout_s=5, cpu_s=5, memory_mb=256, processes=16, file_mb=1, open_files=32, tmp_mb=8, output_bytes=4096)


def test_bubblewrap_works_here():
    """scripts/setup.sh installs bubblewrap: its absence fails here instead of skipping the battery."""
    assert problem() is None


def test_a_script_reads_stdin_and_reports_its_exit():
    r = Sandbox(FAST).run("import sys\nprint(sys.stdin.read().upper())\nsys.exit(3)", "hello")
    assert (r.stdout, r.exit_code, r.timed_out, r.limit) == ("HELLO\n", 3, False, None)
    assert r.seconds > 0 and r.queue_wait_s >= 0 and not r.ok and r.describe() == "exit status 3"


def test_it_runs_as_nobody_in_a_fresh_tmp_with_a_scrubbed_environment():
    code = "import os\nprint(os.getuid(), os.getcwd(), os.listdir('.'), sorted(os.environ))"
    out = Sandbox(FAST).run(code).stdout.split(" ", 2)
    assert out[1] == "/tmp" and "main.py" in out[2]
    assert "'PATH'" in out[2] and "OFFSTEP" not in out[2] and "PYTHONPATH" not in out[2]


def test_an_exception_is_an_exit_status_with_its_traceback():
    r = Sandbox(FAST).run("1/0")
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and r.limit is None


@pytest.mark.heavy
def test_the_limits_are_named_in_the_result():
    sb = Sandbox(FAST)
    assert sb.run("x = bytearray(512 << 20)").limit == "memory"
    assert sb.run("open('f', 'wb').write(b'x' * (2 << 20))").limit == "file_size"
    r = Sandbox(Limits(**{**FAST.__dict__, "timeout_s": 1.5})).run("import time\ntime.sleep(30)")
    assert r.timed_out and r.limit == "timeout" and r.exit_code is None and r.seconds < 5


@pytest.mark.heavy
def test_executions_beyond_the_concurrency_queue_and_the_wait_is_measured():
    sb = Sandbox(FAST, concurrency=1)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(sb.run("import time; time.sleep(0.5)"))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waits = sorted(r.queue_wait_s for r in results)
    assert waits[0] < 0.2 and waits[1] > 0.3
    assert len(sb.log.drain()) == 2 and sb.log.drain() == ()


def test_limits_out_of_range_are_refused():
    with pytest.raises(ValueError, match="memory_mb"):
        Sandbox(Limits(memory_mb=1))
    with pytest.raises(ValueError, match="concurrency"):
        Sandbox(FAST, concurrency=0)


def test_without_bubblewrap_the_sandbox_says_what_to_install():
    assert "apt-get install bubblewrap" in problem(bwrap="no-such-bwrap-here")
    assert "not a file under /usr" in problem(python="/usr/bin/no-such-python")


@pytest.mark.heavy
def test_preflight_refuses_the_python_tool_where_no_sandbox_starts():
    cfg = load_config(
        ["preset=tiny", "rollout.agent.tools=[python]", "sandbox.python=/usr/bin/no-such-python", "sandbox.memory_mb=0"]
    )
    found = environment_problems(cfg)
    assert any("python tool" in p and "not a file under /usr" in p and "unsandboxed" in p for p in found)
    assert any(p.startswith("sandbox.memory_mb=0") for p in found)
    fine = environment_problems(load_config(["preset=tiny", "rollout.agent.tools=[python]"]))
    assert not any("sandbox" in p for p in fine)
