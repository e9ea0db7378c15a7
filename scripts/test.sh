#!/usr/bin/env bash
# Set up (once) and run the test suite (CPU; GPU tests skip themselves). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m pytest -q "$@"
