#!/usr/bin/env bash
# Set up (once) and run the test suite on the CPU (GPU tests skip themselves). Three tiers:
#   bash scripts/test.sh           every test but those marked `slow` (more than ~30 s each: SmolLM2
#                                  runs, kill-and-resume, several-node clusters, vLLM pipelines): CI's run
#   bash scripts/test.sh --quick   also without the tests marked `ray` (they start Ray), `model` (they
#                                  need SmolLM2, built once from its GGUF file), `heavy` (over ~1 s
#                                  without Ray), `vllm` and `gpu`: under 2 minutes on 2 cores; a test
#                                  there that starts Ray or needs SmolLM2 fails (OFFSTEP_QUICK=1, set
#                                  here, arms tests/conftest.py's guard)
#   bash scripts/test.sh --all     every test, `slow` ones included
# Other arguments go to pytest (a `-m` of yours replaces the tier's).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# The set-up installed vLLM, so its tests must run: a broken vLLM install fails them instead of
# skipping them.
if [ -n "$VLLM_SPEC" ]; then export OFFSTEP_REQUIRE_VLLM=1; fi
select=(-m "not slow")
export OFFSTEP_QUICK=0
case "${1:-}" in
  --all) select=(); shift ;;
  --quick) select=(-m "not slow and not ray and not model and not heavy and not vllm and not gpu"); OFFSTEP_QUICK=1; shift ;;
esac
exec python -m pytest -q "${select[@]}" "$@"
