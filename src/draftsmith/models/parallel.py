"""Linear layers that know how they are sharded, so tensor parallelism never touches model code.

With `TP.size == 1` they are plain layers. A column layer holds a slice of every output part
(q/k/v or gate/up are fused parts), a row layer holds a slice of its input and all-reduces.
The vocabulary is split in `ceil(vocab / size)` rows per rank; the last rank's extra rows are
zero and their logits are cut off after the gather.

CUDA graphs: a TP forward is capturable. The collectives are NCCL kernels on the current
stream (NCCL >= 2.9.6 supports capture; the communicator must exist before capture, which the
warm-up forwards of `Graphs.capture` and `init_tp`'s `device_id` ensure); every buffer comes
from the caching allocator (the graph pool during capture); nothing reads back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models import triton_linear
from draftsmith.switches import env_count

# Compiled CUDA linears over at most this many rows (tokens) run as inductor reductions instead
# of cuBLAS. Default 2. H200 run 12: one-row decode steps 21-26 % faster than cuBLAS GEMVs at
# batch 1. Run 13 (rows sharing one weight read): a chain's 2-row verify 14 % faster (0.95
# against 1.11 ms), while 4-row drafter depths (draft 0.70 against 0.44 ms) and 25-row verifies
# (2.94 against 1.15 ms) ran much slower as reductions. 0: cuBLAS always.
SMALL_LINEAR_ROWS = env_count("DRAFTSMITH_SMALL_LINEAR_ROWS", "2")


def reduce_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) written as one product-and-sum over the inputs per row, fp32 accumulate,
    rounded once. Under inductor the rows' reductions share their loop over the weight and fuse
    into one kernel that reads each weight element once, for all rows (a skinny GEMM; one row is
    the decode's GEMV), the producer of x fused into its loads. Eager it would materialise a
    weight-sized product per row: only compiled code calls it."""
    xs = x.reshape(-1, x.shape[-1]).float()
    wf = w.float()
    y = torch.stack([(wf * xs[r]).sum(-1) for r in range(xs.shape[0])])
    if b is not None:
        y = y + b.float()
    return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; in compiled CUDA code `reduce_linear` for <= SMALL_LINEAR_ROWS rows, and
    `triton_linear.split_linear` for the rows up to its switch (off by default)."""
    if x.is_cuda and torch.compiler.is_compiling():
        rows = x.numel() // x.shape[-1]
        if rows <= SMALL_LINEAR_ROWS:
            return reduce_linear(x, w, b)
        if triton_linear.fits(rows, w):
            return triton_linear.split_linear(x, w, b)
    return F.linear(x, w, b)


@dataclass(slots=True)
class TP:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise DraftsmithError(f"tensor-parallel rank {self.rank} of size {self.size}")
        self.device = torch.device(self.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise DraftsmithError(
                f"{what} = {n} is not divisible by tensor-parallel size {self.size}: give a "
                f"--tp that divides it ({_choices(n, self.size)})"
            )
        return n // self.size

    def padded(self, n: int) -> int:
        """Rows per rank when n rows are split with padding (the vocabulary)."""
        return -(-n // self.size)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return t
        return t.chunk(self.size, dim=dim)[self.rank]

    def shard_padded(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of t (dim 0), zero-padded to `padded(len(t))` rows."""
        local = self.padded(t.shape[0])
        part = t[self.rank * local : (self.rank + 1) * local]
        if part.shape[0] < local:
            pad = part.new_zeros(local - part.shape[0], *t.shape[1:])
            part = torch.cat([part, pad])
        return part


def _choices(n: int, size: int) -> str:
    """The TP sizes up to max(size, 8) that split n, as words: "1, 2 or 4"."""
    ok = [str(d) for d in range(1, min(n, max(size, 8)) + 1) if n % d == 0]
    return ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"


SINGLE = TP()


class ColumnLinear(nn.Module):
    """y = x W^T, W's rows (outputs) sharded; `parts` are fused outputs, each sharded alone."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.full_parts = list(parts)
        self.parts = [tp.split(p, "output features") for p in parts]
        out = sum(self.parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b, W's columns (inputs) sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, tp.split(in_features, "input")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # the bias inside the product, rounded once as nn.Linear's
            return linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Embedding with the vocabulary sharded over ranks; rows outside a rank's slice are zero."""

    def __init__(self, vocab: int, dim: int, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.local = tp.padded(vocab)
        self.start = tp.rank * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local)
        out = F.embedding(local.clamp(0, self.local - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class VocabHead(nn.Module):
    """lm_head with the vocabulary sharded; the logits are gathered on every rank."""

    def __init__(self, dim: int, vocab: int, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(tp.padded(vocab), dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(linear(x, self.weight))
        return logits if logits.shape[-1] == self.vocab else logits[..., : self.vocab]
