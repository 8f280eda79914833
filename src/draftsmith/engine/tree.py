"""EAGLE-2 dynamic draft trees on device: expansion, node selection, ancestry, masks.

Candidates (flat ids 1..M; 0 is the root): the root's top-k children (depth 1), then for each
depth d = 1..S-1 the top-k children of each of the k frontier nodes (k*k per depth). Each depth
keeps the k best candidates by cumulative log-probability as the next frontier; the tree is the
root plus the best N-1 candidates. A child's score is strictly below its parent's, so every kept
node's parent is kept.

Sampling mode draws each node's k children independently from its q (with replacement) and scores
them by a fixed prior per sibling rank instead of their log-probabilities: the tree's shape then
does not depend on the drawn values, which SpecInfer's multi-round rejection needs to be exact
(see `verify.py`). Greedy mode is EAGLE-2's value-driven tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.engine.sampling import SamplingParams, probs
from draftsmith.errors import DraftsmithError

EPS = 1e-6
PRIOR_FIRST, PRIOR_DECAY = 0.6, 0.4  # sampling-mode prior: rank r weighs 0.6 * 0.4^r

DrafterCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class TreeShape:
    topk: int
    steps: int
    tokens: int  # verified tokens, the root included (SGLang's num_draft_tokens)

    def __post_init__(self) -> None:
        if self.topk < 2 or self.steps < 1:
            raise DraftsmithError(f"a tree needs topk >= 2 and steps >= 1, got {self}")
        if not 2 <= self.tokens <= 1 + self.candidates:
            raise DraftsmithError(
                f"num_draft_tokens {self.tokens} must lie in [2, {1 + self.candidates}] for "
                f"topk {self.topk} and steps {self.steps}"
            )

    @property
    def candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk**2

    @property
    def frontier_slots(self) -> int:
        """Drafter scratch slots: k frontier nodes for each of the S-1 expanded depths."""
        return (self.steps - 1) * self.topk

    def static(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per candidate: depth, and which q it was drawn from (0 root, 1 + (d-1)k + j)."""
        k, s = self.topk, self.steps
        depth = [1] * k + [d + 1 for d in range(1, s) for _ in range(k * k)]
        qsrc = [0] * k + [1 + (d - 1) * k + j for d in range(1, s) for j in range(k)
                          for _ in range(k)]
        return (torch.tensor(depth, device=device), torch.tensor(qsrc, device=device))


def draw_k(q: torch.Tensor, k: int) -> torch.Tensor:
    """k independent draws from each distribution q [..., V] -> [..., k]."""
    e = torch.empty(*q.shape[:-1], k, q.shape[-1], device=q.device).exponential_(1)
    return (q.float().unsqueeze(-2) / e).argmax(-1)


