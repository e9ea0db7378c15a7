"""Process-group set-up shared by every trainer role (actor, reference, critic); its network side
(the store, gloo's interface) is ``offstep.dist``'s."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from offstep.dist import STORE_TIMEOUT, bind_gloo_to_route, serve_store


@dataclass(frozen=True)
class GroupSpec:
    """Where one rank of a role group sits and how it reaches the others."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int  # the run's store (the driver's Rendezvous); 0: one rank, serving its own on master_addr
    device: str  # "cpu" or "cuda"
    num_threads: int
    group: str = ""  # the role: its keys in the run's store are prefixed with it


_own_store: list = []  # the store a one-rank group in this process serves itself


def setup(spec: GroupSpec) -> tuple[torch.device, DeviceMesh]:
    """Join the role's process group (gloo on CPU, NCCL on GPU) and return (device, mesh)."""
    torch.set_num_threads(spec.num_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
    if spec.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if dist.is_initialized():  # in-process use (tests, replay): several roles share one group
        if dist.get_world_size() != spec.world_size:
            raise RuntimeError("a different process group is already initialised in this process")
        return device, init_device_mesh(device.type, (spec.world_size,))
    if backend == "gloo" and spec.world_size > 1:  # a group of one rank has no peer to be reached by
        bind_gloo_to_route(spec.master_addr)
    if spec.master_port == 0:
        if spec.world_size != 1:
            raise ValueError("GroupSpec.master_port=0 (a store of its own) is for a group of one rank")
        _own_store[:] = [serve_store(spec.master_addr, 1)]
        store = _own_store[0]
    else:
        store = dist.PrefixStore(
            f"{spec.group}/", dist.TCPStore(spec.master_addr, spec.master_port, None, False, STORE_TIMEOUT)
        )
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size)
    mesh = init_device_mesh(device.type, (spec.world_size,))
    return device, mesh


def all_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over the group's ranks."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def all_sum(x: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def all_max(x: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
