"""Process-group set-up shared by every trainer role (actor, reference, critic)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class GroupSpec:
    """Where one rank of a role group sits and how it reaches the others."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    device: str  # "cpu" or "cuda"
    num_threads: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=spec.rank,
        world_size=spec.world_size,
    )
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
