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
from functools import cache

import torch

from draftsmith.engine.runtime import engine_compile
from draftsmith.engine.sampling import SamplingParams, probs
from draftsmith.errors import DraftsmithError
from draftsmith.models import triton_head
from draftsmith.switches import env_choice

EPS = 1e-6
PRIOR_FIRST, PRIOR_DECAY = 0.6, 0.4  # sampling-mode prior: rank r weighs 0.6 * 0.4^r
# A greedy node's k best children over the draft vocab, and the next frontier among the k*k:
# "chunk" (the default: the k best of each CHUNK-wide slice by masked maxes, then the k best of
# those, with a CTA per slice), "max" (k masked max reductions over the whole row, which
# torch.compile fuses with the log-softmax, one CTA a row) or "topk" (torch.topk: over the vocab a
# multi-block radix select, ~12 kernels a call). The H200 at batch 1 (run 8,
# speculative_default.md), draft phase of tree 7/4/24: chunk 0.59 ms, topk 0.91; of 3/4/8: chunk
# 0.24, topk 0.38, max 0.33 (run 7). Under "max" the root's children are picked eagerly: compiled
# at batch 1 over 24,576 tokens, inductor 2.11 failed an assertion while fusing it (run 8).
# Sampled trees pick their frontier the same way; their prior scores tie, and the max methods
# break ties to the lower index, so they build different (equally value-independent, so equally
# exact) sampled trees than topk.
TREE_TOPK = env_choice("DRAFTSMITH_TREE_TOPK", "chunk", ("chunk", "max", "topk"))
CHUNK = 256
# A greedy tree's children at every depth: the drafter's vocabulary head in cuBLAS, then the
# top-k above ("cublas"), or both in one Triton pass over the head's weights
# (`models/triton_head.py`, "triton": the logits never reach memory; they are rounded to the
# weights' dtype, as cuBLAS's are, so ties fall alike).
# H200 run 24 (depths past the root only), tree 7/4/24, batch 1: draft 0.415 against 0.469 ms,
# the same 4.22 tokens accepted a cycle, 2,774 against 2,676 tok/s; batch 8, tree 3/4/8: 13,032
# against 12,747. The default where CUDA and Triton are; CPU tests opt in (interpreted).
# "triton-int8": the same pass over the head in int8, one fp32 scale a row (`int8_head`): half
# the bytes; the draft only proposes, so other trees change the speed, never the output.
DRAFT_HEAD = env_choice("DRAFTSMITH_DRAFT_HEAD", "triton" if torch.cuda.is_available()
                        and triton_head.AVAILABLE else "cublas",
                        ("cublas", "triton", "triton-int8"))
if DRAFT_HEAD != "cublas" and not triton_head.AVAILABLE:
    raise DraftsmithError(f"DRAFTSMITH_DRAFT_HEAD={DRAFT_HEAD} needs the triton package (and "
                          f"torch >= 2.6)")
INT8_HEAD = "_draftsmith_int8_head"  # the weight's attribute: (its version, q, scale)
# Under the Triton head, the root's children: from the extend's hidden state by the same pass
# ("triton": the extend then forms no logits, a cuBLAS head product and the root's top-k fewer
# a cycle) or from the logits the extend formed ("logits", run 24's). H200 run 25: extend 0.050
# against 0.064 ms, cycle 12-13 us shorter, batch 1 2,776 against 2,766 tok/s (tree 7/4/24),
# batch 8 13,184 against 13,057 (3/4/8).
ROOT_HEAD = env_choice("DRAFTSMITH_ROOT_HEAD", "triton", ("triton", "logits"))

DrafterCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def most_tokens(topk: int, steps: int) -> int:
    """The most tokens a tree of `steps` depths and `topk` children a node verifies, the root
    included: its root's k children and k*k more at each later depth."""
    return 1 + topk + (steps - 1) * topk**2


