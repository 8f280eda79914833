"""torchrun integration: process group (NCCL on GPU, gloo on CPU), device, rank."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftsmith.dist import ensure_nvls_off
from draftsmith.errors import DraftsmithError


@dataclass
class DistCtx:
    rank: int
    world: int
    device: torch.device
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def setup(device: str = "auto") -> DistCtx:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise DraftsmithError(f"--device {device}: training runs on cpu, cuda, cuda:N or auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftsmithError(f"--device {device}: no CUDA device is available")
    dev = torch.device(f"cuda:{local}" if device == "cuda" else device)
    if world > 1 and dev.type == "cuda" and dev.index != local:
        raise DraftsmithError(f"--device {device}: under torchrun rank {rank} uses cuda:{local}")
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise DraftsmithError(f"--device {device}: cuda:{dev.index} is not one of the "
                              f"{torch.cuda.device_count()} visible CUDA device(s)")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = False
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            ensure_nvls_off()  # NVLink multicast stays off on shared machines
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
        owns = True
    return DistCtx(rank, world, dev, owns)
