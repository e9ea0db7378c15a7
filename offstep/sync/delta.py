"""Delta weight syncs (``pipeline.weight_sync_delta``): after an update, only the elements that
changed in the rollout's dtype travel; the replica applies them to the version it holds.

The encoding. Per manifest tensor (``offstep.sync.collective.TensorSpec``), in the rollout's dtype,
the new tensor is compared bit for bit with the base (the version sent before): unchanged → no
entry; a few elements → their flat indices (int32) and values; many → the whole tensor, whichever
is fewer bytes. The entries are one table (int64 rows: tensor index, kind, element count, payload
offset) and one byte payload, so the object store and a broadcast carry the same two arrays.

Its base. A delta names the fingerprint of the base's weight digest (``offstep.sync.digest``),
which the replica compares with the digest of what it holds (taken after its last load) before it
touches anything: a delta made from another version is refused (:class:`DeltaRefused`), never
applied; the controller then sends that replica a full sync, and the sender re-bases on full syncs
every ``pipeline.weight_sync_full_every`` versions. After the apply, the replica's digest is checked
against the trainer's full digest as for any sync. Everything in a delta is validated (sizes,
indices) before the first write, so a truncated or damaged one leaves the replica's weights as
they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from offstep.errors import OffstepError
from offstep.sync.digest import WeightDigest

SPARSE, DENSE = 1, 2
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_MASK63 = (1 << 63) - 1


class DeltaRefused(OffstepError):
    """A delta that does not fit the weights a replica holds (another base, or a damaged delta)."""


@dataclass(frozen=True)
class Delta:
    """The change from version ``base_version`` (whose digest's fingerprint is ``base``) to ``version``."""

    version: int
    base_version: int
    base: int
    table: np.ndarray  # int64 [entries, 4]: tensor index, SPARSE|DENSE, element count, payload byte offset
    payload: np.ndarray  # uint8

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes + self.payload.nbytes)


def fingerprint(d: WeightDigest) -> int:
    """One 63-bit number from a digest's per-tensor sums (a base's identity in a delta's header)."""
    acc = len(d.sums)
    for i, (s1, s2) in enumerate(d.sums):
        acc = (acc * 1_000_003 + s1 * (2 * i + 1) + s2) & _MASK63
    return acc


def _pad(n: int) -> int:
    """``n`` rounded up to 8 bytes: every array in the payload starts aligned (views need it)."""
    return (n + 7) // 8 * 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as same-width integers, flat (bit-exact comparison: -0.0 != 0.0, NaN == NaN)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(_INT[t.element_size()]) if t.is_floating_point() else t


def encode(
    specs: list,
    new: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    version: int,
    base_version: int,
    base_fp: int,
) -> Delta:
    """The delta from ``base`` to ``new`` (both by manifest name, in the manifest's dtypes)."""
    rows, chunks, offset = [], [], 0
    for i, s in enumerate(specs):
        a, b = new[s.name], base[s.name]
        diff = _bits(a) != _bits(b)
        k = int(diff.sum())  # counted first: the indices are listed only when they are worth sending
        if k == 0:
            continue
        size = a.element_size()
        flat = a.detach().contiguous().reshape(-1)
        if k * (4 + size) < flat.numel() * size:
            changed = diff.nonzero().reshape(-1)
            parts = [changed.to(torch.int32).cpu(), flat[changed].cpu()]
            rows.append((i, SPARSE, k, offset))
        else:
            parts = [flat.cpu()]
            rows.append((i, DENSE, int(flat.numel()), offset))
        for p in parts:
            raw = p.contiguous().view(torch.uint8).numpy()
            chunks += [raw, np.zeros(_pad(raw.nbytes) - raw.nbytes, np.uint8)]
            offset += _pad(raw.nbytes)
    payload = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return Delta(int(version), int(base_version), int(base_fp), table, payload)


