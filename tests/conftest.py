import os
from pathlib import Path

import pytest

# Tiny models built in code are cached next to the checkout, so they are built once per machine.
os.environ.setdefault("OFFSTEP_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "offstep"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


# Shared by the algorithm tests: padding positions filled with values that must never leak into a
# result (NaN, inf, huge, plausible).
GARBAGE = [float("nan"), float("inf"), -1e30, 123.0]


def pad(x, k, fill):
    """Append ``k`` columns of ``fill`` to the last dim of ``x``."""
    import torch

    return torch.cat([x, torch.full((*x.shape[:-1], k), fill, dtype=x.dtype)], dim=-1)


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
