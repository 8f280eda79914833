"""On-device sampling with no host sync: greedy, temperature, top-k, top-p.

Sampling uses the exponential trick, argmax(p / E) with E ~ Exponential(1), which draws from p
without a cumulative sum or a sync and is CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise DraftsmithError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DraftsmithError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DraftsmithError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampler with these settings draws from (float32, last dim)."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        x = top_p_filter(x, p.top_p)
    return x.softmax(-1)


# Eager even inside a compiled step (still capturable in a CUDA graph): torch 2.11's inductor
# split the vocab-long cumsum at batch 256 and failed in codegen (H200, 2026-12-01), and the
# sort dominates this block anyway.
@torch.compiler.disable
def top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """x with -inf outside the smallest set of top tokens whose probability reaches top_p."""
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    sp = sorted_x.softmax(-1)
    drop = sp.cumsum(-1) - sp > top_p
    return x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))


def draw(prob: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    e = torch.empty_like(prob).exponential_(1, generator=generator)
    return (prob / e).argmax(-1)


def sample(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    if p.greedy:
        return logits.argmax(-1)
    return draw(probs(logits, p), generator)
