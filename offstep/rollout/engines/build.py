"""One way to build an engine, for every role that generates: a rollout replica
(``rollout.engine``), a generative judge (``reward.model.engine``) and a distillation teacher on
vLLM (``distill.teacher.engine``). An ``EngineSpec`` says which engine, on which weights, in which
dtype and how many sequences at once; ``build_engine`` makes it on this process's device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offstep.config.schema import LoRAConfig
from offstep.models.forward import DTYPES
from offstep.models.loading import load_causal_lm
from offstep.models.lora import add_adapters
from offstep.rollout.engines.interface import RolloutEngine

BUILTIN, VLLM = "builtin", "vllm"


@dataclass(frozen=True)
class EngineSpec:
    """``kind``: ``builtin`` (offstep's engine on the model's PyTorch weights) or ``vllm`` (vLLM in
    this process). ``lora``: the actor's adapter layout, filled by every sync. ``sleep_mode``:
    vLLM's sleep (``rollout.sleep_during_update``). ``scratch``: a folder of the run's for the files
    the engine writes (vLLM's LoRA adapters)."""

    kind: str
    path: str
    dtype: str
    max_batch_size: int
    num_threads: int = 1
    seed: int = 0
    lora: LoRAConfig | None = None
    sleep_mode: bool = False
    scratch: str | None = None


def build_engine(spec: EngineSpec, tok, eos: list[int], device: torch.device) -> RolloutEngine:
    """The engine ``spec`` names, with its weights loaded, on ``device``."""
    if spec.kind == VLLM:
        from offstep.rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            spec.path,
            tok,
            eos,
            dtype=spec.dtype,
            max_batch_size=spec.max_batch_size,
            num_threads=spec.num_threads,
            seed=spec.seed,
            lora=spec.lora,
            sleep_mode=spec.sleep_mode,
            scratch=spec.scratch,
        )
    if spec.kind != BUILTIN:
        raise ValueError(f"unknown engine {spec.kind!r}: the engines are {BUILTIN!r} and {VLLM!r}")
    from offstep.rollout.engines.torch_engine import TorchEngine

    model = load_causal_lm(spec.path, dtype=DTYPES[spec.dtype]).to(device)
    if spec.lora is not None:  # the actor's peft layout; every sync fills the adapters
        model = add_adapters(model, spec.lora)
    # The adapters stay a low-rank term B(A x) at every forward, not merged into the weights:
    # merging is ~20% faster generation (benchmarks/results/results_lora.md: 17.3 vs 21.4 s a default
    # batch, 0.5 s a load) but unmerging before the next load rounds the base weights a little
    # further at every sync, so the reference (adapters off) would drift from the base and a
    # resumed run (a fresh base) would no longer equal an uninterrupted one.
    return TorchEngine(model, tok, eos, device=device, max_batch_size=spec.max_batch_size)
