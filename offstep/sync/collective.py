"""Collective weight sync: actor rank 0 broadcasts the policy to every rollout worker with
``torch.distributed``, in buckets, over a process group of its own (``pipeline.weight_sync=collective``).

The group. Actor rank 0 is rank 0 and rollout worker i is rank i + 1. It is made at start-up
(``connect``), and made again, on a new store (a new port), whenever a rollout worker is replaced
(``join``, from ``offstep.pipeline.weight_sync``): a group with a dead member cannot be repaired,
so every member joins a new one, and the old one is left to finish (or fail) what it had in
flight. It lives on a ``TCPStore`` served by actor rank 0, as a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (every member on a GPU) object built directly: the actor already belongs to
its FSDP default group, and the rollout workers to none, so neither ``init_process_group`` nor
``new_group`` applies. This follows verl's weight sync for its one-step off-policy trainer (a
separate actor→rollout communicator, parameters broadcast one after another); here tensors are
packed into buckets and the layout is agreed once.

The layout. Both ends agree once on a manifest: the rollout model's unique parameters (name,
shape, dtype) in registration order (``manifest``). ``plan`` places them back to back in one flat
buffer per dtype and cuts each buffer into buckets of ``bucket_bytes``. On a rollout worker the
parameters are re-pointed at views of those flat buffers (``flatten_parameters``), so a bucket is
received straight into the live weights: no allocation and no copy on the receiving side. Actor
rank 0 packs its full parameters into a snapshot with the same layout, cast to the rollout's dtype
(the object-store path casts on load instead: the same rounding), and broadcasts each bucket as
soon as it is full, so packing overlaps sending.

An engine that loads weights through its own path (vLLM) receives into buffers of its own
instead and then loads them (``WeightReceiver`` without a model): one copy on the receiving side.
vLLM's own weight-transfer engines (``vllm.distributed.weight_transfer``, v0.32) are NCCL, CUDA IPC
and others for GPUs; none serves gloo, so this one transport serves both engines on CPU and GPU.

The order. The actor posts its broadcasts and returns (gloo runs them on its own threads); every
rollout worker receives in its own call queue, behind the generation in flight, exactly as the
object-store path orders ``load_weights``. Each transfer starts with a header (version, element
count) that the receiver checks. While a version is still on its way to some worker (k >= 2), the
next one goes into another snapshot, at most ``max_in_flight`` of them (the object store holds as
many copies). With NCCL the actor waits until every worker has received (an NCCL kernel left
waiting beside the FSDP communicator's can deadlock the GPU), so the controller submits the
receives before the send. The NCCL path is written to the same API but untested (no GPU here).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from offstep.dist import bind_gloo_to_route, serve_store
from offstep.sync.delta import Delta, DeltaSender, apply
from offstep.sync.digest import WeightDigest, tensor_sums

_PREFIX = "offstep/weight_sync"


@dataclass(frozen=True)
class TensorSpec:
    """One parameter as both ends must see it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    # The weight digest's canonical form is the tensor times this (offstep.sync.digest): vLLM
    # holds a LoRA B matrix already multiplied by the adapter's scale. The transfer ignores it.
    digest_scale: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits: elements ``[offset, offset + numel)`` of its dtype's flat buffer."""

    dtype: str
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Elements ``[start, end)`` of one dtype's flat buffer, broadcast as one tensor."""

    dtype: str
    start: int
    end: int


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def element_size(dtype: str) -> int:
    return torch.empty((), dtype=_dtype(dtype)).element_size()


def manifest(model: torch.nn.Module, only: Callable[[str], bool] | None = None) -> list[TensorSpec]:
    """The unique parameters of ``model`` (a tied weight once, under its first name), in order;
    ``only``: those whose name it accepts (a LoRA model's adapters)."""
    return [
        TensorSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for n, p in model.named_parameters()
        if only is None or only(n)
    ]