def children(
    logits: torch.Tensor, k: int, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(draft ids [..., k], score increments [..., k] float64, q or None when greedy)."""
    if params.greedy:
        v, ids = logits.float().log_softmax(-1).topk(k, dim=-1)
        return ids, v.double().clamp(max=-EPS), None
    q = probs(logits, params)
    r = torch.arange(k, device=logits.device, dtype=torch.float64)
    prior = math.log(PRIOR_FIRST) + r * math.log(PRIOR_DECAY)
    return draw_k(q, k), prior.expand(*logits.shape[:-1], k), q


def ancestors(parent: torch.Tensor, steps: int) -> torch.Tensor:
    """parent [B, N] (root's parent is itself) -> [B, N, N]: ancestor-or-self."""
    b, n = parent.shape
    eye = torch.eye(n, dtype=torch.bool, device=parent.device).expand(b, n, n)
    anc = eye
    for _ in range(steps):
        anc = eye | anc.gather(1, parent[..., None].expand(b, n, n))
    return anc


def path_from(anc_row: torch.Tensor, depth: torch.Tensor, steps: int) -> torch.Tensor:
    """The nodes on one root-to-node path, by depth: [B, S+1]; 0 (root) past the path's end."""
    d = torch.arange(steps + 1, device=depth.device)
    hit = anc_row[:, :, None] & (depth[:, :, None] == d)
    ids = torch.arange(depth.shape[1], device=depth.device)[None, :, None]
    return (hit.long() * ids).sum(1)


def committed_mask(lengths: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    """[B, 1, rows, total]: slots below each row's committed length."""
    m = torch.arange(total, device=lengths.device) < lengths[:, None]
    return m[:, None, None, :].expand(-1, 1, rows, total).clone()


class TreeDraft:
    """Buffers for one batch size and the expansion that fills them (graph-safe)."""

    def __init__(self, shape: TreeShape, b: int, hidden: int, dvocab: int, dtype: torch.dtype,
                 device: torch.device, sampling: bool) -> None:
        k, m, n, fs = shape.topk, shape.candidates, shape.tokens, shape.frontier_slots
        self.shape, self.b = shape, b
        self.cand_depth, self.cand_qsrc = shape.static(device)
        z = dict(dtype=torch.long, device=device)
        self.tok, self.draft, self.parent = (torch.zeros(b, m, **z) for _ in range(3))
        self.score = torch.zeros(b, m, dtype=torch.float64, device=device)
        self.f_flat, self.f_tok = torch.zeros(b, k, **z), torch.zeros(b, k, **z)
        self.f_score = torch.zeros(b, k, dtype=torch.float64, device=device)
        self.f_hidden = torch.zeros(b, k, hidden, dtype=dtype, device=device)
        self.f_anc = torch.zeros(b, k, fs, dtype=torch.bool, device=device)
        self.qbank = (torch.zeros(b, 1 + fs, dvocab, device=device) if sampling else None)
        self.node_tok, self.node_draft, self.node_depth, self.node_parent, self.node_qsrc = (
            torch.zeros(b, n, **z) for _ in range(5))
        self.anc = torch.zeros(b, n, n, dtype=torch.bool, device=device)
        self.ar_k = torch.arange(k, device=device)
        # own[d][j]: frontier node j at depth d+1 sits in scratch slot d*k + j (static, so no
        # host value is copied inside a graph)
        self.own = torch.zeros(max(1, shape.steps - 1), k, fs, dtype=torch.bool, device=device)
        for d in range(shape.steps - 1):
            self.own[d, torch.arange(k), d * k + torch.arange(k)] = True

    def expand_root(self, logits: torch.Tensor, hidden: torch.Tensor, params: SamplingParams,
                    to_target: Callable) -> None:
        k = self.shape.topk
        ids, score, q = children(logits, k, params)
        if q is not None:
            self.qbank[:, 0] = q
        self.draft[:, :k] = ids
        self.tok[:, :k] = to_target(ids)
        self.score[:, :k] = score
        self.parent[:, :k] = 0
        self.f_flat.copy_(1 + self.ar_k.expand(self.b, k))
        self.f_tok.copy_(self.tok[:, :k])
        self.f_score.copy_(score)
        self.f_hidden.copy_(hidden[:, None].expand_as(self.f_hidden))
        self.f_anc.copy_(self.own[0].expand_as(self.f_anc))

    def step(self, d: int, call: DrafterCall, lengths: torch.Tensor, base: int, total: int,
             params: SamplingParams, to_target: Callable) -> None:
        """Run the drafter on the depth-d frontier (positions L+d-1, scratch slots from `base`);
        store its k*k children and pick the next frontier."""
        k, s, b = self.shape.topk, self.shape.steps, self.b
        fs = self.shape.frontier_slots
        pos = (lengths + d - 1)[:, None].expand(b, k)
        slots = (base + (d - 1) * k + self.ar_k).expand(b, k)
        mask = committed_mask(lengths, k, total)
        mask[:, 0, :, base : base + fs] |= self.f_anc
        logits, h = call(self.f_tok, self.f_hidden, pos, slots, mask)
        ids, inc, q = children(logits, k, params)
        if q is not None:
            self.qbank[:, 1 + (d - 1) * k : 1 + d * k] = q
        score = (self.f_score[:, :, None] + inc).flatten(1)
        blk = slice(k + (d - 1) * k * k, k + d * k * k)
        self.draft[:, blk] = ids.flatten(1)
        self.tok[:, blk] = to_target(ids).flatten(1)
        self.score[:, blk] = score
        self.parent[:, blk] = self.f_flat[:, :, None].expand(b, k, k).flatten(1)
        if d == s - 1:
            return
        v, sel = score.topk(k, dim=1)
        j = sel // k
        self.f_anc.copy_(self.f_anc.gather(1, j[..., None].expand(b, k, fs)) | self.own[d])
        self.f_flat.copy_(blk.start + 1 + sel)
        self.f_tok.copy_(self.tok[:, blk].gather(1, sel))
        self.f_score.copy_(v)
        self.f_hidden.copy_(h.gather(1, j[..., None].expand_as(self.f_hidden)))

    def select(self, last: torch.Tensor) -> None:
        """The root plus the best N-1 candidates, in candidate (depth-major) order."""
        n, s = self.shape.tokens, self.shape.steps
        sel = self.score.topk(n - 1, dim=1).indices.sort(dim=1).values
        zero = torch.zeros_like(sel[:, :1])
        flat = torch.cat([zero, sel + 1], 1)
        self.node_tok.copy_(torch.cat([last[:, None], self.tok.gather(1, sel)], 1))
        self.node_draft.copy_(torch.cat([zero, self.draft.gather(1, sel)], 1))
        self.node_depth.copy_(torch.cat([zero, self.cand_depth[sel]], 1))
        self.node_qsrc.copy_(torch.cat([zero, self.cand_qsrc[sel]], 1))
        node_of = torch.zeros(self.b, self.shape.candidates + 1, dtype=torch.long,
                              device=sel.device)
        node_of.scatter_(1, flat, torch.arange(n, device=sel.device).expand(self.b, n))
        pflat = torch.cat([zero, self.parent.gather(1, sel)], 1)
        self.node_parent.copy_(node_of.gather(1, pflat))
        self.anc.copy_(ancestors(self.node_parent, s))
