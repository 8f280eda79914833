"""Acceptance: greedy matching and speculative (rejection) sampling that keeps the target's
distribution exactly, for chains and trees. Everything stays on device with static shapes.

Sampling follows Leviathan et al. for a chain (accept d w.p. min(1, p/q), else draw from
norm(max(0, p - q))) and SpecInfer's multi-round rule for a tree: at an accepted node its children
are tried in order, each against the current residual, which becomes norm(max(0, r - q)) after a
rejection. That rule is exact when the children of a node are independent draws from the node's q
and which children exist does not depend on their values; `tree.py` builds sampled trees so.
Drafter probabilities live in the draft vocabulary; `hot[i]` is the target id of draft id i.
"""

from __future__ import annotations

import torch

from draftsmith.engine.sampling import SamplingParams, argmax, draw, probs


def to_target_probs(q: torch.Tensor, hot: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft-vocab probabilities [..., Vd] -> target vocab [..., V], zero elsewhere."""
    out = q.new_zeros(*q.shape[:-1], vocab)
    return out.scatter_(-1, hot.expand_as(q), q)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); p itself where nothing is left (a rejection there has probability 0)."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-30), p)


def target_picks(x: torch.Tensor) -> torch.Tensor:
    """The target's token at each verified position: the argmax of logits [B, N, V], or x itself
    when it holds tokens [B, N] already (sampled decoding draws them from the target's own
    distributions; matching drafts against those draws is exact sampling, whatever the drafts).
    Told apart by dtype: tokens are integers, logits never are."""
    return argmax(x) if x.is_floating_point() else x


def chain_greedy(logits: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, S+1, V] (or the target's picks, `target_picks`) at verify tokens tok [B, S+1]
    = [last, d1..dS] -> (n, bonus)."""
    t = target_picks(logits)
    n = (tok[:, 1:] == t[:, :-1]).long().cumprod(1).sum(1)
    return n, t.gather(1, n[:, None])[:, 0]


def chain_sampled(
    logits: torch.Tensor,
    tok: torch.Tensor,
    draft: torch.Tensor,
    qbank: torch.Tensor,
    hot: torch.Tensor,
    params: SamplingParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, S] draft-vocab ids of d1..dS, each drawn from qbank[:, i] [B, S, Vd]."""
    p = probs(logits, params)
    b, s1, v = p.shape
    s = s1 - 1
    p_d = p[:, :s].gather(2, tok[:, 1:, None])[..., 0]
    q_d = qbank.gather(2, draft[..., None])[..., 0]
    ok = torch.rand_like(p_d) * q_d < p_d
    n = ok.long().cumprod(1).sum(1)
    p_n = p.gather(1, n[:, None, None].expand(b, 1, v))[:, 0]
    q_n = qbank.gather(1, n.clamp(max=s - 1)[:, None, None].expand(b, 1, qbank.shape[-1]))[:, 0]
    q_n = to_target_probs(q_n, hot, v) * (n < s)[:, None]
    return n, draw(residual(p_n, q_n))


def tree_greedy(
    logits: torch.Tensor, tok: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nodes [B, N] (node 0 the root, parents first) -> (deepest accepted node, n, bonus);
    logits [B, N, V] or the target's picks (`target_picks`).

    Siblings hold distinct tokens, so the accepted nodes form one path."""
    t = target_picks(logits)
    ok = tok == t.gather(1, parent)
    root = torch.arange(tok.shape[1], device=tok.device) == 0
    acc = root.expand_as(ok)
    for _ in range(steps):
        acc = root | (ok & acc.gather(1, parent))
    best = (acc.long() * (depth + 1)).argmax(1)
    return best, depth.gather(1, best[:, None])[:, 0], t.gather(1, best[:, None])[:, 0]


def tree_sampled(
    logits: torch.Tensor,
    tok: torch.Tensor,
    draft: torch.Tensor,
    parent: torch.Tensor,
    qsrc: torch.Tensor,
    depth: torch.Tensor,
    qbank: torch.Tensor,
    hot: torch.Tensor,
    params: SamplingParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-round rejection down the tree. Node i was drawn from qbank[:, qsrc[:, i]]; nodes are
    in depth-major order, so a node's children come after it."""
    p = probs(logits, params)
    b, n_nodes, v = p.shape
    rows = torch.arange(b, device=p.device)
    cur = torch.zeros(b, dtype=torch.long, device=p.device)
    res = p[:, 0]
    for i in range(1, n_nodes):
        q = qbank[rows, qsrc[:, i]]
        q_tok = q.gather(1, draft[:, i : i + 1])[:, 0]
        p_tok = res.gather(1, tok[:, i : i + 1])[:, 0]
        child = parent[:, i] == cur
        ok = child & (torch.rand_like(p_tok) * q_tok < p_tok)
        rej = (child & ~ok)[:, None]
        res = torch.where(ok[:, None], p[:, i],
                          torch.where(rej, residual(res, to_target_probs(q, hot, v)), res))
        cur = torch.where(ok, i, cur)
    return cur, depth.gather(1, cur[:, None])[:, 0], draw(res)
