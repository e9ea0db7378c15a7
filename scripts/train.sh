#!/usr/bin/env bash
# Set up (once) and train on the built-in default: SmolLM2-135M-Instruct, arithmetic, one-step
# off-policy GRPO on CPU. Extra arguments are config overrides, e.g. `preset=tiny`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec offstep train "$@"
