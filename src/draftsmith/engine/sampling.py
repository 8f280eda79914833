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


# A vocabulary-long argmax in two stages: compiled as one, it was a looped reduction of one
# program a row, 8.5 us of the H200's one-token decode step and 10.2 of a 25-token accept (run
# 25's probe), where the slices' maxes take a program each.
ARGMAX_SLICE = 1024


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), ties to the first (NaN counts as the largest, as in torch): for a last dim
    of at least two slices, each ARGMAX_SLICE-wide slice's max first, then the first slice
    holding the largest. A last dim of no whole number of slices is padded with its dtype's
    least value, which never comes before an equal value of its own."""
    v = x.shape[-1]
    if v < 2 * ARGMAX_SLICE:
        return x.argmax(-1)
    if pad := -v % ARGMAX_SLICE:
        least = float("-inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
        x = torch.nn.functional.pad(x, (0, pad), value=least)
    best, at = x.unflatten(-1, (-1, ARGMAX_SLICE)).max(-1)
    s = best.argmax(-1, keepdim=True)
    return s[..., 0] * ARGMAX_SLICE + at.gather(-1, s)[..., 0]


def draw(prob: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    e = torch.empty_like(prob).exponential_(1, generator=generator)
    return argmax(prob / e)


def sample(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    if p.greedy:
        return argmax(logits)
    return draw(probs(logits, p), generator)
