"""Weight transport from the actor to the rollout workers through Ray's object store.

Weights travel as numpy arrays so that every rollout worker on a node reads the same shared
memory without a copy (Ray stores numpy buffers zero-copy); bfloat16, which numpy lacks, travels
as its 16-bit pattern.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

_VIEW = {torch.bfloat16: torch.int16}


def pack_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    out = {}
    for name, t in sd.items():
        t = t.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype in _VIEW:
            t = t.view(_VIEW[t.dtype])
        out[name] = (t.numpy(), dtype)
    return out


def unpack_state_dict(packed: Mapping[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (arr, dtype) in packed.items():
        with warnings.catch_warnings():  # object-store buffers are read-only; we only read them
            warnings.simplefilter("ignore")
            t = torch.from_numpy(np.asarray(arr))
        target = getattr(torch, dtype)
        if target in _VIEW:
            t = t.view(target)
        out[name] = t
    return out
