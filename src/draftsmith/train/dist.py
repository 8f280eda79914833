"""torchrun integration: process group (NCCL on GPU, gloo on CPU), device, rank."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftsmith.dist import start_group, torchrun_ranks
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
    rank, world, local = torchrun_ranks()
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
    owns = world > 1 and not dist.is_initialized()
    if owns:
        start_group(rank, world, dev)  # checks MASTER_ADDR/PORT, names a failed join
    return DistCtx(rank, world, dev, owns)


@contextmanager
def shared_failure(world: int) -> Iterator[None]:
    """The block's DraftsmithError (of any of `world` ranks) raised on every rank, or none (a
    collective where world > 1: every rank enters it, a rank's writes inside): a rank that
    raised alone (rank 0 failing to write into --out) left the others waiting at the next
    collective. Another exception (a bug, an unforeseen OSError) goes on with its traceback
    on its rank, the others stopping with a line naming it."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:
        error = e
    if world == 1:
        if error is not None:
            raise error
        return
    said: list[str | None] = [None] * world
    dist.all_gather_object(said, None if error is None else _line(error))
    if error is not None and not isinstance(error, DraftsmithError):
        raise error
    first = next((s for s in said if s is not None), None)
    if first is not None:
        raise DraftsmithError(first) from None


def _line(error: Exception) -> str:
    if isinstance(error, DraftsmithError):
        return str(error)
    return f"rank {dist.get_rank()} failed ({type(error).__name__}: {error}); its log says more"
