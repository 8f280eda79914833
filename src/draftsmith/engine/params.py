"""A request's sampling settings, apart from the samplers so that a server's HTTP processes
parse requests without importing torch (`serve/frontends.py`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # SGLang's top-nσ (its PR #2192, llama.cpp's too): keep the tokens whose tempered logit is
    # within n standard deviations of the row's largest; 0 or llama.cpp's -1: off (held as 0)
    top_n_sigma: float = 0.0

    def __post_init__(self) -> None:
        # NaN passes every comparison below and samples token 0 forever; an infinite temperature
        # flattens the logits to ties, so top-k keeps the whole vocabulary
        if not _real(self.temperature) or not math.isfinite(self.temperature):
            raise DraftsmithError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise DraftsmithError(f"temperature must be >= 0, got {self.temperature}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise DraftsmithError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not whole(self.top_k):
            raise DraftsmithError(f"top_k must be a whole number, got {self.top_k!r}")
        if self.top_k < 0:
            raise DraftsmithError(f"top_k must be >= 0, got {self.top_k}")
        n = self.top_n_sigma
        if not _real(n) or not math.isfinite(n) or (n < 0 and n != -1):
            raise DraftsmithError(f"top_n_sigma must be a finite number >= 0 (0 or -1: off), "
                                  f"got {n!r}")
        if n == -1:
            object.__setattr__(self, "top_n_sigma", 0.0)  # one setting, one key, however sent

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def kind(self) -> str:
        """What code samples with these settings: "greedy" (argmax), "temperature" (a draw at
        some temperature) or "filtered" (top-k, top-p or top-nσ too: a sort of the vocabulary).
        Each kind's code also serves the kinds before it in KINDS (`RowSampling`): rows of any
        setting of those share its decode graph."""
        if self.greedy:
            return "greedy"
        return "filtered" if self.filters else "temperature"

    @property
    def filters(self) -> bool:
        """Top-k, top-p or top-nσ cut the vocabulary (`sampling.filtered`)."""
        return bool(self.top_k or self.top_p < 1 or self.top_n_sigma > 0)


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def whole(x: object) -> bool:
    """A whole number (numpy's too), not a bool: what every count the engine takes must be."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


KINDS = ("greedy", "temperature", "filtered")  # each kind's rows can take the kinds before it


def widest(params: Sequence[SamplingParams]) -> SamplingParams:
    """The first of `params` of the widest kind: the setting whose kind serves them all."""
    return max(params, key=lambda p: KINDS.index(p.kind))
