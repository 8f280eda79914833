"""Which hidden states a dataset really holds: every stored tensor against every live layer.

A few samples go through the live target with every residual stream captured (embedding output,
each decoder layer's output) plus the final normed hidden. Each stored aux slot and the stored
final hidden is compared with each of those rows per token (relative error, cosine); the median
over tokens is robust to attention-sink tokens whose norms dwarf the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.layers import CANONICAL_WORDS

TOL = 0.05  # median relative error of a clear match (bf16 storage alone gives ~0.004)
LOOSE = 0.25  # a nearest layer this close with a clear margin still counts, with a warning
MARGIN = 2.0  # the runner-up must be at least this many times further than the best


@dataclass
class SlotMatch:
    slot: str  # "aux[k]" or "hidden"
    claimed: int | None  # what the manifest says (canonical); None for the final hidden
    best_row: int  # index into MatchMatrix.rows
    rel: float
    cos: float
    runner_up_rel: float
    status: str  # exact | approximate | tied | ambiguous | none | nonfinite
    tied: list[int] = field(default_factory=list)  # rows as close as the best (it included)

    @property
    def matched(self) -> bool:
        return self.status in ("exact", "approximate", "tied")


@dataclass
class MatchMatrix:
    rows: list[str]  # "embedding (-1)", "layer 0", ..., "final norm"
    row_ids: list[int | None]  # canonical id of each row; None for the final norm
    cols: list[str]
    rel: torch.Tensor  # [rows, cols] median per-token relative error
    cos: torch.Tensor  # [rows, cols] mean per-token cosine
    tokens: int
    samples: list[int]
    token_set: str  # "loss-masked" or "all"
    slots: list[SlotMatch]
    nonfinite: list[int] = field(default_factory=list)  # per column: tokens holding NaN/inf
    sample_tokens: int = 0  # every token of the compared samples (nonfinite counts over these)

    def true_ids(self) -> list[int | None]:
        """Canonical id each aux slot best matches (None: the final norm or no clear match)."""
        return [self.row_ids[s.best_row] if s.matched else None for s in self.slots[:-1]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "convention": CANONICAL_WORDS,
            "rows": self.rows, "row_ids": self.row_ids, "cols": self.cols,
            "rel_err": _rounded(self.rel), "cosine": _rounded(self.cos),
            "tokens": self.tokens, "samples": self.samples, "token_set": self.token_set,
            "sample_tokens": self.sample_tokens,
            "slots": [
                {"slot": s.slot, "claimed": s.claimed, "best": self.rows[s.best_row],
                 "best_id": self.row_ids[s.best_row], "rel_err": _finite(s.rel),
                 "cosine": _finite(s.cos), "runner_up_rel_err": _finite(s.runner_up_rel),
                 "status": s.status, "tied_ids": [self.row_ids[i] for i in s.tied],
                 "nonfinite_tokens": self.nonfinite[k] if self.nonfinite else 0}
                for k, s in enumerate(self.slots)
            ],
            "true_ids": self.true_ids(),
        }


def _rounded(t: torch.Tensor) -> list[list[float | None]]:
    return [[_finite(round(float(x), 5)) for x in row] for row in t]


def _finite(x: float) -> float | None:
    """None for NaN/inf: strict JSON readers (jq, JavaScript) refuse those literals."""
    return x if math.isfinite(x) else None


def pick_samples(n_total: int, n: int) -> list[int]:
    """`n` indices spread evenly over the dataset (first and last included)."""
    if n >= n_total:
        return list(range(n_total))
    if n <= 1:
        return [0]
    return sorted({round(i * (n_total - 1) / (n - 1)) for i in range(n)})


@torch.no_grad()
def live_rows(model: Any, input_ids: torch.Tensor, num_layers: int) -> torch.Tensor:
    """[T, L + 2, H] float32: embedding output, each layer's output, final normed hidden."""
    dev = next(model.parameters()).device
    t = input_ids.numel()
    fo = model(input_ids.view(1, t).to(dev), torch.arange(t, device=dev).view(1, t),
               aux_ids=tuple(range(-1, num_layers)), want_logits=False)
    return torch.cat([fo.aux[0], fo.hidden[0][:, None]], 1).float().cpu()


