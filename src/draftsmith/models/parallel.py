"""Linear layers that know how they are sharded, so tensor parallelism never touches model code.

With `TP.size == 1` they are plain layers. A column layer holds a slice of every output part
(q/k/v or gate/up are fused parts), a row layer holds a slice of its input and all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError


@dataclass(slots=True)
class TP:
    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise DraftsmithError(f"{what} = {n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return t
        return t.chunk(self.size, dim=dim)[self.rank]


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
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b, W's columns (inputs) sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, tp.split(in_features, "input")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Embedding with the vocabulary sharded over ranks; rows outside a rank's slice are zero."""

    def __init__(self, vocab: int, dim: int, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.split(vocab, "vocab_size")
        self.start = tp.rank * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local)
        out = F.embedding(local.clamp(0, self.local - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)



class VocabHead(nn.Module):
    """lm_head with the vocabulary sharded; the logits are gathered on every rank."""

    def __init__(self, dim: int, vocab: int, tp: TP = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(tp.split(vocab, "vocab_size"), dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight))

