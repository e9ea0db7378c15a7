"""What this machine has, read where a config's derived defaults follow from it (verl's GPU counts,
``offstep.config.verl.derive``) and by the checks before a run starts (``offstep.pipeline.preflight``)."""

from __future__ import annotations


def available_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch import problems surface elsewhere
        return 0
