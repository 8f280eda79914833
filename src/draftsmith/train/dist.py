"""torchrun integration: process group (NCCL on GPU, gloo on CPU), device, rank."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
    # host-side checks between steps: gloo, so a check waits for no GPU (None: the default)
    host_group: Any = None
    hosts: tuple[str, ...] = ()  # each rank's host name, by rank (`setup`)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a collective where world > 1)."""
        if self.world == 1:
            return [obj]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, obj, group=self.host_group)
        return every

    def host_part(self) -> tuple[int, int]:
        """(this rank's index among the ranks of its host, their count), by host name, not by
        LOCAL_WORLD_SIZE, which a launcher other than torchrun may leave unset: each host
        holds its own copy of the data. Unknown hosts: (0, 1)."""
        if self.world == 1 or len(self.hosts) != self.world:
            return 0, 1
        mine = [r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank]]
        return mine.index(self.rank), len(mine)

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
    if world > 1:  # a group running here already is kept only as this rank, world and backend
        start_group(rank, world, dev)  # checks MASTER_ADDR/PORT, names a failed join
    host = dist.new_group(backend="gloo") if world > 1 and dev.type == "cuda" else None
    ctx = DistCtx(rank, world, dev, owns, host)
    ctx.hosts = tuple(ctx.gather(socket.gethostname()))
    return ctx


@contextmanager
def shared_failure(world: int, group: Any = None, cheap: bool = False,
                   who: str | None = None) -> Iterator[None]:
    """The block's DraftsmithError (of any of `world` ranks) raised on every rank, or none (a
    collective where world > 1: every rank enters it, a rank's writes inside): a rank that
    raised alone (rank 0 failing to write into --out) left the others waiting at the next
    collective. Another exception (a bug, an unforeseen OSError) goes on with its traceback
    on its rank, the others stopping with a line naming it. `cheap` (a block run every step):
    one flag summed over `group`, a gloo group (the default under gloo), the lines gathered
    only where a rank failed. `who`: the failing rank's name in the others' line for another
    exception (default "rank N")."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:
        error = e
    if world == 1:
        if error is not None:
            raise error
        return
    if cheap and not _any_failed(error is not None, group):
        return
    said: list[str | None] = [None] * world
    mine = None if error is None else _line(error, who)
    if group is None:
        dist.all_gather_object(said, mine)
    else:
        dist.all_gather_object(said, mine, group=group)
    if error is not None and not isinstance(error, DraftsmithError):
        raise error
    first = next((s for s in said if s is not None), None)
    if first is not None:
        raise DraftsmithError(first) from None


def _any_failed(failed: bool, group: Any) -> bool:
    flag = torch.tensor([int(failed)], dtype=torch.int32)
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


@contextmanager
def ranked(ctx: DistCtx) -> Iterator[None]:
    """The block's DraftsmithError named by this rank and its host where there are several:
    a rank's own copy of the data (another host's disk) is what its error is about."""
    try:
        yield
    except DraftsmithError as e:
        if ctx.world == 1:
            raise
        raise DraftsmithError(f"{who(ctx)}: {e}") from None


def who(ctx: DistCtx) -> str:
    """This rank as an error names it: its data, its memory are its host's."""
    return f"rank {ctx.rank} (host {socket.gethostname()})"


def _line(error: Exception, who: str | None = None) -> str:
    if isinstance(error, DraftsmithError):
        return str(error)
    name = who or f"rank {dist.get_rank()}"
    return f"{name} failed ({type(error).__name__}: {error}); its log says more"
