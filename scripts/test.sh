#!/usr/bin/env bash
# Set up (once) and run the test suite (CPU; GPU tests skip themselves). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# The set-up installed vLLM, so its tests must run: a broken vLLM install fails them instead of
# skipping them.
if [ -n "$VLLM_SPEC" ]; then export OFFSTEP_REQUIRE_VLLM=1; fi
exec python -m pytest -q "$@"
