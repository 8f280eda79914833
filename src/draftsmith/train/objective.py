"""TTT loss and acceptance statistics.

Step j at index t predicts the token after index u = t+j+1; its target is the target model's
distribution at u restricted to the draft vocabulary and renormalised. A position counts when
the predicted token is an assistant token of the same document (loss_mask[u+1]) as the chain's
start t; the loss also skips positions whose target argmax lies outside the draft vocabulary
(no draft id can match).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from draftsmith.train.ttt import shift_left


@dataclass
class Targets:
    # [B, T, DV] float32: target distribution at index u over the draft vocab; all zero where u
    # does not count (make_targets), so the loss needs no per-step masking pass over it
    prob: torch.Tensor
    label: torch.Tensor  # [B, T] long: target argmax at u as a draft id, -1 outside the vocab
    ok: torch.Tensor  # [B, T] bool: u+1 is an assistant token of u's document
    # [B, T] document ids: a chain counts only where it starts in its target's document (in a
    # packed row one starting at the end of the previous document never happens at inference)
    doc: torch.Tensor | None = None


@torch.no_grad()
def make_targets(
    hidden: torch.Tensor,
    head: torch.Tensor,
    used: torch.Tensor,
    loss_mask: torch.Tensor,
    doc: torch.Tensor,
) -> Targets:
    """hidden: [B, T, Ht] the target's final (post-norm) hidden; head: [V, Ht] its lm_head;
    used: [DV] target id of each draft id (sorted); loss_mask, doc: [B, T]."""
    draft_of = torch.full((head.shape[0],), -1, dtype=torch.long, device=head.device)
    draft_of[used] = torch.arange(used.numel(), device=head.device)
    probs, labels = [], []
    for row in hidden:  # one row at a time bounds the [T, V] logits
        logits = F.linear(row.to(head.dtype), head).float()
        labels.append(draft_of[logits.argmax(-1)])
        probs.append(torch.softmax(logits.index_select(-1, used), dim=-1))
    same_doc = (shift_left(doc, 1, -2) == doc) & (doc >= 0)
    ok = shift_left(loss_mask.bool(), 1, False) & same_doc
    label = torch.stack(labels)
    counted = ok & (label >= 0)
    # garbage (even NaN) where u does not count stays out of every step's loss and gradient;
    # in place: no second [B, T, DV] copy
    prob = torch.stack(probs).masked_fill_(~counted.unsqueeze(-1), 0.0)
    return Targets(prob, label, ok, doc)


def step_loss(
    logits: torch.Tensor, tg: Targets, j: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(soft cross-entropy averaged over counted positions, correct [B, T], valid [B, T]).

    -sum(p * log_softmax(z)) is written logsumexp(z) - sum(p * z) (p sums to 1 where counted):
    no [B, T, DV] log-probabilities are kept, and compiled it is one pass over the logits."""
    s = j + 1
    t = logits.shape[1]
    n = max(t - s, 0)  # a batch narrower than the step scores nothing at it
    z = logits[:, :n].float()
    prob, label, ok = tg.prob[:, s:], tg.label[:, s:], tg.ok[:, s:]
    if tg.doc is not None:
        ok = ok & (tg.doc[:, :n] == tg.doc[:, s:])
    counted = ok & (label >= 0)
    per = torch.logsumexp(z, -1) - (prob * z).sum(-1)
    # + 0 * every row: a non-finite logit anywhere (a corrupt sample) still makes the loss
    # non-finite, so the trainer stops and names the batch instead of training on NaN gradients
    loss = (torch.where(counted, per, 0.0).sum() + 0.0 * per.sum()) / counted.sum().clamp(min=1)
    correct = (z.argmax(-1) == label) & ok
    pad = torch.zeros(ok.shape[0], t - n, dtype=torch.bool, device=ok.device)
    return loss, torch.cat([correct, pad], 1), torch.cat([ok, pad], 1)


@cache
def compiled_step_loss() -> Callable:
    """step_loss through torch.compile, symbolic in the batch width (the longest row rounded up
    to --pad-multiple, or max_len: it differs between batches) and in the step: a few graphs."""
    import torch._inductor.config as inductor

    from draftsmith.engine.runtime import raise_recompile_limit

    raise_recompile_limit()
    # torch 2.11's coalescing analysis asserts on this graph with symbolic widths (H200,
    # 2026-12-01: InductorError in tiling_utils.get_pw_red_splits); it only picks tilings.
    # Older torch has no such option, and torch.compile refuses unknown ones.
    off = ({"triton.coalesce_tiling_analysis": False}
           if hasattr(inductor.triton, "coalesce_tiling_analysis") else {})
    return torch.compile(step_loss, dynamic=True, options=off)


def chain_counts(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """correct, valid: [S, B, T] per TTT step -> counts [4, S]: correct & valid, valid, and the
    same two restricted to chains whose earlier steps were all valid and correct."""
    chain_ok = valid.int().cummin(0).values.bool()
    done = correct.int().cummin(0).values.bool()
    prev = torch.cat([torch.ones_like(done[:1]), done[:-1]])
    cond = chain_ok & prev
    dims = (1, 2)
    return torch.stack([
        (correct & valid).sum(dims), valid.sum(dims), (cond & correct).sum(dims), cond.sum(dims)
    ]).double()


def counted_positions(tg: Targets) -> torch.Tensor:
    """Positions step 0 trains on (float64, on the device): an assistant token of the chain's
    document next, the target's argmax inside the draft vocab."""
    ok = tg.ok[:, 1:] & (tg.label[:, 1:] >= 0)
    if tg.doc is not None:
        ok = ok & (tg.doc[:, :-1] == tg.doc[:, 1:])
    return ok.sum().double()


def summarize(counts: torch.Tensor) -> dict[str, list[float | None] | float]:
    """counts [4, steps] -> per-step accuracy, conditional acceptance and accept length.

    A step no position reached (acc) or no chain reached (cond_acc) in the window is None,
    null in the log: unmeasured, not a drafter that is never right there."""
    c = counts.double().cpu()
    acc, cond = rates(c[0], c[1]), rates(c[2], c[3])
    return {"acc": acc, "cond_acc": cond, "accept_length": accept_length(cond)}


def rates(hits: torch.Tensor, reached: torch.Tensor) -> list[float | None]:
    return [h / n if n > 0 else None for h, n in zip(hits.tolist(), reached.tolist(),
                                                     strict=True)]


def measured(cond: list[float | None]) -> int:
    """How many leading positions of `cond` were measured: an accept length stops there."""
    n = 0
    while n < len(cond) and cond[n] is not None:
        n += 1
    return n


def accept_length(cond: list[float | None]) -> float:
    """Tokens per cycle of a chain of len(cond) drafts: 1 + sum_k prod_{i<=k} cond[i], over the
    measured positions only (it stops at the first None: where chains ran out of tokens before
    a position, what lies past it is unknown, so the figure is the measured part's)."""
    total, run = 1.0, 1.0
    for a in cond[: measured(cond)]:
        run *= a
        total += run
    return total


def cut_short(cond: list[float | None]) -> bool:
    """Whether an accept length over `cond` may undercount: a position went unmeasured while
    the chains before it still accepted (after a measured 0 nothing can reach it anyway)."""
    m = measured(cond)
    return m < len(cond) and (m == 0 or cond[m - 1] > 0)


def measured_words(cond: list[float | None]) -> str:
    """'' where an accept length over `cond` counts every position that matters, else which
    ones it covers."""
    if not cut_short(cond):
        return ""
    n, m = len(cond), measured(cond)
    return f"positions 0..{m - 1} of {n} measured" if m else f"no position of {n} measured"