def token_errors(stored: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """stored [T, C, H], live [T, R, H] -> per-token relative error and cosine [T, R, C]."""
    rel, cos = [], []
    live_norm = live.norm(dim=-1).clamp(min=1e-12)
    for c in range(stored.shape[1]):
        s = stored[:, c : c + 1].float()
        rel.append((s - live).norm(dim=-1) / live_norm)
        cos.append(torch.nn.functional.cosine_similarity(s, live, dim=-1))
    return torch.stack(rel, -1), torch.stack(cos, -1)


def match(
    model: Any,
    dataset: Any,
    num_layers: int,
    n_samples: int = 4,
    max_tokens: int = 256,
    loss_only: bool = True,
) -> MatchMatrix:
    idx = pick_samples(len(dataset), n_samples)
    rels, coss, masked, bad, total = [], [], [], 0, 0
    for i in idx:
        s = dataset[i]
        full = torch.cat([s["aux"], s["hidden"][:, None]], 1)
        ok = full.isfinite().all(-1)  # [T, C]: a stored state with NaN/inf compares with nothing
        bad, total = bad + (~ok).sum(0), total + int(ok.shape[0])
        n = min(max_tokens, int(s["input_ids"].numel()))  # causal: a prefix is exact
        live = live_rows(model, s["input_ids"][:n], num_layers)
        r, c = token_errors(full[:n], live)
        rels.append(r.masked_fill(~ok[:n, None], math.nan))
        coss.append(c.masked_fill(~ok[:n, None], math.nan))
        masked.append(s["loss_mask"][:n].bool())
    rel, cos, mask = torch.cat(rels), torch.cat(coss), torch.cat(masked)
    use_mask = loss_only and bool(mask.any())
    if use_mask:
        rel, cos = rel[mask], cos[mask]
    claimed = list(dataset.manifest.get("aux_layer_ids") or [])
    n_aux = rel.shape[-1] - 1
    cols = [f"aux[{k}]" for k in range(n_aux)] + ["hidden"]
    rows = ["embedding"] + [f"layer {j}" for j in range(num_layers)] + ["final norm"]
    row_ids: list[int | None] = [*range(-1, num_layers), None]
    med, mean_cos = rel.nanmedian(0).values, cos.nanmean(0)
    said = [claimed[k] if k < len(claimed) and k < n_aux else None for k in range(n_aux + 1)]
    slots = [
        _verdict(cols[k], said[k], med[:, k], mean_cos[:, k],
                 row_ids.index(said[k]) if said[k] in row_ids[:-1] else None)
        for k in range(n_aux + 1)
    ]
    return MatchMatrix(rows, row_ids, cols, med, mean_cos, int(rel.shape[0]), idx,
                       "loss-masked" if use_mask else "all", slots,
                       [int(x) for x in bad], total)


def _verdict(col: str, claimed: int | None, rel: torch.Tensor, cos: torch.Tensor,
             claimed_row: int | None = None) -> SlotMatch:
    order = torch.argsort(rel)
    best = int(order[0])
    b = float(rel[best])
    if math.isnan(b):  # every stored state of this slot holds NaN/inf: nothing to match
        row = claimed_row if claimed_row is not None else rel.numel() - 1
        return SlotMatch(col, claimed, row, math.nan, math.nan, math.nan, "nonfinite")
    r = float(rel[order[1]]) if rel.numel() > 1 else float("inf")
    tied = [int(i) for i in order if not _clear(float(rel[i]), b)]
    clear = len(tied) == 1  # two layers of equal states (both 0) are no match
    if not clear and claimed_row in tied and float(rel[claimed_row]) <= TOL:
        # layers whose states are near-identical here: feeding any of them feeds the same
        best, status = claimed_row, "tied"
    elif b <= TOL and clear:
        status = "exact"
    elif b <= LOOSE and clear:
        status = "approximate"
    elif b <= LOOSE:
        status = "ambiguous"
    else:
        status = "none"
    return SlotMatch(col, claimed, best, round(float(rel[best]), 6), round(float(cos[best]), 6),
                     round(r, 6), status, [] if clear else sorted(tied))


def _clear(x: float, best: float) -> bool:
    """A row with relative error `x` is clearly further than the best's."""
    return x >= MARGIN * best and x > best
