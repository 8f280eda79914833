"""TTT loss and acceptance statistics.

Step j at index t predicts the token after index u = t+j+1; its target is the target model's
distribution at u restricted to the draft vocabulary and renormalised. A position counts when
the predicted token is an assistant token of the same document (loss_mask[u+1]); the loss also
skips positions whose target argmax lies outside the draft vocabulary (no draft id can match).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.train.ttt import shift_left


@dataclass
class Targets:
    prob: torch.Tensor  # [B, T, DV] float32: target distribution at index u over the draft vocab
    label: torch.Tensor  # [B, T] long: target argmax at u as a draft id, -1 outside the vocab
    ok: torch.Tensor  # [B, T] bool: u+1 is an assistant token of u's document


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
    return Targets(torch.stack(probs), torch.stack(labels), ok)


def step_loss(
    logits: torch.Tensor, tg: Targets, j: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(soft cross-entropy averaged over counted positions, correct [B, T], valid [B, T])."""
    s = j + 1
    t = logits.shape[1]
    lp = F.log_softmax(logits[:, : t - s].float(), dim=-1)
    prob, label, ok = tg.prob[:, s:], tg.label[:, s:], tg.ok[:, s:]
    counted = ok & (label >= 0)
    prob = torch.where(counted.unsqueeze(-1), prob, 0.0)  # garbage at masked places stays out
    loss = -(prob * lp).sum() / counted.sum().clamp(min=1)
    correct = (lp.argmax(-1) == label) & ok
    pad = torch.zeros(ok.shape[0], s, dtype=torch.bool, device=ok.device)
    return loss, torch.cat([correct, pad], 1), torch.cat([ok, pad], 1)


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


def summarize(counts: torch.Tensor) -> dict[str, list[float] | float]:
    """counts [4, steps] -> per-step accuracy, conditional acceptance and accept length."""
    c = counts.double().cpu()
    acc = (c[0] / c[1].clamp(min=1)).tolist()
    cond = (c[2] / c[3].clamp(min=1)).tolist()
    return {"acc": acc, "cond_acc": cond, "accept_length": accept_length(cond)}


def accept_length(cond: list[float]) -> float:
    """Tokens per cycle of a chain of len(cond) drafts: 1 + sum_k prod_{i<=k} cond[i]."""
    total, run = 1.0, 1.0
    for a in cond:
        run *= a
        total += run
    return total