@dataclass(frozen=True, slots=True)
class TreeShape:
    topk: int
    steps: int
    tokens: int  # verified tokens, the root included (SGLang's num_draft_tokens)

    def __post_init__(self) -> None:
        if self.topk < 2 or self.steps < 1:
            raise DraftsmithError(f"a tree needs topk >= 2 and steps >= 1, got {self}")
        if not 2 <= self.tokens <= most_tokens(self.topk, self.steps):
            raise DraftsmithError(
                f"num_draft_tokens {self.tokens} must lie in "
                f"[2, {most_tokens(self.topk, self.steps)}] for topk {self.topk} and steps "
                f"{self.steps}"
            )

    @property
    def candidates(self) -> int:
        return most_tokens(self.topk, self.steps) - 1

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
        v, ids = top_k_log_softmax(logits.float(), k)
        return ids, increments(v), None
    q = probs(logits, params)
    r = torch.arange(k, device=logits.device, dtype=torch.float64)
    prior = math.log(PRIOR_FIRST) + r * math.log(PRIOR_DECAY)
    return draw_k(q, k), prior.expand(*logits.shape[:-1], k), q


def increments(logp: torch.Tensor) -> torch.Tensor:
    """A greedy child's score increment from its log-probability: float64, and below zero so
    that deeper nodes never outscore their parents."""
    return logp.double().clamp(max=-EPS)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last dim, best first, by DRAFTSMITH_TREE_TOPK's method."""
    if TREE_TOPK == "chunk":
        return top_k_chunked(x, k)
    return top_k_by_max(x, k) if TREE_TOPK == "max" else x.topk(k, dim=-1)