def plan(specs: list[TensorSpec], bucket_bytes: int) -> tuple[dict[str, Slot], dict[str, int], list[Bucket]]:
    """Lay ``specs`` out back to back, one flat buffer per dtype (in order of first appearance),
    and cut each buffer into buckets of at most ``bucket_bytes`` (a tensor may straddle buckets).

    Returns ``(slots by name, elements per dtype, buckets)``.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (pipeline.weight_sync_bucket_mb)")
    slots: dict[str, Slot] = {}
    totals: dict[str, int] = {}
    for s in specs:
        if s.name in slots:
            raise ValueError(f"weight-sync manifest names {s.name!r} twice")
        off = totals.get(s.dtype, 0)
        slots[s.name] = Slot(s.dtype, off, s.numel)
        totals[s.dtype] = off + s.numel
    buckets = []
    for dt, total in totals.items():
        per = max(1, bucket_bytes // element_size(dt))
        buckets += [Bucket(dt, a, min(a + per, total)) for a in range(0, total, per)]
    return slots, totals, buckets


def overlaps(slot: Slot, buckets: list[Bucket]) -> list[tuple[int, int]]:
    """``(bucket index, elements of the slot inside it)`` for every bucket the slot touches."""
    end = slot.offset + slot.numel
    out = []
    for i, b in enumerate(buckets):
        if b.dtype == slot.dtype and b.start < end and slot.offset < b.end:
            out.append((i, min(end, b.end) - max(slot.offset, b.start)))
    return out


def check_manifest(expected: list[TensorSpec], actual: list[TensorSpec], who: str) -> None:
    """Raise naming the differences when ``actual`` (names, shapes) disagrees with ``expected``."""
    a = {s.name: s.shape for s in expected}
    b = {s.name: s.shape for s in actual}
    missing, extra = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    shapes = [f"{n}: {a[n]} vs {b[n]}" for n in a.keys() & b.keys() if a[n] != b[n]]
    if missing or extra or shapes:
        raise ValueError(
            f"weight sync: the {who} model does not match the rollout manifest: missing {missing[:10]}, "
            f"unexpected {extra[:10]}, shapes {shapes[:10]}; every rollout worker and the actor must load the "
            "same architecture (model.path)"
        )


# ------------------------------------------------------------------------------------ the group
def _timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=float(timeout_s))


def make_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A process group object of its own (not registered as the default group); blocks until all
    ``world_size`` ranks have joined."""
    store = dist.PrefixStore(_PREFIX, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _timeout(timeout_s)
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        opts._devices = [
            dist.ProcessGroupGloo.create_device(interface=iface)
            if iface
            else dist.ProcessGroupGloo.create_default_device()
        ]
        opts._threads = 2  # two buckets in flight at once
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("pipeline.weight_sync=collective on GPUs needs a CUDA build of torch with NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"weight-sync backend {backend!r} is not gloo or nccl")


def _broadcast(group: dist.ProcessGroup, t: torch.Tensor):
    return group.broadcast(t, 0)


def _wait(works: list, device: torch.device) -> None:
    for w in works:
        w.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class _Snapshot:
    flat: dict[str, torch.Tensor]
    works: list
    held: tuple = ()  # a delta's table and payload, alive until their broadcasts end

    def free(self) -> bool:
        if all(w.is_completed() for w in self.works):
            for w in self.works:  # surfaces a failed transfer (e.g. a timeout) here
                w.wait()
            self.works = []
            return True
        return False


class WeightSender:
    """Actor rank 0's end: serves the store, packs snapshots, posts broadcasts."""

    def __init__(self, host: str, device: torch.device, timeout_s: float):
        self.host, self.device, self.timeout_s = host, device, timeout_s
        self.store = serve_store(host, None, _timeout(timeout_s))
        bind_gloo_to_route(host)  # a gloo group's own listeners go on the interface of this address
        self.group = None

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.store.port

    def idle(self) -> bool:
        """No broadcast of this sender's is still in flight (failed ones count as done)."""
        return all(w.is_completed() for s in getattr(self, "snapshots", []) for w in s.works)

    def connect(
        self,
        world_size: int,
        backend: str,
        specs: list[TensorSpec],
        bucket_bytes: int,
        own: list[TensorSpec],
        max_in_flight: int = 1,
    ) -> None:
        check_manifest(specs, own, "actor")
        self.slots, self.totals, self.buckets = plan(specs, bucket_bytes)
        self.touches = {name: overlaps(slot, self.buckets) for name, slot in self.slots.items()}
        self.scales = {s.name: s.digest_scale for s in specs if s.digest_scale != 1}
        self.blocking = backend == "nccl"
        self.max_in_flight = max(1, max_in_flight)
        self.snapshots = [self._new_snapshot()]  # allocated (and touched) now, not in the first sync
        self.group = make_group(self.store, 0, world_size, backend, self.timeout_s)

    def _new_snapshot(self) -> _Snapshot:
        flat = {dt: torch.zeros(n, dtype=_dtype(dt), device=self.device) for dt, n in self.totals.items()}
        return _Snapshot(flat, [])

    def _free_snapshot(self) -> _Snapshot:
        for s in self.snapshots:
            if s.free():
                return s
        if len(self.snapshots) < self.max_in_flight:
            self.snapshots.append(self._new_snapshot())
            return self.snapshots[-1]
        oldest = self.snapshots.pop(0)  # every snapshot still in flight: wait for the oldest
        _wait(oldest.works, self.device)
        oldest.works = []
        self.snapshots.append(oldest)
        return oldest

    def _header(self, version: int, delta: Delta | None) -> torch.Tensor:
        """version, elements, then (a delta) its base's fingerprint, table rows, payload bytes."""
        extra = [0, 0, 0] if delta is None else [delta.base, len(delta.table), delta.payload.nbytes]
        return torch.tensor([version, sum(self.totals.values()), *extra], dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        delta: DeltaSender | None = None,
        full: bool = False,
    ) -> dict[str, tuple[int, int]]:
        """Pack ``named`` full tensors and broadcast each bucket once it is full. Returns each
        tensor's checksum (``offstep.sync.digest.tensor_sums``) as packed, in the rollout's dtype,
        taken while the copy is fresh in cache. With ``delta`` (``pipeline.weight_sync_delta``),
        everything is packed first and, unless a full sync is due (or ``full``), only the change
        from the version sent before goes out (``offstep.sync.delta``)."""
        if self.group is None:
            raise RuntimeError("weight sync: send() before connect()")
        snap = self._free_snapshot()
        deferred = delta is not None
        works = [] if deferred else [_broadcast(self.group, self._header(version, None))]
        left = [b.end - b.start for b in self.buckets]
        posted = (
            len(self.buckets) if deferred else 0
        )  # buckets go out in index order, the order the receivers post theirs in
        seen = set()
        sums: dict[str, tuple[int, int]] = {}
        for name, t in named:
            slot = self.slots.get(name)
            if slot is None:  # connect() checked the names; this is a parameter added since
                raise KeyError(f"weight sync: actor parameter {name!r} is not in the rollout manifest")
            seen.add(name)
            packed = snap.flat[slot.dtype][slot.offset : slot.offset + slot.numel]
            packed.copy_(t.reshape(-1))
            packed = packed.view(t.shape)
            sums[name] = tensor_sums(packed * self.scales[name] if name in self.scales else packed)
            for i, n in self.touches[name]:
                left[i] -= n
            # Collectives pair up by the order they are issued in, not by size or name: a bucket
            # that fills before an earlier one (the manifest's order is not the actor's, as with
            # vLLM's checkpoint order) waits for it.
            while posted < len(self.buckets) and left[posted] == 0:
                b = self.buckets[posted]
                works.append(_broadcast(self.group, snap.flat[b.dtype][b.start : b.end]))
                posted += 1
        if len(seen) != len(self.slots):
            raise KeyError(f"weight sync: the actor did not send {sorted(self.slots.keys() - seen)[:10]}")
        if deferred:
            views = {n: snap.flat[sl.dtype][sl.offset : sl.offset + sl.numel] for n, sl in self.slots.items()}
            sent = WeightDigest(tuple(self.slots), tuple(sums[n] for n in self.slots))
            d = delta.next(version, views, sent, full)
            works.append(_broadcast(self.group, self._header(version, d)))
            if d is None:
                works += [_broadcast(self.group, snap.flat[b.dtype][b.start : b.end]) for b in self.buckets]
            else:
                snap.held = (torch.from_numpy(d.table).to(self.device), torch.from_numpy(d.payload).to(self.device))
                works += [_broadcast(self.group, t) for t in snap.held if t.numel()]
        snap.works = works
        if self.blocking:
            _wait(works, self.device)
        return sums


def full_parameters(
    model: torch.nn.Module, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` per unique parameter (``only``: those whose name it accepts); FSDP2
    shards are all-gathered, so every rank of the actor's group must iterate (in the same order).
    On a one-rank mesh the local shard is the full tensor: no gather, no copy."""
    for name, p in model.named_parameters():
        if only is not None and not only(name):
            continue
        if isinstance(p, DTensor):
            p = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
        yield name, p.detach()


@torch.no_grad()
def flatten_parameters(
    model: torch.nn.Module,
    specs: list[TensorSpec],
    slots: dict[str, Slot],
    totals: dict[str, int],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Re-point every parameter of ``model`` at a view of one flat buffer per dtype (values kept),
    so that broadcasts land in the live weights. Tied parameters are one object: re-pointed once."""
    flat = {dt: torch.empty(n, dtype=_dtype(dt), device=device) for dt, n in totals.items()}
    for s in specs:
        p = model.get_parameter(s.name)
        slot = slots[s.name]
        view = flat[slot.dtype][slot.offset : slot.offset + slot.numel].view(s.shape)
        view.copy_(p)
        p.data = view
    return flat


class WeightReceiver:
    """A rollout worker's end. With a ``model`` (the built-in engine), its parameters live in the
    flat buffers that the broadcasts fill: a receive lands in the live weights. Without one
    (``model=None``, with the engine's ``specs``), the flat buffers are the receiver's own and
    ``tensors()`` hands out views of them by name, for an engine that applies weights through its
    own loader (vLLM's ``reload_weights``, whose post-load processing a write into its parameters
    would skip)."""

    def __init__(self, model: torch.nn.Module | None, device: torch.device, specs: list[TensorSpec] | None = None):
        if (model is None) == (specs is None):
            raise ValueError("WeightReceiver: pass a model or the specs of its own buffers, not both")
        self.model, self.device = model, device
        self.own = manifest(model) if model is not None else list(specs)
        self.group = None

    def connect(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        specs: list[TensorSpec],
        bucket_bytes: int,
        timeout_s: float,
    ) -> None:
        if self.own != list(specs):
            check_manifest(specs, self.own, f"rollout worker {rank - 1}")
            raise ValueError(
                f"weight sync: rollout worker {rank - 1} has other dtypes or order than rollout worker 0; "
                "every replica must use the same rollout.dtype and rollout.engine"
            )
        self.slots, self.totals, self.buckets = plan(list(specs), bucket_bytes)
        if self.model is not None:
            self.flat = flatten_parameters(self.model, list(specs), self.slots, self.totals, self.device)
        else:
            self.flat = {dt: torch.zeros(n, dtype=_dtype(dt), device=self.device) for dt, n in self.totals.items()}
        if backend == "gloo":
            bind_gloo_to_route(host)
        store = dist.TCPStore(host, port, None, False, _timeout(timeout_s))
        self.group = make_group(store, rank, world_size, backend, timeout_s)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The last version received, by name: views of the flat buffers (valid until the next receive)."""
        out = {}
        for s in self.own:
            slot = self.slots[s.name]
            out[s.name] = self.flat[s.dtype][slot.offset : slot.offset + slot.numel].view(s.shape)
        return out

    @torch.no_grad()
    def receive(self, version: int, held_fp: int | None = None) -> float:
        """Receive one version into the flat buffers; returns when its header arrived. A delta
        (``offstep.sync.delta``) is received whole, then applied to the flat buffers if their
        digest's fingerprint is ``held_fp`` (else ``DeltaRefused``, the buffers untouched)."""
        if self.group is None:
            raise RuntimeError("weight sync: receive() before connect()")
        header = torch.empty(5, dtype=torch.int64, device=self.device)
        _wait([_broadcast(self.group, header)], self.device)
        t_header = time.time()
        got, total, base, rows, nbytes = (int(x) for x in header.tolist())
        if got != version or total != sum(self.totals.values()):
            raise RuntimeError(
                f"weight sync out of step: expected version {version} ({sum(self.totals.values())} "
                f"elements), the actor sent version {got} ({total})"
            )
        if rows == 0 and nbytes == 0 and base == 0:  # a full sync
            works = [_broadcast(self.group, self.flat[b.dtype][b.start : b.end]) for b in self.buckets]
            _wait(works, self.device)
            return t_header
        table = torch.empty((rows, 4), dtype=torch.int64, device=self.device)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _wait([_broadcast(self.group, t) for t in (table, payload) if t.numel()], self.device)
        apply(
            Delta(version, -1, base, table.cpu().numpy(), payload.cpu().numpy()),
            self.own,
            self.tensors().__getitem__,
            held_fp,
        )
        return t_header


def join(
    actor_handles: list,
    rollout_handles: list,
    endpoint: tuple[str, int],
    backend: str,
    specs: list[TensorSpec],
    bucket_mb: float,
    timeout_s: float,
    max_in_flight: int = 1,
    in_place: bool = True,
) -> list:
    """The calls (Ray object refs) that make a weight-sync group between actor rank 0, whose store
    serves ``endpoint`` (``ActorWorker.open_weight_sync``), and every rollout worker; all must
    finish (each blocks until every member has joined). ``in_place=False``: the replicas receive
    into buffers of their own, never into the weights they generate with (the fully asynchronous
    mode, where a receive runs beside the generation)."""
    bucket_bytes = max(1, int(bucket_mb * 2**20))
    host, port = endpoint
    world = 1 + len(rollout_handles)
    refs = [actor_handles[0].join_weight_sync.remote(world, backend, specs, bucket_bytes, max_in_flight)]
    refs += [
        w.join_weight_sync.remote(host, port, i + 1, world, backend, specs, bucket_bytes, timeout_s, in_place)
        for i, w in enumerate(rollout_handles)
    ]
    return refs


def connect(
    actor_handles: list,
    rollout_handles: list,
    backend: str,
    bucket_mb: float,
    timeout_s: float,
    max_in_flight: int = 1,
    host: str | None = None,
    specs: list[TensorSpec] | None = None,
    in_place: bool = True,
) -> None:
    """Driver side: make the weight-sync group between actor rank 0 and every rollout worker (Ray
    actor handles of ``ActorWorker`` and ``RolloutWorker``); its store listens on ``host`` (None:
    actor rank 0's node address). ``specs``: the rollout manifest (None: asked of worker 0)."""
    import ray

    if specs is None:
        specs = ray.get(rollout_handles[0].weight_sync_manifest.remote())
    endpoint = ray.get(actor_handles[0].open_weight_sync.remote(timeout_s, host))
    ray.get(
        join(actor_handles, rollout_handles, endpoint, backend, specs, bucket_mb, timeout_s, max_in_flight, in_place)
    )
