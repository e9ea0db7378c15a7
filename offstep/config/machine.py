"""What this machine has, read where a config's derived defaults follow from it (verl's GPU counts,
``offstep.launch.verl.derive``) and by the checks before a run starts (``offstep.launch.preflight``).

``simulated_gpus(n)`` makes both see ``n`` GPUs on each node instead (``offstep train --cfg
--gpus N``): a launch script for a GPU cluster resolves and is checked on a laptop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_simulated: list[int] = []  # the GPUs per node of the innermost simulated_gpus(), if any


@contextmanager
def simulated_gpus(per_node: int) -> Iterator[None]:
    """Within the block, ``available_gpus()`` is ``per_node`` and ``gpus_simulated()`` says so."""
    _simulated.append(per_node)
    try:
        yield
    finally:
        _simulated.pop()


def gpus_simulated() -> int | None:
    """The GPUs per node that ``simulated_gpus`` stands in for this machine's, else None."""
    return _simulated[-1] if _simulated else None


def available_gpus() -> int:
    if _simulated:
        return _simulated[-1]
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch import problems surface elsewhere
        return 0