def apply(delta: Delta, specs: list, target: Callable[[str], torch.Tensor], held_fp: int | None) -> int:
    """Write ``delta`` into the tensors ``target(name)`` returns (live weights, in place), after
    checking that they are its base (``held_fp``: the fingerprint of their digest) and that every
    entry is well formed. Returns the elements written; raises :class:`DeltaRefused` before any
    write otherwise."""
    if held_fp != delta.base:
        raise DeltaRefused(
            f"a delta to version {delta.version} was made from version {delta.base_version}, whose "
            "digest is not that of the weights this replica holds; it needs a full sync"
        )
    payload = torch.from_numpy(np.ascontiguousarray(delta.payload))
    writes = []
    for idx, kind, count, off in delta.table.tolist():
        if not 0 <= idx < len(specs) or kind not in (SPARSE, DENSE):
            raise DeltaRefused(f"delta to version {delta.version}: malformed entry {(idx, kind, count, off)}")
        s = specs[idx]
        dst = target(s.name)
        size = dst.element_size()
        need = _pad(4 * count) + count * size if kind == SPARSE else s.numel * size
        if dst.numel() != s.numel or count < 1 or count > s.numel or off < 0 or off + need > payload.numel():
            raise DeltaRefused(
                f"delta to version {delta.version}: entry for {s.name} does not fit (truncated or damaged)"
            )
        if kind == SPARSE:
            where = payload[off : off + 4 * count].view(torch.int32).to(torch.int64)
            values = payload[off + _pad(4 * count) : off + need].view(dst.dtype)
            if int(where.min()) < 0 or int(where.max()) >= s.numel:
                raise DeltaRefused(f"delta to version {delta.version}: an index of {s.name} is out of range")
        else:
            where, values = None, payload[off : off + need].view(dst.dtype)
        writes.append((dst, where, values))
    with torch.no_grad():  # every entry checked: now write
        for dst, where, values in writes:
            flat = dst.view(-1) if dst.is_contiguous() else dst.reshape(-1).clone()
            if where is None:
                flat.copy_(values.to(flat.device))
            else:
                flat.index_copy_(0, where.to(flat.device), values.to(flat.device))
            if flat.data_ptr() != dst.data_ptr():
                dst.copy_(flat.view(dst.shape))
    return int(sum(v.numel() for _, _, v in writes))


class DeltaSender:
    """The trainer's side: the base (the last version sent, in the rollout's dtypes) and when the
    next sync must be full (none sent yet, ``full_every`` versions since the last full one, or a
    replica that refused a delta: :meth:`rebase`)."""

    def __init__(self, specs: list, full_every: int):
        self.specs, self.full_every = list(specs), max(1, int(full_every))
        self.base: dict[str, torch.Tensor] | None = None
        self.base_version, self.base_fp, self.since_full = 0, 0, 0
        self.last: Delta | None = None  # the last delta sent (None: the last sync was full)

    def rebase(self) -> None:
        self.base = None

    def cast(self, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The manifest's tensors as the rollout holds them (dtype and shape)."""
        out = {}
        for s in self.specs:
            t = get(s.name).detach()
            out[s.name] = t.to(getattr(torch, s.dtype), copy=True).reshape(s.shape)  # never the live weights
        return out

    def next(
        self,
        version: int,
        new: dict[str, torch.Tensor],
        new_digest: WeightDigest,
        full: bool = False,
        keep: bool = True,
    ) -> Delta | None:
        """The delta to send as ``version`` (``None``: send the full weights); ``new`` becomes the
        base (copied unless ``keep=False`` says the caller hands it over)."""
        out = None
        if not full and self.base is not None and self.since_full + 1 < self.full_every:
            out = encode(self.specs, new, self.base, version, self.base_version, self.base_fp)
            self.since_full += 1
        else:
            self.since_full = 0
        self.base = {k: v.clone() for k, v in new.items()} if keep else new
        self.base_version, self.base_fp, self.last = int(version), fingerprint(new_digest), out
        return out