def top_k_log_softmax(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax values, indices) of the k largest along the last dim, best first. Under
    chunk the normaliser comes from the top-k's own pass over the slices (a slice's max and sum
    of exponentials), where a separate logsumexp took three reduction kernels, ~4 us a depth on
    the H200 (run 9's probe)."""
    if TREE_TOPK == "chunk":
        v, i, lse = top_k_chunked(x, k, with_lse=True)
        return v - lse, i
    v, i = top_k(x, k)
    return v - x.logsumexp(-1, keepdim=True), i


def top_k_chunked(x: torch.Tensor, k: int, chunk: int | None = None,
                  with_lse: bool = False) -> tuple[torch.Tensor, ...]:
    """top_k_by_max's picks in two stages: the k best of each chunk-wide slice of the last dim
    (padded with -inf to a whole number of slices), then the k best of those candidates. Ties
    still go to the lower index: candidates lie slice by slice, each slice's best first.
    with_lse: also the logsumexp of the last dim ([..., 1]), from the slices' maxes."""
    v, chunk = x.shape[-1], chunk or CHUNK
    if v < 2 * chunk or k > chunk:
        top = top_k_by_max(x, k)
        return (*top, x.logsumexp(-1, keepdim=True)) if with_lse else top
    pad = -v % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    xs = x.unflatten(-1, (-1, chunk))
    cv, ci = top_k_by_max(xs, k)  # [..., slices, k]
    ci = ci + torch.arange(0, v + pad, chunk, device=x.device)[:, None]
    gv, gi = top_k_by_max(cv.flatten(-2), k)
    top = (gv, ci.flatten(-2).gather(-1, gi))
    if not with_lse:
        return top
    m = cv[..., :1].clamp(min=torch.finfo(x.dtype).min)  # a slice all -inf adds 0, not NaN
    z = (xs - m).exp().sum(-1)  # [..., slices]
    lse = gv[..., :1] + ((m[..., 0] - gv[..., :1]).exp() * z).sum(-1, keepdim=True).log()
    return (*top, lse)


def top_k_by_max(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim, best first, ties to the lower
    index: k max reductions, each skipping the indices already taken. For finite x (logits,
    tree scores): past the last value above -inf an index could repeat, where topk would not."""
    if not 0 < k <= x.shape[-1]:
        raise DraftsmithError(f"top-{k} of {x.shape[-1]} values")
    ar = torch.arange(x.shape[-1], device=x.device)
    taken = torch.zeros_like(x, dtype=torch.bool)
    vals, ids = [], []
    for _ in range(k):
        v, i = x.masked_fill(taken, float("-inf")).max(-1)
        vals.append(v)
        ids.append(i)
        taken = taken | (ar == i.unsqueeze(-1))
    return torch.stack(vals, -1), torch.stack(ids, -1)


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


def has_child(parent: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B]: whether each row's accepted node (path[:, n], depth n) has a child in its verified
    tree, so that the position past it was tried. parent [B, N] as `ancestors`'."""
    node = path.gather(1, n[:, None])
    real = torch.arange(parent.shape[1], device=parent.device) >= 1  # the root is its own parent
    return ((parent == node) & real).any(1)


def committed_mask(lengths: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    """[B, 1, rows, total]: slots below each row's committed length."""
    m = torch.arange(total, device=lengths.device) < lengths[:, None]
    return m[:, None, None, :].expand(-1, 1, rows, total).clone()


class TreeDraft:
    """One batch size's tree expansion. Only what the accept phase reads lives in buffers (the
    selected nodes, their ancestry, sampling's q bank); the frontier and the candidate blocks
    pass from depth to depth as values, so a graphed draft phase copies nothing it need not."""

    def __init__(self, shape: TreeShape, b: int, hidden: int, dvocab: int, dtype: torch.dtype,
                 device: torch.device, sampling: bool) -> None:
        k, n, fs = shape.topk, shape.tokens, shape.frontier_slots
        self.shape, self.b = shape, b
        self.cand_depth, self.cand_qsrc = shape.static(device)
        z = dict(dtype=torch.long, device=device)
        self.qbank = (torch.zeros(b, 1 + fs, dvocab, device=device) if sampling else None)
        self.node_tok, self.node_draft, self.node_depth, self.node_parent, self.node_qsrc = (
            torch.zeros(b, n, **z) for _ in range(5))
        self.anc = torch.zeros(b, n, n, dtype=torch.bool, device=device)
        self.ar_k = torch.arange(k, device=device)
        # greedy_tree's (root children, depth growth, node pick); compile() swaps in compiled ones
        self.fns: tuple[Callable, ...] = GREEDY_FNS
        # own[d][j]: frontier node j at depth d+1 sits in scratch slot d*k + j (static, so no
        # host value is copied inside a graph)
        self.own = torch.zeros(max(1, shape.steps - 1), k, fs, dtype=torch.bool, device=device)
        for d in range(shape.steps - 1):
            self.own[d, torch.arange(k), d * k + torch.arange(k)] = True
        # DRAFTSMITH_HEAD_JOIN=kernel: the Triton head's counters (greedy trees under it)
        self.head_counts = (triton_head.counter(device)
                            if triton_head.AVAILABLE and triton_head.JOIN == "kernel" else None)
        self.blocks: list[tuple[torch.Tensor, ...]] = []  # per depth: (draft, tok, score, parent)
        self.front: tuple[torch.Tensor, ...] = ()  # (ancestry, flat id, token, score, hidden)
        self.committed: torch.Tensor | None = None

    def expand_root(self, logits: torch.Tensor, hidden: torch.Tensor, params: SamplingParams,
                    d2t: torch.Tensor) -> None:
        """Sampling mode's root (greedy trees run `greedy_tree`)."""
        ids, score, q = children(logits, self.shape.topk, params)
        self.qbank[:, 0] = q
        block, self.front = first_front(ids, ids + d2t[ids], score, hidden, self.own[0],
                                        self.ar_k)
        self.blocks = [block]
        self.committed = None

    def step(self, d: int, call: DrafterCall, lengths: torch.Tensor, base: int, total: int,
             params: SamplingParams, d2t: torch.Tensor) -> None:
        """Sampling mode: run the drafter on the depth-d frontier (positions L+d-1, scratch
        slots from `base`); keep its k*k children and pick the next frontier."""
        k, s = self.shape.topk, self.shape.steps
        f_anc, f_flat, f_tok, f_score, f_hidden = self.front
        if self.committed is None:  # the same for every depth of a cycle
            self.committed = committed_mask(lengths, k, total)
        logits, h = call(f_tok, f_hidden, *depth_inputs(f_anc, self.committed, lengths, d,
                                                       self.ar_k, base))
        ids, inc, q = children(logits, k, params)
        self.qbank[:, 1 + (d - 1) * k : 1 + d * k] = q
        tok, score, parent, *nxt = frontier(ids, inc, ids + d2t[ids], h, f_score, f_flat, f_anc,
                                            self.own[min(d, s - 2)], k + (d - 1) * k * k,
                                            d == s - 1)
        self.blocks.append((ids.flatten(1), tok, score, parent))
        self.front = tuple(nxt)

    def select(self, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Sampling mode: the root plus the best N-1 candidates, in candidate (depth-major)
        order, as `pick_nodes`' values (for the buffers of `nodes`)."""
        picked = pick_nodes(last, self.blocks, self.cand_depth, self.cand_qsrc,
                            self.shape.tokens, self.shape.steps)
        self.blocks, self.front, self.committed = [], (), None
        return picked

    def nodes(self) -> tuple[torch.Tensor, ...]:
        """The buffers the accept phase reads, in `pick_nodes`' order."""
        return (self.node_tok, self.node_draft, self.node_depth, self.node_qsrc,
                self.node_parent, self.anc)

    def compile(self) -> None:
        """Greedy bookkeeping (the root's children, except under max, each depth's children and
        next frontier, node selection) as torch.compile'd pure functions: a handful of fused
        kernels in place of ~45 small ones per depth."""
        root, grow, pick = compiled_bookkeeping()
        self.fns = (root if TREE_TOPK != "max" else greedy_children, grow, pick)


class RankCounts:
    """Tree acceptance by depth and sibling rank, counted after each cycle from the state's
    buffers (eager ops between the cycle's graphs; off the timed path, for `tune`), per row.

    reached[d-1][r]: row-cycles whose verified tree held the rank-r child of the accepted
    depth-(d-1) node; accepted[d-1][r]: of those, the cycles that accepted it. Siblings are
    verified in rank order and a kept child's better siblings are kept too (they score higher),
    so a node's rank is the number of verified siblings before it. Rows are the state's, sized
    by the first cycle counted: one generate call's batch."""

    def __init__(self, steps: int, topk: int, device: torch.device) -> None:
        self.steps, self.topk = steps, topk
        self.reached = torch.zeros(0, steps * topk, dtype=torch.long, device=device)
        self.accepted = torch.zeros_like(self.reached)

    def add(self, t: TreeDraft, n: torch.Tensor, emitted: torch.Tensor,
            active: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """One cycle: n accepted drafts a row, emitted[:, d-1] the token accepted at depth d
        (d <= n), active the rows that decoded in it. path: the accepted nodes by depth (root
        past the end, `path_from`), where siblings may share a token (drafts drawn from the
        drafter): the tokens alone would count each such sibling as accepted."""
        parent, depth, tok = t.node_parent, t.node_depth, t.node_tok
        rows, width = parent.shape[0], self.steps * self.topk
        if not self.reached.shape[0]:
            self.reached = torch.zeros(rows, width, dtype=torch.long, device=parent.device)
            self.accepted = torch.zeros_like(self.reached)
        if self.reached.shape[0] != rows:  # its rows are one batch's prompts: none to mix
            raise DraftsmithError(f"rank counts sized for {self.reached.shape[0]} rows (their "
                                  f"first cycle's batch) got a cycle of {rows}; count each "
                                  f"batch with a RankCounts of its own")
        idx = torch.arange(parent.shape[1], device=parent.device)
        before = (idx[None, :] < idx[:, None]) & (idx[None, :] >= 1)  # [j, i]: i before j
        rank = ((parent[:, :, None] == parent[:, None, :]) & before).sum(-1)
        on = (idx == 0).expand_as(parent)  # on the accepted path: the root, then by depth
        if path is not None:
            on = on.scatter(1, path, True)
        else:
            for d in range(1, self.steps + 1):
                at = (depth == d) & (tok == emitted[:, d - 1 : d]) & (n[:, None] >= d)
                on = on | (at & on.gather(1, parent))
        real = (idx[None, :] >= 1) & active[:, None]
        slot = ((depth - 1).clamp(min=0) * self.topk + rank.clamp(max=self.topk - 1))
        slot = slot + width * torch.arange(rows, device=parent.device)[:, None]
        reached = real & on.gather(1, parent)  # the parent was accepted
        for total, hit in ((self.reached, reached), (self.accepted, reached & on)):
            total.view(-1).scatter_add_(0, slot[hit], torch.ones_like(slot[hit]))

    def counts(self) -> tuple[list[list[int]], list[list[int]]]:
        """(reached, accepted) as [depth][rank] lists, summed over the rows."""
        def grid(x: torch.Tensor) -> list[list[int]]:
            return x.sum(0).view(self.steps, self.topk).tolist()
        return grid(self.reached), grid(self.accepted)

    def row_counts(self) -> list[tuple[list[list[int]], list[list[int]]]]:
        """(reached, accepted) of each row, as `counts`."""
        shape = (-1, self.steps, self.topk)
        return list(zip(self.reached.view(shape).tolist(), self.accepted.view(shape).tolist(),
                        strict=True))


def first_front(ids: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, hidden: torch.Tensor,
                own0: torch.Tensor, ar_k: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
    """The root's children as a candidate block (draft, tok, score, parent) and as the first
    frontier (ancestry, flat id, token, score, hidden). Contiguous, as every later depth's are:
    a stride change would recompile the drafter."""
    b, k = ids.shape
    front = (own0.expand(b, k, -1).contiguous(), 1 + ar_k.expand(b, k), tok, score,
             hidden[:, None].expand(b, k, hidden.shape[-1]).contiguous())
    return (ids, tok, score, torch.zeros_like(ids)), front


def depth_inputs(f_anc: torch.Tensor, committed: torch.Tensor, lengths: torch.Tensor, d: int,
                 ar_k: torch.Tensor, base: int) -> tuple[torch.Tensor, ...]:
    """The drafter's (positions, slots, mask) for the depth-d frontier: positions L+d-1, scratch
    slots base + (d-1)k + j, the committed slots plus each node's frontier ancestors (scratch
    slots lie above every committed one)."""
    b, k, fs = f_anc.shape
    mask = committed.clone()
    mask[:, 0, :, base : base + fs] = f_anc
    pos = (lengths + d - 1)[:, None].expand(b, k)
    return pos, (base + (d - 1) * k + ar_k).expand(b, k), mask


def fuses_head(drafter: Callable, hidden: torch.Tensor, k: int) -> bool:
    """Whether a greedy tree's depths apply the drafter's head in the Triton head-and-top-k pass
    (DRAFTSMITH_DRAFT_HEAD=triton or triton-int8, a device Triton runs on, a top-k the kernel
    keeps, a drafter whose logits are its plain head's: one that bends them keeps them)."""
    return (DRAFT_HEAD in ("triton", "triton-int8") and triton_head.runs_on(hidden)
            and getattr(drafter, "plain_head", False)
            and k <= min(triton_head.MAX_K, drafter.lm_head.weight.shape[0]))


def root_by_head(drafter: Callable, greedy_drafts: bool, shape: TreeShape | None) -> bool:
    """Whether a decoder's draft forms the root's children from its hidden state by the Triton
    head (`greedy_tree` under `fuses_head`), so that its extend need not form root logits.
    greedy_drafts: the tree drafts as greedy decoding does (sampling too, unless it draws)."""
    w = drafter.lm_head.weight
    return (ROOT_HEAD == "triton" and greedy_drafts and shape is not None
            and fuses_head(drafter, w, shape.topk))


Head = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # the head, or int8 and its scales


def draft_head(drafter: Callable) -> Head:
    """The head a greedy tree's Triton pass reads: the drafter's, or under
    DRAFTSMITH_DRAFT_HEAD=triton-int8 its `int8_head`."""
    w = drafter.lm_head.weight
    return int8_head(w) if DRAFT_HEAD == "triton-int8" else w


def int8_head(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_head.quantize_head(w)`, made once per weight and kept on it (`INT8_HEAD`), made
    again into the same tensors when the weight changed in place (graphs captured over them read
    them by address). Inside a compiled function it is read as it stands; the first trace, which
    finds none, makes it as a side effect that the next call's guard sees (one recompile, then
    the kept tensors are the graph's inputs). Never made inside a CUDA graph capture: the
    warm-up calls before it make it."""
    kept = getattr(w, INT8_HEAD, None)
    if torch.compiler.is_compiling():
        if kept is None:
            kept = (-1, *triton_head.quantize_head(w))  # -1: an eager call makes it again
            setattr(w, INT8_HEAD, kept)
        return kept[1], kept[2]
    if kept is not None and kept[0] == w._version and kept[1].device == w.device:
        return kept[1], kept[2]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise DraftsmithError("DRAFTSMITH_DRAFT_HEAD=triton-int8: the drafter's int8 head was "
                              "not made before this CUDA graph capture; call the draft once "
                              "outside a capture first")
    with torch.no_grad():
        q, scale = triton_head.quantize_head(w)
        if kept is not None and kept[1].shape == q.shape and kept[1].device == q.device:
            q, scale = kept[1].copy_(q), kept[2].copy_(scale)
    setattr(w, INT8_HEAD, (w._version, q, scale))
    return q, scale


def greedy_tree(fns: tuple[Callable, ...], drafter: Callable, caches: list, logits: torch.Tensor,
                hidden: torch.Tensor, lengths: torch.Tensor, last: torch.Tensor,
                d2t: torch.Tensor, own: torch.Tensor, ar_k: torch.Tensor,
                cand_depth: torch.Tensor, cand_qsrc: torch.Tensor, shape: TreeShape, base: int,
                total: int, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A greedy draft tree from the root's logits and hidden state, as `pick_nodes`' values; only
    the drafter's KV cache is written. fns: (greedy_children, grow_greedy, pick_nodes) or their
    compiled copies; the fused engine compiles this whole function instead. Under the Triton
    head the root's logits are not read (`root_by_head`); counts: the head kernel's counters,
    when it joins its blocks itself (DRAFTSMITH_HEAD_JOIN=kernel)."""
    root, grow, pick = fns
    k, s = shape.topk, shape.steps
    # DRAFTSMITH_DRAFT_HEAD=triton: the drafter stops before its head, which `grow` applies,
    # and `root` too under DRAFTSMITH_ROOT_HEAD=triton (from the fed-back hidden); triton-int8:
    # the head in int8 with its rows' scales
    fused = fuses_head(drafter, hidden, k)
    head, kw = (draft_head(drafter), {"logits": False}) if fused else (None, {})
    ids, score, tok = (root(drafter.head_input(hidden), d2t, k, head, counts)
                       if root_by_head(drafter, True, shape) else root(logits, d2t, k))
    block, front = first_front(ids, tok, score, hidden, own[0], ar_k)
    blocks, committed = [block], committed_mask(lengths, k, total)
    for d in range(1, s):
        f_anc, f_flat, f_tok, f_score, f_hidden = front
        pos, slots, mask = depth_inputs(f_anc, committed, lengths, d, ar_k, base)
        out, h = drafter(f_tok, f_hidden, pos, caches, slots, mask, **kw)
        ids, _, tok, score, parent, *front = grow(out, h, f_score, f_flat, f_anc,
                                                  own[min(d, s - 2)], d2t, k + (d - 1) * k * k,
                                                  d == s - 1, head, counts)
        blocks.append((ids.flatten(1), tok, score, parent))
    return pick(last, blocks, cand_depth, cand_qsrc, shape.tokens, s)


def frontier(ids: torch.Tensor, inc: torch.Tensor, tok: torch.Tensor, h: torch.Tensor,
             f_score: torch.Tensor, f_flat: torch.Tensor, f_anc: torch.Tensor, own: torch.Tensor,
             start: int, last: bool) -> tuple[torch.Tensor, ...]:
    """The k*k children of a depth as flat (tok, score, parent) blocks and, unless it is the last
    depth, the next frontier (ancestry, flat id, token, score, hidden). Pure: no buffer written."""
    b, k = f_score.shape
    score = (f_score[:, :, None] + inc).flatten(1)
    parent = f_flat[:, :, None].expand(b, k, k).flatten(1)
    tok = tok.flatten(1)
    if last:
        return tok, score, parent
    v, sel = top_k(score, k)
    j = sel // k
    anc = f_anc.gather(1, j[..., None].expand(b, k, f_anc.shape[2])) | own
    hid = h.gather(1, j[..., None].expand(b, k, h.shape[-1]))
    return tok, score, parent, anc, start + 1 + sel, tok.gather(1, sel), v, hid


def greedy_children(logits: torch.Tensor, d2t: torch.Tensor, k: int,
                    head: Head | None = None, counts: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A node's k greedy children (the root's, or each frontier node's): (draft ids, score
    increments, target tokens). head: the drafter's vocabulary head (or, triton-int8, the int8
    head and its rows' scales), when `logits` holds its input instead
    (DRAFTSMITH_DRAFT_HEAD=triton: head and top-k in one pass; counts: the kernel joins its
    blocks). Pure but for the counters, which each call leaves at zero."""
    if head is None:
        ids, inc, _ = children(logits, k, SamplingParams(0.0))
    else:
        w, kw = (head[0], {"scale": head[1]}) if isinstance(head, tuple) else (head, {})
        v, ids = triton_head.head_top_k(logits.flatten(0, -2), w, k, counts, **kw)
        ids, inc = ids.view(*logits.shape[:-1], k), increments(v.view(*logits.shape[:-1], k))
    return ids, inc, ids + d2t[ids]


def grow_greedy(logits: torch.Tensor, h: torch.Tensor, f_score: torch.Tensor,
                f_flat: torch.Tensor, f_anc: torch.Tensor, own: torch.Tensor, d2t: torch.Tensor,
                start: int, last: bool, head: Head | None = None,
                counts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Greedy children of the frontier (top-k log-probabilities) followed by `frontier`."""
    ids, inc, tok = greedy_children(logits, d2t, f_score.shape[1], head, counts)
    return (ids, inc, *frontier(ids, inc, tok, h, f_score, f_flat, f_anc, own, start, last))


def pick_nodes(last: torch.Tensor, blocks: list[tuple[torch.Tensor, ...]],
               cand_depth: torch.Tensor, cand_qsrc: torch.Tensor, n: int,
               steps: int) -> tuple[torch.Tensor, ...]:
    """(token, draft id, depth, q source, parent node, ancestry) of the root plus the best n-1
    candidates (blocks: per depth (draft, tok, score, parent)), in candidate order. Pure."""
    draft, tok, score, parent = (torch.cat(x, 1) for x in zip(*blocks, strict=True))
    b = score.shape[0]
    sel = best_in_order(score, n - 1)
    zero = torch.zeros_like(sel[:, :1])
    flat = torch.cat([zero, sel + 1], 1)
    node_of = torch.zeros(b, score.shape[1] + 1, dtype=torch.long, device=sel.device)
    node_of = node_of.scatter(1, flat, torch.arange(n, device=sel.device).expand(b, n))
    node_parent = node_of.gather(1, torch.cat([zero, parent.gather(1, sel)], 1))
    return (torch.cat([last[:, None], tok.gather(1, sel)], 1),
            torch.cat([zero, draft.gather(1, sel)], 1),
            torch.cat([zero, cand_depth[sel]], 1),
            torch.cat([zero, cand_qsrc[sel]], 1),
            node_parent,
            ancestors(node_parent, steps))


GREEDY_FNS = (greedy_children, grow_greedy, pick_nodes)


def best_in_order(score: torch.Tensor, m: int) -> torch.Tensor:
    """Indices of each row's m largest scores, ascending; ties go to the lower index. Ranks by
    pairwise comparison, a few small fused reductions where topk and a sort were ~17 us of
    kernels on the H200 (run 7's tree 3/4/8 probe)."""
    idx = torch.arange(score.shape[1], device=score.device)
    earlier = idx[None, :] < idx[:, None]  # [i, j]: j before i
    si, sj = score[:, :, None], score[:, None, :]
    keep = ((sj > si) | ((sj == si) & earlier)).sum(-1) < m  # fewer than m rank above
    before = (keep[:, None, :] & earlier).sum(-1)  # kept ones before each candidate
    slot = keep[:, None, :] & (before[:, None, :] == torch.arange(m, device=score.device)[:, None])
    return (slot.long() * idx).sum(-1)


def verify_inputs(tok: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                  lengths: torch.Tensor, base: int, total: int) -> tuple[torch.Tensor, ...]:
    """The verify forward's (tokens, positions, mask) for a picked tree whose nodes sit in
    scratch slots from `base`."""
    mask = committed_mask(lengths, tok.shape[1], total)
    mask[:, 0, :, base : base + tok.shape[1]] |= anc
    return tok, lengths[:, None] + depth, mask


@cache
def compiled_bookkeeping() -> tuple[Callable, ...]:
    """One compiled set per process (dynamo specializes it per shape and depth)."""
    return tuple(engine_compile(f, fullgraph=True)
                 for f in (greedy_children, grow_greedy, pick_nodes))
