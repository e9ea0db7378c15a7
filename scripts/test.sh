#!/usr/bin/env bash
# Set up (once) and run the test suite on the CPU (GPU tests skip themselves): every test but those
# marked `slow` (more than ~30 s each: SmolLM2 runs, kill-and-resume, several-node clusters, vLLM
# pipelines), which `--all` adds. Other arguments go to pytest (a `-m` of yours replaces the default).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# The set-up installed vLLM, so its tests must run: a broken vLLM install fails them instead of
# skipping them.
if [ -n "$VLLM_SPEC" ]; then export OFFSTEP_REQUIRE_VLLM=1; fi
select=(-m "not slow")
if [ "${1:-}" = "--all" ]; then select=(); shift; fi
exec python -m pytest -q "${select[@]}" "$@"
