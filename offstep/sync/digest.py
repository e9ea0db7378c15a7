"""Weight digests: a cheap but complete checksum of the weights a sync carries, so that every sync
proves it arrived (issue 17). The trainer digests what it sends, each rollout worker what its
engine holds after the load, and the controller compares them (``offstep.pipeline.weight_sync``).

The canonical form. Both ends digest the tensors of the rollout side's sync manifest
(``RolloutWorker.weight_sync_manifest``: every weight, or with LoRA the adapters only, by name,
shape and dtype; a tied head once, under the embedding's name), in the manifest's order, each in
the manifest's dtype (the rollout's: the trainer casts as the load casts) and shape, times the
spec's ``digest_scale`` where an engine holds a scaled copy (vLLM's LoRA B matrices hold the
adapter's scale alpha / r). The trainer
digests the tensors as it sends them (the collective path: its snapshot, already cast). A
rollout worker reads back what its engine holds, mapped back to those names (the built-in
engine: its parameters; vLLM: its parameters, fused q/k/v and gate/up rows split again, each
linear weight read as vLLM-CPU packs it for its GEMM kernels: ``offstep.rollout.engines.vllm_internals``),
never the message it received.

The checksum. A tensor's bytes, row by row along its last dimension, are read as 32-bit integers
(16- or 8-bit when a row's bytes do not divide), and each row summed with wrap-around; then
``s1 = sum_j r_j`` and ``s2 = sum_j (j + 1) r_j`` mod 2^64 over the row sums ``r_j``. Every bit
of every element enters ``s1``: changing one element changes its row's sum by a nonzero amount
mod 2^32. ``s2`` also changes when rows are moved or a square matrix is transposed. Integer sums
do not depend on the order of addition, so threads, SIMD lanes and devices agree bit for bit.
It is not a cryptographic hash: it guards against lost, stale, misrouted or corrupted loads, not
against an adversary. Cost: one read of the weights at memory speed, on one thread (``one_thread``):
0.06 s for the 0.54 GB of SmolLM2-135M in float32 on a busy 2-core machine, against 0.7 s for
the load itself (docs/safety.md, "Every weight sync proves it arrived").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from offstep.batch import Span
from offstep.errors import SyncNotVerified

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class WeightDigest:
    """``(s1, s2)`` per tensor, in the manifest's order, with the tensors' names."""

    names: tuple[str, ...]
    sums: tuple[tuple[int, int], ...]

    def first_difference(self, other: WeightDigest) -> str | None:
        """The first tensor whose checksum differs (or a note on different tensor sets); None if equal."""
        if self.names != other.names:
            missing = sorted(set(self.names) ^ set(other.names))
            return f"different tensors ({len(self.names)} vs {len(other.names)}; {missing[:5]})"
        for name, a, b in zip(self.names, self.sums, other.sums):
            if a != b:
                return name
        return None


@dataclass(frozen=True)
class Loaded:
    """A rollout worker's report on one weight load: when it ran (version-tagged), the digest of
    what its engine holds after it, the seconds that digest took (inside ``span``), and the wakes
    of a sleeping engine reported with it (``rollout.sleep_during_update``: its weights before
    ``span``, its KV cache inside it). ``refused``: why a delta sync was not applied (it did not
    fit the weights held, which stay; ``offstep.sync.delta``); empty when the load happened."""

    span: Span
    digest: WeightDigest
    digest_s: float
    woke: tuple[Span, ...] = ()
    refused: str = ""


@contextlib.contextmanager
def one_thread():
    """Run the sums on one thread: they are memory-bound, and on a busy machine every parallel
    region waits for descheduled threads (SmolLM2-135M on 2 busy cores: 0.06 s on one thread,
    2 to 4 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers, one row per row of its last dimension."""
    t = t.detach().contiguous()
    rows = t.reshape(1, -1) if t.dim() < 2 else t.reshape(-1, t.shape[-1])
    raw = rows.view(torch.uint8) if rows.element_size() != 1 else rows
    width = raw.shape[1]
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if width % size == 0:
            return raw.view(dtype)
    return raw.view(torch.int8)


@torch.no_grad()
def row_sums(t: torch.Tensor) -> torch.Tensor:
    """Each row's integer sum (mod 2^32, as int64), rows along the last dimension."""
    return _words(t).sum(1, dtype=torch.int32).to(torch.int64)


def _pair(rows: torch.Tensor) -> torch.Tensor:
    """``[s1, s2]`` (int64, wrapping) of a tensor's row sums."""
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    return torch.stack([rows.sum(), (rows * weights).sum()])


def sums_of_rows(rows: torch.Tensor) -> tuple[int, int]:
    """``(s1, s2)`` from a tensor's row sums (a slice of rows is the checksum of those rows)."""
    s1, s2 = _pair(rows).tolist()
    return s1 & _MASK, s2 & _MASK


def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    """``(s1, s2)`` of one tensor (see the module docstring)."""
    if t.numel() == 0:
        return (0, 0)
    with one_thread():
        return sums_of_rows(row_sums(t))


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> WeightDigest:
    """The digest of ``(name, tensor)`` pairs, in the order given (one transfer of the sums to
    the host at the end, not one per tensor)."""
    names, pairs = [], []
    with one_thread():
        for name, t in named:
            names.append(name)
            pairs.append(_pair(row_sums(t)) if t.numel() else torch.zeros(2, dtype=torch.int64, device=t.device))
    if not pairs:
        return WeightDigest((), ())
    sums = [(a & _MASK, b & _MASK) for a, b in torch.stack([p.cpu() for p in pairs]).tolist()]
    return WeightDigest(tuple(names), tuple(sums))


def digest_of(specs: list, get: Callable[[str], torch.Tensor]) -> WeightDigest:
    """The digest of the manifest ``specs`` (``TensorSpec``: name, shape, dtype), reading each
    tensor with ``get(name)`` and casting it to the manifest's dtype and shape when it differs."""

    def canonical():
        for s in specs:
            t = get(s.name)
            dtype = getattr(torch, s.dtype)
            if t.dtype != dtype:
                t = t.to(dtype)
            if s.digest_scale != 1:  # the engine's own product, rounded as it rounds it
                t = t * s.digest_scale
            yield s.name, t.reshape(s.shape)

    return digest(canonical())


def check_load(
    replica: int,
    version: int,
    sent: WeightDigest,
    held: WeightDigest,
    previous_sent: WeightDigest | None,
    previous_held: WeightDigest | None,
) -> None:
    """Raise :class:`SyncNotVerified`, naming the worker and the version, unless rollout worker
    ``replica`` holds what the trainer sent as ``version``. A policy that did not change although
    the trainer's did (the digest of the previous load again) is named as such: a dropped load."""
    if previous_held is not None and previous_sent is not None and held == previous_held and sent != previous_sent:
        raise SyncNotVerified(
            f"weight sync of policy version {version}: rollout worker {replica}'s weights did not change (its digest "
            f"equals that of its previous load) although the trainer's did: the load was dropped. Stopping; resume "
            f"from the last checkpoint with trainer.resume=auto"
        )
    where = sent.first_difference(held)
    if where is not None:
        raise SyncNotVerified(
            f"weight sync of policy version {version}: rollout worker {replica} holds weights that differ from "
            f"what the trainer sent (first differing tensor: {where}). Stopping; resume from the last checkpoint "
            f"with trainer.resume=auto"
        )
