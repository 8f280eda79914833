"""Cost model for `draftsmith tune`: predict tokens/s of every speculative setting, then
recommend one per batch size from predictions and measurements side by side.

Numpy only. Times are milliseconds per cycle; acceptance is per position, never one alpha.
"""

from __future__ import annotations

import functools
import heapq
import math
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import as_strided

from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    from draftsmith.tune.refill_model import Refill

TOPKS = (1, 2, 4, 8)
DRAFT_TOKENS = (4, 8, 16, 24, 32, 64)
MAX_STEPS = 10
# row-cycles at the pooled figures that each prompt's own tree counts start from
TREE_PRIOR = 4.0


class CostModelError(DraftsmithError, ValueError):
    """A bad setting, cost table or acceptance table; the message says which and why."""


def tree_capacity(steps: int, topk: int) -> int:
    """Most tokens SGLang's EAGLE-2 tree can verify: the root, topk at depth 1, then topk**2
    candidates per further depth (each of the topk kept nodes proposes topk children)."""
    return 1 if steps == 0 else 1 + topk + (steps - 1) * topk * topk


DEEPEST = 64  # the deepest draft a setting may have


@dataclass(frozen=True, slots=True)
class SpecSetting:
    """One speculative configuration, in SGLang's terms. steps 0 means no speculation.

    num_draft_tokens counts the root (the last verified token), as SGLang does; 0 means
    "derive it", which only topk 1 can (steps + 1).
    """

    steps: int
    topk: int = 1
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.steps > DEEPEST:
            raise CostModelError(f"steps must be 0 (no speculation) to {DEEPEST}, got "
                                 f"{self.steps}")
        if self.topk < 1:
            raise CostModelError(f"topk must be at least 1, got {self.topk}")
        if self.num_draft_tokens == 0 and self.topk == 1:
            object.__setattr__(self, "num_draft_tokens", self.steps + 1)
        if self.steps == 0:
            self._check_baseline()
        elif self.topk == 1:
            self._check_chain()
        else:
            self._check_tree()

    def _check_baseline(self) -> None:
        if self.topk != 1 or self.num_draft_tokens != 1:
            raise CostModelError(
                "steps 0 means no speculation: topk must be 1 and num_draft_tokens 1, got "
                f"topk {self.topk}, num_draft_tokens {self.num_draft_tokens}"
            )

    def _check_chain(self) -> None:
        if self.num_draft_tokens != self.steps + 1:
            raise CostModelError(
                f"topk 1 drafts a chain, so num_draft_tokens must be steps + 1 = "
                f"{self.steps + 1} (SGLang forces this), got {self.num_draft_tokens}"
            )

    def _check_tree(self) -> None:
        cap = tree_capacity(self.steps, self.topk)
        if not 2 <= self.num_draft_tokens <= cap:
            raise CostModelError(
                f"steps {self.steps}, topk {self.topk}: num_draft_tokens must be 2 to {cap} "
                f"(1 + topk + (steps-1)*topk^2), got {self.num_draft_tokens}"
            )

    @classmethod
    def baseline(cls) -> SpecSetting:
        return cls(steps=0, topk=1, num_draft_tokens=1)

    @property
    def is_baseline(self) -> bool:
        return self.steps == 0

    def __str__(self) -> str:
        if self.is_baseline:
            return "no speculation"
        return f"steps {self.steps}, topk {self.topk}, {self.num_draft_tokens} draft tokens"


# ---------------------------------------------------------------------------- acceptance


def _ratio(num: Sequence[float], den: Sequence[float], what: str) -> tuple[float, ...]:
    if len(num) != len(den):
        raise CostModelError(f"{what}: {len(num)} accepted counts but {len(den)} reached counts")
    out = []
    for k, (a, r) in enumerate(zip(num, den, strict=True), start=1):
        if a < 0 or r < 0 or a > r:
            raise CostModelError(f"{what}: position {k} has accepted {a} of reached {r}")
        if r == 0:
            break  # never reached: unmeasured from here on
        out.append(a / r)
    if not out:
        raise CostModelError(f"{what}: position 1 was never reached, nothing was measured")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Measured acceptance of a drafter on the user's prompts.

    chain[k-1] = p_k = P(draft token k accepted | tokens 1..k-1 accepted), for topk 1.
    tree[d-1][r] = q = P(the rank-r child at depth d is the accepted one | its parent was),
    ranks by the drafter's own score, so sum over r <= 1 (siblings exclude each other).
    Beyond the measured depth the last measured value is reused (Prediction.extrapolated
    says so); a rank not measured counts as never accepted. Without tree data, rank 0 uses
    the chain value and other ranks 0, so trees can only tie with chains (`tune` measures
    both: `from_rank_counts`).
    """

    chain: tuple[float, ...] = ()
    tree: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", tuple(float(p) for p in self.chain))
        object.__setattr__(self, "tree", tuple(tuple(float(q) for q in row) for row in self.tree))
        if not self.chain and not self.tree:
            raise CostModelError("acceptance: give chain or tree probabilities, got neither")
        for k, p in enumerate(self.chain, start=1):
            if not 0.0 <= p <= 1.0:
                raise CostModelError(f"acceptance: chain position {k} is {p}, not in [0, 1]")
        for d, row in enumerate(self.tree, start=1):
            if any(q < 0 for q in row) or sum(row) > 1.0 + 1e-9:
                raise CostModelError(f"acceptance: tree depth {d} {row} is not a sub-distribution")

    @property
    def depth(self) -> int:
        """Deepest measured position."""
        return max(len(self.chain), len(self.tree))

    def p(self, k: int) -> float:
        """Conditional acceptance of chain position k (1-based)."""
        if self.chain:
            return self.chain[min(k, len(self.chain)) - 1]
        row = self.tree[min(k, len(self.tree)) - 1]
        return row[0] if row else 0.0

    def q(self, d: int, r: int) -> float:
        """Conditional acceptance of the rank-r (0-based) child at depth d (1-based)."""
        if not self.tree:
            return self.p(d) if r == 0 else 0.0
        row = self.tree[min(d, len(self.tree)) - 1]
        return row[r] if r < len(row) else 0.0

    @classmethod
    def constant(cls, alpha: float, depth: int = MAX_STEPS) -> Acceptance:
        return cls(chain=(alpha,) * depth)

    @classmethod
    def from_chain_counts(cls, reached: Sequence[int], accepted: Sequence[int]) -> Acceptance:
        """reached[k-1]: cycles whose draft token k was verified with 1..k-1 accepted;
        accepted[k-1]: of those, cycles that accepted token k."""
        return cls(chain=_ratio(accepted, reached, "chain counts"))

    @classmethod
    def from_accept_histogram(cls, hist: Sequence[int]) -> Acceptance:
        """hist[a]: cycles that accepted exactly a draft tokens (the bonus token not counted),
        all drafted with the same steps = len(hist) - 1."""
        tail = np.cumsum(np.asarray(hist, dtype=np.int64)[::-1])[::-1]  # tail[a] = #(>= a)
        return cls.from_chain_counts(tail[:-1].tolist(), tail[1:].tolist())

    @classmethod
    def from_tree_counts(
        cls, reached: Sequence[int], accepted: Sequence[Sequence[int]]
    ) -> Acceptance:
        """reached[d-1]: cycles whose depth d was verified with its parent accepted;
        accepted[d-1][r]: of those, cycles in which the rank-r child was accepted."""
        totals = [sum(row) for row in accepted]
        depth = len(_ratio(totals, reached, "tree counts"))
        rows = tuple(tuple(a / reached[d] for a in accepted[d]) for d in range(depth))
        return cls(tree=rows)

    @classmethod
    def from_rank_counts(
        cls, reached: Sequence[Sequence[int]], accepted: Sequence[Sequence[int]],
        chain: Sequence[float] = (),
    ) -> Acceptance:
        """From a tree run's counts by depth and sibling rank: reached[d-1][r], cycles whose
        tree verified the rank-r child of the accepted depth-(d-1) node; accepted[d-1][r], of
        those, cycles that accepted it. q is their ratio (0 where never reached), a row scaled
        to sum to 1 at most (a rarely verified rank's own ratio can overshoot); depths from the
        first whose rank 0 was never reached are left out. chain: the chain's own figures."""
        rows = []
        for d, (got, seen) in enumerate(zip(accepted, reached, strict=True), start=1):
            if len(got) != len(seen) or any(a < 0 or a > r for a, r in zip(got, seen,
                                                                               strict=True)):
                raise CostModelError(f"rank counts: depth {d} accepted {got} of reached {seen}")
            if not seen or seen[0] == 0:
                break
            q = [a / r if r else 0.0 for a, r in zip(got, seen, strict=True)]
            rows.append(tuple(x / max(1.0, math.fsum(q)) for x in q))
        if not rows:
            raise CostModelError("rank counts: depth 1 was never reached, nothing was measured")
        return cls(chain=tuple(chain), tree=tuple(rows))

    def to_dict(self) -> dict[str, list]:
        return {"chain": list(self.chain), "tree": [list(row) for row in self.tree]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence]) -> Acceptance:
        return cls(chain=tuple(data.get("chain", ())), tree=tuple(data.get("tree", ())))


def prompt_tree(pooled: Acceptance, reached: Sequence[Sequence[int]],
                accepted: Sequence[Sequence[int]], chain: Sequence[float],
                prior: float = TREE_PRIOR) -> Acceptance:
    """One prompt's tree acceptance from its own rank counts (`RankCounts.row_counts`), each
    q drawn towards the pooled one by `prior` row-cycles: one answer reaches a deep or low
    ranked node a few times at most, and a rank it never reached is not one it never accepts.
    Depths as the pooled figures'; chain: the prompt's own chain figures."""
    if not pooled.tree:
        return Acceptance(chain=tuple(chain))
    depth = range(len(pooled.tree))
    seen = [[r + prior for r in reached[d]] for d in depth]
    got = [[a + prior * pooled.q(d + 1, k) for k, a in enumerate(accepted[d])] for d in depth]
    return Acceptance.from_rank_counts(seen, got, chain)


def chain_tokens_per_cycle(acc: Acceptance, steps: int) -> float:
    """1 + sum_k prod_{i<=k} p_i: the accepted drafts plus the bonus token."""
    probs = np.cumprod([acc.p(k) for k in range(1, steps + 1)])
    return 1.0 + float(probs.sum())


def tree_tokens_per_cycle(acc: Acceptance, steps: int, topk: int, num_draft_tokens: int) -> float:
    """Expected tokens per cycle of SGLang's EAGLE-2 dynamic tree.

    Assumptions: a node's path probability is the product of q along its path, and the
    drafter's scores rank nodes as those path probabilities do. As SGLang does, each depth
    keeps the topk best nodes and expands each by topk children; the num_draft_tokens - 1
    best candidates overall are verified. Siblings exclude each other, so a node is accepted
    iff its whole path is, and the expected length is 1 + the kept path probabilities.
    """
    return 1.0 + math.fsum(w for w, _ in _tree_kept(acc, steps, topk, num_draft_tokens))


@functools.lru_cache(maxsize=65536)  # tune prices each prompt's tree at every batch size
def _tree_kept(acc: Acceptance, steps: int, topk: int, num_draft_tokens: int
               ) -> tuple[tuple[float, int], ...]:
    """The verified nodes of `tree_tokens_per_cycle`: (path probability, depth) each."""
    return _tree_ranked(acc, steps, topk)[: max(num_draft_tokens - 1, 0)]


@functools.lru_cache(maxsize=16384)  # one a (prompt, steps, topk), for every draft budget
def _tree_ranked(acc: Acceptance, steps: int, topk: int) -> tuple[tuple[float, int], ...]:
    """Every candidate node of the tree, most probable first (ties: the earlier drafted), so a
    budget's verified nodes are its first ones: heapq.nlargest's order, worked out once."""
    candidates: list[tuple[float, int]] = []
    frontier = [1.0]
    for d in range(1, steps + 1):
        qs = [acc.q(d, r) for r in range(topk)]
        children = [w * q for w in frontier for q in qs]
        candidates.extend((w, d) for w in children)
        frontier = heapq.nlargest(topk, children)
    return tuple(sorted(candidates, key=operator.itemgetter(0), reverse=True))


def tokens_per_cycle(acc: Acceptance, setting: SpecSetting) -> float:
    if setting.is_baseline:
        return 1.0
    if setting.topk == 1:
        return chain_tokens_per_cycle(acc, setting.steps)
    return tree_tokens_per_cycle(acc, setting.steps, setting.topk, setting.num_draft_tokens)


def tree_gain(acc: Acceptance, setting: SpecSetting) -> float:
    """A tree's tokens per cycle over its chain's in the pooled figures (1 for a chain): what a
    prompt with chain figures alone is taken to gain from a tree."""
    if setting.topk == 1 or not acc.chain:
        return 1.0
    return tokens_per_cycle(acc, setting) / tokens_per_cycle(Acceptance(chain=acc.chain), setting)


@functools.lru_cache(maxsize=65536)
def cycle_tail(acc: Acceptance, setting: SpecSetting) -> tuple[float, ...]:
    """tail[j] = P(a cycle makes more than j tokens), j = 0..steps: 1, then the chance that
    draft j was accepted (a tree: that its accepted node reached depth j). Sums to
    `tokens_per_cycle`."""
    if setting.is_baseline:
        return (1.0,)
    if setting.topk == 1:
        deep = np.cumprod([acc.p(k) for k in range(1, setting.steps + 1)]).tolist()
    else:
        deep = [0.0] * setting.steps
        for w, d in _tree_kept(acc, setting.steps, setting.topk, setting.num_draft_tokens):
            deep[d - 1] += w
    return (1.0, *(min(1.0, x) for x in deep))


def expected_cycles(tail: Sequence[float], tokens: int) -> float:
    """Expected cycles until a row has made `tokens` tokens, each cycle making j + 1 tokens
    with chance tail[j] - tail[j + 1], independently; the last cycle's surplus is dropped, so
    this is more than tokens / (tokens per cycle) (a 4-token cycle still takes a whole cycle
    for one token). Solved exactly up to 16 cycles' most tokens, then the renewal slope."""
    if tokens <= 0:
        return 0.0
    pmf = [a - b for a, b in zip(tail, [*tail[1:], 0.0], strict=True)]  # pmf[x-1]: x tokens
    upto = min(tokens, 16 * len(tail))
    f = [0.0] * (upto + 1)
    for m in range(1, upto + 1):  # fsum is exact: the products' order leaves it as it was
        k = min(m - 1, len(pmf))
        f[m] = 1.0 + math.fsum(map(operator.mul, pmf[:k], reversed(f[m - k : m])))
    return f[upto] + (tokens - upto) / math.fsum(tail)


# past this many tokens a row's cycle count is taken as normal (the renewal CLT): the exact
# distribution costs a convolution per cycle, and tune prices every setting at every batch
EXACT_TOKENS = 256


def cycle_survival(tail: Sequence[float], tokens: int) -> tuple[int, np.ndarray]:
    """The distribution of a row's cycles until it has made `tokens` tokens (cycles as in
    `expected_cycles`): (start, sv), P(more than c cycles) = 1 for c < start, sv[c - start]
    from there, 0 past its end. Exact up to EXACT_TOKENS, then normal with the renewal
    variance tokens * var / mean^3 about `expected_cycles`."""
    return cycle_survivals([tail], tokens)[0]


def cycle_survivals(tails: Sequence[Sequence[float]], tokens: int
                    ) -> list[tuple[int, np.ndarray]]:
    """`cycle_survival` of each tail, the exact ones of one length worked out side by side (a
    cold `tune --refill` ranking spent seconds on thousands of curves one cycle at a time)."""
    if tokens <= 0:
        return [(0, np.zeros(0)) for _ in tails]
    unique = list(dict.fromkeys(tuple(t) for t in tails))
    if tokens > EXACT_TOKENS:
        done = {t: _normal_survival(_cycle_pmf(t), t, tokens) for t in unique}
    else:
        done = {}
        for width in dict.fromkeys(len(t) for t in unique):
            group = [t for t in unique if len(t) == width]
            svs = _exact_survivals(_cycle_pmf(group), tokens)
            done.update((t, (0, sv)) for t, sv in zip(group, svs, strict=True))
    return [done[tuple(t)] for t in tails]


def _cycle_pmf(tail: Sequence) -> np.ndarray:
    """pmf[x]: the chance that a cycle makes x tokens (pmf[0] = 0); of each tail of a list of
    equal-length tails, one a row."""
    tail = np.asarray(tail, dtype=np.float64)
    pmf = np.zeros((*tail.shape[:-1], tail.shape[-1] + 1))
    pmf[..., 1:-1] = tail[..., :-1] - tail[..., 1:]
    pmf[..., -1] = tail[..., -1]
    return pmf


def _exact_survivals(pmfs: np.ndarray, tokens: int) -> list[np.ndarray]:
    """P(more than c cycles), c = 0, 1, ... while above 1e-12, of each row of `pmfs` (rows x
    most tokens a cycle + 1): each the chance of having made fewer than `tokens` tokens after c
    cycles. made[t] (t < tokens) after cycle c, a column a row, is the last one's convolved
    with the pmf, held from `pad`'s row `most` on; it is 0 below t = c and above c * most, so
    only the t between are worked, every row at once; spent rows are dropped now and then."""
    rows_n, most = pmfs.shape[0], pmfs.shape[1] - 1
    rev = np.ascontiguousarray(pmfs[:, :0:-1].T)  # rev[m] = pmf[most - m], a column a row
    pad = np.zeros((most + tokens, rows_n))
    pad[most] = 1.0  # made[0]: no token yet
    sv = np.zeros((tokens, rows_n))
    sv[0] = 1.0
    end, rows, live = np.full(rows_n, tokens), np.arange(rows_n), np.ones(rows_n, dtype=bool)
    for c in range(1, tokens):
        hi = min(tokens, c * most + 1)
        step, across = pad.strides  # windows[t - c, row, m] = pad[t + m, row], read only
        windows = as_strided(pad[c:], (hi - c, pad.shape[1], most), (step, across, step),
                             writeable=False)
        made = np.einsum("tkm,mk->tk", windows, rev)  # made[t], t = c .. hi - 1
        pad[most + c - 1] = 0.0
        pad[most + c : most + hi] = made
        left = made.sum(0)
        sv[c, rows] = left
        spent = live & (left <= 1e-12)
        if spent.any():
            end[rows[spent]] = c
            live &= ~spent
            if not live.any():
                break
            if 4 * live.sum() < 3 * live.size:  # a quarter spent: drop them
                rows, pad, rev, live = rows[live], pad[:, live], rev[:, live], live[live]
    np.minimum(sv, 1.0, out=sv)
    return [sv[: end[r], r].copy() for r in range(rows_n)]


def _normal_survival(pmf: np.ndarray, tail: Sequence[float], tokens: int
                     ) -> tuple[int, np.ndarray]:
    xs = np.arange(len(pmf))
    mean = float(pmf @ xs)
    var = max(float(pmf @ xs**2) - mean**2, 0.0)
    mid, sd = expected_cycles(tail, tokens), math.sqrt(tokens * var / mean**3)
    lo = max(0, math.floor(mid - 9 * sd) - 1)
    hi = min(tokens, math.ceil(mid + 9 * sd) + 1)
    c = np.arange(lo, hi + 1)
    z = (c + 0.5 - mid) / (max(sd, 1e-9) * math.sqrt(2.0))
    return lo, 0.5 * np.vectorize(math.erfc)(z)


def expected_max_cycles(rows: Sequence[tuple[int, np.ndarray]]) -> float:
    """E[max over independent rows of their cycles], each row as `cycle_survival` gives it:
    the sum over c of P(some row needs more than c cycles)."""
    start = max(s for s, _ in rows)
    end = max(s + len(sv) for s, sv in rows)
    if end <= start:
        return float(start)
    done = np.ones(end - start)  # P(every row is done within c cycles), c = start ...
    for s, sv in rows:
        part = np.zeros(end - start)
        seg = sv[start - s :]
        part[: len(seg)] = seg
        done *= 1.0 - part
    return start + math.fsum(1.0 - done)


def batch_groups(count: int, batch: int) -> list[list[int]]:
    """Indices of `count` prompts in static batches of `batch` rows, every prompt at least
    once: the last batch, or one larger than the prompts, filled round-robin from the first."""
    if count < 1 or batch < 1:
        raise CostModelError(f"batch_groups: need prompts and a batch, got {count} and {batch}")
    groups = -(-count // batch)
    return [[(g * batch + i) % count for i in range(batch)] for g in range(groups)]


@dataclass(frozen=True, slots=True)
class PromptMix:
    """Each prompt's own acceptance, for static batches: a batch runs until its slowest row is
    done, and rows that finish first idle in their slots (no refill). A row needs
    new_tokens / (its tokens per cycle) cycles, so a batch emits, per slot and cycle, its
    slowest row's tokens per cycle (H200 tune run 4: idle rows took 42 % of the batch-8
    sweep's row slots at chain 6); with a token count (`fixed_length`), the batch runs the
    expected largest of its rows' cycle counts."""

    prompts: tuple[Acceptance, ...]
    # each prompt's own tree counts (reached, accepted) by depth and rank, as measured, where
    # its tree came from them (`prompt_tree`): kept for the report, to refit the prior
    tree_counts: tuple = field(default=(), hash=False)
    # rows draw their tokens independently even for one prompt (sampled decoding): a prompt
    # repeated in a batch then counts once per copy in the batch's longest row
    sampled: bool = False

    def __post_init__(self) -> None:
        if not self.prompts:
            raise CostModelError("prompt mix: no prompt has a measured acceptance")
        if self.tree_counts and len(self.tree_counts) != len(self.prompts):
            raise CostModelError(f"prompt mix: {len(self.tree_counts)} prompts' tree counts for "
                                 f"{len(self.prompts)} prompts")

    def slot_tokens(self, setting: SpecSetting, batch: int) -> float:
        """Tokens per row slot per cycle over the sweep's batches (`batch_groups`): how many
        batches there are over how many cycles they take, in units of new_tokens."""
        if setting.is_baseline:
            return 1.0
        per = [tokens_per_cycle(a, setting) for a in self.prompts]
        groups = batch_groups(len(per), batch)
        return len(groups) / math.fsum(1.0 / min(per[i] for i in g) for g in groups)

    def row_tokens(self, setting: SpecSetting, batch: int, new_tokens: int | None = None,
                   pooled: Acceptance | None = None) -> float:
        """Tokens per row-cycle over the sweep's batches (what the engine's mean accept length
        measures): each row's tokens per cycle weighed by its cycles, `fixed_length`'s with
        `new_tokens`, else each row's tokens over its pace. Not the pooled figures', which weigh
        each prompt by its cycles at the measured depth: a shallower setting was priced up to
        9 % low against the same rows' own cycles, tilting the choice deeper. A prompt without
        tree figures takes the `pooled` tree's gain over its chain (`tree_gain`)."""
        if setting.is_baseline:
            return 1.0
        gain = 1.0 if pooled is None else tree_gain(pooled, setting)
        per = [_row_tpc(a, setting) * (1.0 if a.tree else gain) for a in self.prompts]
        rows = [i for g in batch_groups(len(per), batch) for i in g]
        if new_tokens is not None and new_tokens > 1:
            cycles = [_row_cycles(self.prompts[i], setting, new_tokens - 1) for i in rows]
        else:
            cycles = [1.0 / per[i] for i in rows]
        return math.fsum(c * per[i] for c, i in zip(cycles, rows, strict=True)) / math.fsum(cycles)

    def busy(self, setting: SpecSetting, batch: int, new_tokens: int | None = None) -> float:
        """The share of row slots that decode over the sweep's batches: `fixed_length`'s with
        `new_tokens`; without, its limit for long answers (a row's cycles its tokens over its
        tokens per cycle), each batch's rows weighed as it holds them (a prompt in two
        batches counts twice, as it decodes twice)."""
        if new_tokens is not None:
            return self.fixed_length(setting, batch, new_tokens)[0]
        if setting.is_baseline:
            return 1.0
        pace = [1.0 / tokens_per_cycle(a, setting) for a in self.prompts]
        groups = batch_groups(len(pace), batch)
        decoded = math.fsum(pace[i] for g in groups for i in g)
        return min(1.0, decoded / (batch * math.fsum(max(pace[i] for i in g) for g in groups)))

    def fixed_length(self, setting: SpecSetting, batch: int, new_tokens: int
                     ) -> tuple[float, float]:
        """(busy, kept) of the sweep's batches where every row makes `new_tokens` tokens, its
        first by the prefill: busy, the share of row slots decoding (a batch runs until its
        slowest row's actual end: `_batch_cycles`); kept, the share of the accepted tokens kept
        (a row's last cycle accepts past --max-new-tokens: at 2 new tokens a cycle keeps one)."""
        if setting.is_baseline:
            return 1.0, 1.0
        cycles = [_row_cycles(a, setting, new_tokens - 1) for a in self.prompts]
        per = [_row_tpc(a, setting) for a in self.prompts]
        groups = batch_groups(len(cycles), batch)
        if batch > 1:
            fill_survival(((a, setting) for a in self.prompts), new_tokens - 1)
        slots = batch * math.fsum(self._batch_cycles(g, cycles, setting, new_tokens - 1)
                                  for g in groups)
        decoded = math.fsum(cycles[i] for g in groups for i in g)
        accepted = math.fsum(cycles[i] * per[i] for g in groups for i in g)
        if not decoded:
            return 1.0, 1.0
        return decoded / slots, min(1.0, (new_tokens - 1) * batch * len(groups) / accepted)

    def _batch_cycles(self, group: list[int], cycles: list[float], setting: SpecSetting,
                      tokens: int) -> float:
        """A batch's expected cycles: its rows' largest cycle count, E[max], not the largest
        E (a batch runs to its slowest row's actual end). A prompt repeated in one batch
        decodes alike under greedy decoding, so counts once; sampled, each copy draws its own."""
        rows = group if self.sampled else list(dict.fromkeys(group))
        longest = max(cycles[i] for i in rows)
        if len(rows) == 1:
            return longest
        dists = [row_survival(self.prompts[i], setting, tokens) for i in rows]
        return max(longest, expected_max_cycles(dists))


class _RowSurvival:
    """`cycle_survival` of a prompt at a setting, kept per (prompt, setting, tokens) across
    batch sizes; `fill` works out many pairs side by side (`cycle_survivals`)."""

    MAXSIZE = 65536  # as many (prompt, setting) pairs as the other caches keep

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[int, np.ndarray]] = {}

    def __call__(self, acc: Acceptance, setting: SpecSetting, tokens: int
                 ) -> tuple[int, np.ndarray]:
        key = (acc, setting, tokens)
        if key not in self._kept:
            self.fill([(acc, setting)], tokens)
        return self._kept[key]

    def fill(self, pairs: Iterable[tuple[Acceptance, SpecSetting]], tokens: int) -> None:
        keys = [k for k in dict.fromkeys((a, s, tokens) for a, s in pairs) if k not in self._kept]
        if not keys:
            return
        if len(self._kept) + len(keys) > self.MAXSIZE:
            self._kept.clear()
        found = cycle_survivals([cycle_tail(a, s) for a, s, _ in keys], tokens)
        self._kept.update(zip(keys, found, strict=True))

    def cache_clear(self) -> None:
        self._kept.clear()


row_survival = _RowSurvival()
fill_survival = row_survival.fill  # kept apart: a test may stand a plain function in for it


@functools.lru_cache(maxsize=65536)
def _row_tpc(acc: Acceptance, setting: SpecSetting) -> float:
    return tokens_per_cycle(acc, setting)


@functools.lru_cache(maxsize=65536)
def _row_cycles(acc: Acceptance, setting: SpecSetting, tokens: int) -> float:
    return expected_cycles(cycle_tail(acc, setting), tokens)


def leviathan_tokens_per_cycle(alpha: float, gamma: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha), Leviathan et al.; gamma + 1 when alpha is 1."""
    return gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Speedup over plain decoding with draft/target step cost ratio c."""
    return leviathan_tokens_per_cycle(alpha, gamma) / (gamma * c + 1.0)


# ---------------------------------------------------------------------------------- costs


def _interp(points: Mapping[int, float], x: float) -> float:
    """Linear in x between measured points; linear from the two end points beyond them."""
    xs = sorted(points)
    ys = [points[k] for k in xs]
    if len(xs) == 1:
        return ys[0]
    if x < xs[0]:
        i = 0
    elif x > xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (x - xs[i]))


def _at_batch(values: Mapping[int, float], batch: int, what: str) -> float:
    """Interpolate between measured batch sizes; refuse to guess outside them."""
    if batch in values:
        return values[batch]
    lo, hi = min(values), max(values)
    if not lo < batch < hi:
        raise CostModelError(f"{what}: batch {batch} is outside the measured {sorted(values)}")
    return _interp(values, batch)


def _table(data: Mapping, what: str) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for b, row in data.items():
        out[int(b)] = {int(x): float(ms) for x, ms in row.items()}
        if int(b) < 1 or not out[int(b)] or any(ms < 0 for ms in out[int(b)].values()):
            raise CostModelError(f"{what}: batch {b} needs non-negative ms, got {dict(row)}")
    return out


def _row(data: Mapping, what: str) -> dict[int, float]:
    out = {int(b): float(ms) for b, ms in data.items()}
    if any(b < 1 or ms < 0 for b, ms in out.items()):
        raise CostModelError(f"{what}: needs batch >= 1 and non-negative ms, got {out}")
    return out


@dataclass(frozen=True, slots=True)
class CostTable:
    """Measured milliseconds per cycle, keyed by batch size.

    verify: batch -> {tokens verified per request: ms}; draft_step: batch -> {topk: ms per
    step}; draft_first: batch -> {topk: ms of the first step} (the root's children, from the
    extend's output: cheaper than a step; without it every step costs draft_step); extend:
    batch -> {tokens re-extended (a setting's steps + 1, tree or chain): ms}; overhead: batch
    -> ms of bookkeeping per cycle; decode: batch -> ms of one plain decode step (defaults to
    verify of 1 token); refill, spec_refill: rows -> ms of one refill's prompt passes into that
    many freed rows, the baseline's (target) and the speculative engine's (target and drafter),
    for refilled rows (`refill_model`). Values between measured points are interpolated.
    """

    verify: Mapping[int, Mapping[int, float]]
    draft_step: Mapping[int, Mapping[int, float]]
    extend: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    overhead: Mapping[int, float] = field(default_factory=dict)
    decode: Mapping[int, float] = field(default_factory=dict)
    draft_first: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    refill: Mapping[int, float] = field(default_factory=dict)
    spec_refill: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("verify", "draft_step", "extend", "draft_first"):
            object.__setattr__(self, name, _table(getattr(self, name), name))
        for name in ("overhead", "decode", "refill", "spec_refill"):
            object.__setattr__(self, name, _row(getattr(self, name), name))
        if not self.verify or not self.draft_step:
            raise CostModelError("cost table: verify and draft_step need at least one batch")

    def _lookup(
        self, table: Mapping[int, Mapping[int, float]], batch: int, x: int, what: str
    ) -> float:
        return _at_batch({b: _interp(row, x) for b, row in table.items()}, batch, what)

    def verify_ms(self, batch: int, n_tokens: int) -> float:
        return self._lookup(self.verify, batch, n_tokens, "verify")

    def draft_step_ms(self, batch: int, topk: int) -> float:
        return self._lookup(self.draft_step, batch, topk, "draft_step")

    def draft_ms(self, batch: int, topk: int, steps: int) -> float:
        """The draft phase of `steps` steps: the first step, then steps - 1 more."""
        step = self.draft_step_ms(batch, topk)
        if not self.draft_first:
            return steps * step
        return self._lookup(self.draft_first, batch, topk, "draft_first") + (steps - 1) * step

    def extend_ms(self, batch: int, n_tokens: int) -> float:
        return self._lookup(self.extend, batch, n_tokens, "extend") if self.extend else 0.0

    def overhead_ms(self, batch: int) -> float:
        return _at_batch(self.overhead, batch, "overhead") if self.overhead else 0.0

    def decode_ms(self, batch: int) -> float:
        if self.decode:
            return _at_batch(self.decode, batch, "decode")
        return self.verify_ms(batch, 1)

    def refill_ms(self, rows: int, speculative: bool) -> float:
        """One refill's prompt passes into `rows` freed rows. A pass pads its rows to a power
        of two (`engine.refill.padded_rows`), so it costs what the least measured row count at
        or above `rows` does; more rows than the largest measured count (the prefill runtime's
        rows, `PREFILL_ROWS`, where the batch is larger) go in passes of that count."""
        name = "spec_refill" if speculative else "refill"
        table = getattr(self, name)
        if not table:
            raise CostModelError(f"{name}: not measured (`tune --refill` measures it)")
        most = max(table)
        full, rest = divmod(rows, most)
        return full * table[most] + (table[min(k for k in table if k >= rest)] if rest else 0.0)

    def covers(self, setting: SpecSetting) -> bool:
        """Whether the setting's verify width and topk lie within the measured points."""
        if setting.is_baseline:
            return bool(self.decode) or any(1 in row for row in self.verify.values())
        widths = [n for row in self.verify.values() for n in row]
        topks = [k for row in self.draft_step.values() for k in row]
        return min(widths) <= setting.num_draft_tokens <= max(widths) and min(
            topks
        ) <= setting.topk <= max(topks)

    def to_dict(self) -> dict[str, dict]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping]) -> CostTable:
        """From to_dict() output, also after a JSON round trip (string keys)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__slots__})


# ----------------------------------------------------------------------------- prediction


@dataclass(frozen=True, slots=True)
class Prediction:
    setting: SpecSetting
    batch: int
    tokens_per_cycle: float
    cycle_ms: float
    tokens_per_s: float
    phases: Mapping[str, float]
    extrapolated: bool = False
    busy: float = 1.0  # the share of row slots that decode (below 1: rows idle in their batch)
    # the share of accepted tokens kept (a row's last cycle may accept past its new tokens);
    # None where not modelled (no new-token count, or refilled rows: their own schedule)
    kept: float | None = None


def predict_phases(costs: CostTable, setting: SpecSetting, batch: int) -> dict[str, float]:
    if setting.is_baseline:
        return {"decode": costs.decode_ms(batch)}
    n = setting.num_draft_tokens
    return {
        "draft": costs.draft_ms(batch, setting.topk, setting.steps),
        "verify": costs.verify_ms(batch, n),
        "extend": costs.extend_ms(batch, setting.steps + 1),  # the accepted path, any shape
        "accept": costs.overhead_ms(batch),  # the profiler's name for the bookkeeping phase
    }


def predict(
    costs: CostTable, acc: Acceptance, setting: SpecSetting, batch: int,
    mix: PromptMix | None = None, refill: Refill | None = None, new_tokens: int | None = None,
) -> Prediction:
    """Tokens/s of one setting: batch x tokens per cycle (with a mix, its rows' own:
    `PromptMix.row_tokens`) x the share of rows busy x the share of accepted tokens kept x
    cycles per second. Without a prompt mix every row is taken to
    decode until the end; with one, rows done before their batch idle (`PromptMix.busy`); with
    `refill` too, ended rows take the next prompt (`refill_model.Refill.predict`). With
    `new_tokens` (each row's, the prefill's first included) a row's cycles are counted whole
    (`PromptMix.fixed_length`); without it, as many as its tokens over its tokens per cycle,
    which is too hopeful for short answers."""
    if refill is not None:
        if mix is None:
            raise CostModelError("refill: the model needs each prompt's acceptance (a mix)")
        return refill.predict(costs, acc, setting, batch, mix)
    phases = predict_phases(costs, setting, batch)
    cycle = math.fsum(phases.values())
    if cycle <= 0:
        raise CostModelError(f"{setting}, batch {batch}: predicted cycle time is {cycle} ms")
    # with a mix, the tokens per cycle of the very rows whose busy share and kept tokens these are
    tpc = tokens_per_cycle(acc, setting) if mix is None else mix.row_tokens(setting, batch,
                                                                             new_tokens, acc)
    if new_tokens is not None:
        busy, kept = (mix or PromptMix((acc,))).fixed_length(setting, batch, new_tokens)
    else:
        busy, kept = 1.0 if mix is None else mix.busy(setting, batch), None
    tps = batch * tpc * busy * (kept or 1.0) * 1000.0 / cycle
    beyond = not costs.covers(setting) or setting.steps > acc.depth
    return Prediction(setting, batch, tpc, cycle, tps, phases, beyond, busy, kept)


def _simpler_first(s: SpecSetting) -> tuple[int, int, int]:
    return (s.steps, s.topk, s.num_draft_tokens)


def candidate_grid(
    max_steps: int = MAX_STEPS,
    topks: Iterable[int] = TOPKS,
    draft_tokens: Iterable[int] = DRAFT_TOKENS,
) -> list[SpecSetting]:
    """Chains for 1..max_steps, and for topk > 1 each draft-token budget that fits the tree
    (a budget beyond the tree's capacity becomes the capacity). No baseline."""
    out: dict[SpecSetting, None] = {}
    for steps in range(1, max_steps + 1):
        for k in topks:
            if k == 1:
                out[SpecSetting(steps)] = None
                continue
            for n in draft_tokens:
                out[SpecSetting(steps, k, min(n, tree_capacity(steps, k)))] = None
    return list(out)


def tune_topks(max_topk: int) -> list[int]:
    """The tree widths tune prices and times: TOPKS up to --max-topk, and --max-topk itself
    (a 16 or a 3 was never priced: the grid stopped at the TOPKS below it, without a word)."""
    return sorted({k for k in TOPKS if k <= max_topk} | {max_topk})


def tune_budgets(max_draft: int) -> list[int]:
    """The tree budgets tune prices and times: DRAFT_TOKENS up to --max-draft-tokens, and that
    limit itself."""
    return sorted({n for n in DRAFT_TOKENS if n <= max_draft} | {max_draft})


def tune_grid(max_steps: int, max_topk: int, max_draft: int) -> list[SpecSetting]:
    """`candidate_grid` within tune's limits, each limit itself among the widths and budgets."""
    return candidate_grid(max_steps, tune_topks(max_topk), tune_budgets(max_draft))


def rank_settings(
    costs: CostTable,
    acc: Acceptance,
    batch: int,
    candidates: Iterable[SpecSetting] | None = None,
    mix: PromptMix | None = None,
    refill: Refill | None = None,
    new_tokens: int | None = None,
) -> list[Prediction]:
    """Predictions for the candidates and the baseline, fastest first (ties: simplest)."""
    settings = dict.fromkeys([SpecSetting.baseline(), *(candidates or candidate_grid())])
    tokens = (refill.new_tokens if refill is not None else new_tokens or 0) - 1
    if mix is not None and tokens > 0 and (refill is not None or batch > 1):
        # every row's cycle distribution at every setting in one go, not a curve at a time
        fill_survival(((a, s) for s in settings if not s.is_baseline for a in mix.prompts),
                      tokens)
    preds = [predict(costs, acc, s, batch, mix, refill, new_tokens) for s in settings]
    return sorted(preds, key=lambda p: (-p.tokens_per_s, *_simpler_first(p.setting)))


def _neighbours(s: SpecSetting, topks: Sequence[int] = TOPKS,
                budgets: Sequence[int] = DRAFT_TOKENS) -> list[SpecSetting]:
    """steps +-1, the adjacent widths among `topks` and the other `budgets`: the grid's own
    (`tune_topks`, `tune_budgets`), so a best width or budget off the defaults has neighbours."""
    out = []
    for steps in (s.steps - 1, s.steps + 1):
        if 1 <= steps <= DEEPEST:  # tune's --max-steps bounds the plan (`cli.within`)
            n = steps + 1 if s.topk == 1 else min(s.num_draft_tokens, tree_capacity(steps, s.topk))
            out.append(SpecSetting(steps, s.topk, n))
    widths = sorted({*topks, s.topk})
    i = widths.index(s.topk)
    for k in widths[max(i - 1, 0) : i + 2]:
        # a tree at least as wide as its topk: one draft node would be the 1-step chain again
        n = s.steps + 1 if k == 1 else min(max(s.num_draft_tokens, k + 1),
                                           tree_capacity(s.steps, k))
        out.append(SpecSetting(s.steps, k, n))
    if s.topk > 1:
        for n in budgets:
            if n != s.num_draft_tokens and 2 <= n <= tree_capacity(s.steps, s.topk):
                out.append(SpecSetting(s.steps, s.topk, n))
    return out


def sweep_plan(ranked: Sequence[Prediction], top: int = 3, topks: Sequence[int] = TOPKS,
               budgets: Sequence[int] = DRAFT_TOKENS) -> list[SpecSetting]:
    """What to run on the real engine: the baseline, the top predicted speculative settings,
    and their neighbours (steps +-1, the adjacent topk, the other draft-token budgets)."""
    best = [p.setting for p in ranked if not p.setting.is_baseline][:top]
    plan = dict.fromkeys([SpecSetting.baseline(), *best])
    for s in best:
        plan.update(dict.fromkeys(_neighbours(s, topks, budgets)))
    return list(plan)


# ------------------------------------------------------------------------- recommendation


@dataclass(frozen=True, slots=True)
class Measurement:
    """The real engine's figures for one setting: accept_length counts the bonus token
    (tokens per cycle per decoding row); phases are ms per cycle (the profiler's names);
    cycle_ms the wall time per cycle; busy the share of row slots that decoded."""

    setting: SpecSetting
    batch: int
    tokens_per_s: float
    accept_length: float | None = None
    phases: Mapping[str, float] | None = None
    cycle_ms: float | None = None
    busy: float | None = None


@dataclass(frozen=True, slots=True)
class Comparison:
    """Predicted and measured tokens/s of one setting side by side."""

    setting: SpecSetting
    predicted_tps: float | None
    measured_tps: float | None
    # predicted past what was measured (deeper than the acceptance or the costs reach)
    extrapolated: bool = False

    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured, in percent: positive means the model was hopeful."""
        if self.predicted_tps is None or not self.measured_tps:
            return None
        return 100.0 * (self.predicted_tps - self.measured_tps) / self.measured_tps


@dataclass(frozen=True, slots=True)
class Recommendation:
    batch: int
    setting: SpecSetting
    source: str  # "measured" or "predicted": which figure chose it
    tokens_per_s: float
    baseline_tps: float | None
    error_pct: float | None  # of the model, for the chosen setting
    cause: str  # the largest cause of disagreement between model and measurement
    rows: tuple[Comparison, ...]  # measured settings fastest first, then predicted-only
    busy: float | None = None  # the choice's share of row slots decoding, measured if it was
    predicted_best: SpecSetting | None = None  # the model's pick: the fastest predicted
    predicted_best_measured_tps: float | None = None  # that pick's sweep figure

    @property
    def speculate(self) -> bool:
        return not self.setting.is_baseline

    @property
    def regret_tps(self) -> float | None:
        """Tokens/s lost had the model's pick been taken instead of the measured best (0 where
        they agree); None where the choice or the pick was not measured."""
        if self.source != "measured" or self.predicted_best_measured_tps is None:
            return None
        return self.tokens_per_s - self.predicted_best_measured_tps

    @property
    def regret_pct(self) -> float | None:
        """`regret_tps` as a share of the measured best, in percent."""
        regret = self.regret_tps
        return None if regret is None or not self.tokens_per_s else (
            100.0 * regret / self.tokens_per_s)

    @property
    def speedup(self) -> float | None:
        return self.tokens_per_s / self.baseline_tps if self.baseline_tps else None

    @property
    def mean_abs_error_pct(self) -> float | None:
        """The model's mean absolute error over every setting that was also measured."""
        errors = [abs(e) for r in self.rows if (e := r.error_pct) is not None]
        return sum(errors) / len(errors) if errors else None


def _accept_length(meas: Measurement) -> float | None:
    return 1.0 if meas.setting.is_baseline else meas.accept_length


def _measured_phases(meas: Measurement) -> dict[str, float] | None:
    """The profiled phases, plus "unprofiled": the wall time per cycle that no phase accounts
    for."""
    if not meas.phases:
        return None
    phases = dict(meas.phases)
    wall = _wall_cycle_ms(meas)
    if wall is not None:
        phases["unprofiled"] = wall - math.fsum(phases.values())
    return phases


def _wall_cycle_ms(meas: Measurement) -> float | None:
    """The engine's own cycle time, else the one tokens/s implies (batch x accept length x
    busy share tokens a cycle)."""
    if meas.cycle_ms is not None:
        return meas.cycle_ms
    accept = _accept_length(meas)
    if accept and meas.tokens_per_s > 0:
        return meas.batch * accept * (meas.busy or 1.0) * 1000.0 / meas.tokens_per_s
    return None


def _measured_kept(meas: Measurement) -> float | None:
    """The share of accepted tokens the measured rows kept, where the engine gave its cycle
    time, accept length and busy share: what of tokens/s they leave unexplained."""
    accept = _accept_length(meas)
    if meas.cycle_ms is None or not accept or not meas.busy or meas.tokens_per_s <= 0:
        return None
    return meas.tokens_per_s * meas.cycle_ms / (1000.0 * meas.batch * accept * meas.busy)


def _measured_cycle_ms(meas: Measurement) -> float | None:
    wall = _wall_cycle_ms(meas)
    if wall is not None:
        return wall
    return math.fsum(meas.phases.values()) if meas.phases else None


def _phase_cause(predicted: Mapping[str, float], measured: Mapping[str, float]) -> str:
    names = dict.fromkeys([*predicted, *measured])
    name = max(names, key=lambda n: abs(measured.get(n, 0.0) - predicted.get(n, 0.0)))
    got = measured.get(name, 0.0)
    if name == "unprofiled":
        return f"unprofiled: {got:+.2f} ms per cycle that no profiled phase accounts for"
    if name not in predicted:
        return f"{name}: not in the model, measured {got:.2f} ms per cycle"
    want = predicted[name]
    return (
        f"{name}: predicted {want:.2f} ms, measured {got:.2f} ms ({got - want:+.2f} ms per cycle)"
    )


def disagreement_cause(pred: Prediction, meas: Measurement) -> str:
    """Name what moved the measurement furthest from the model: acceptance (tokens per
    cycle), idle rows (the share of row slots that decoded) or time per cycle, and for time
    the phase with the largest absolute difference (time outside every profiled phase counts
    as the phase "unprofiled"), or the accepted tokens past a row's end. Tokens/s is batch x
    tokens per cycle x busy share x kept share / cycle, so the four log errors add up to the
    model's."""
    accept, cycle = _accept_length(meas), _measured_cycle_ms(meas)
    acc_err = abs(math.log(pred.tokens_per_cycle / accept)) if accept else 0.0
    idle_err = abs(math.log(pred.busy / meas.busy)) if meas.busy else 0.0
    time_err = abs(math.log(cycle / pred.cycle_ms)) if cycle else 0.0
    kept = _measured_kept(meas) if pred.kept else None
    kept_err = abs(math.log(pred.kept / kept)) if pred.kept and kept else 0.0
    if accept and acc_err >= max(time_err, idle_err, kept_err) and acc_err > 0:
        return (
            f"acceptance: predicted {pred.tokens_per_cycle:.2f} tokens per cycle, "
            f"measured {accept:.2f}"
        )
    if kept and kept_err > max(time_err, idle_err):
        return (
            f"tokens past a row's end: predicted {pred.kept:.0%} of accepted tokens kept, "
            f"measured {kept:.0%} (a row's last cycle may accept more than it has left)"
        )
    if idle_err > time_err:
        return (
            f"idle rows: predicted {pred.busy:.0%} of row slots decoding, measured "
            f"{meas.busy:.0%} (a row idles from its end to its batch's end, or to its refill)"
        )
    phases = _measured_phases(meas)
    if phases:
        return _phase_cause(pred.phases, phases)
    if cycle:
        return f"cycle time: predicted {pred.cycle_ms:.2f} ms, measured {cycle:.2f} ms"
    return "unknown: no accept length or phase times were measured"


def _choose(
    preds: Mapping[SpecSetting, Prediction], meas: Mapping[SpecSetting, Measurement]
) -> tuple[SpecSetting, str, float]:
    """The best measured setting when anything was measured (the baseline falls back to
    its prediction if it was not run), else the best predicted one. Ties: the simplest."""
    pool = {s: (m.tokens_per_s, "measured") for s, m in meas.items()}
    base = SpecSetting.baseline()
    if not pool:
        pool = {s: (p.tokens_per_s, "predicted") for s, p in preds.items()}
    elif base not in pool and base in preds:
        pool[base] = (preds[base].tokens_per_s, "predicted")
    best = min(pool, key=lambda s: (-pool[s][0], *_simpler_first(s)))
    return best, pool[best][1], pool[best][0]


def _row_order(row: Comparison) -> tuple[bool, float]:
    """Measured rows first, fastest first; then the predicted-only ones."""
    if row.measured_tps is not None:
        return (False, -row.measured_tps)
    return (True, -(row.predicted_tps or 0.0))


def _recommend_batch(
    batch: int, preds: Mapping[SpecSetting, Prediction], meas: Mapping[SpecSetting, Measurement]
) -> Recommendation:
    setting, source, tps = _choose(preds, meas)
    rows = []
    for s in dict.fromkeys([*meas, *preds]):
        p, m = preds.get(s), meas.get(s)
        rows.append(Comparison(s, p and p.tokens_per_s, m and m.tokens_per_s,
                               bool(p and p.extrapolated)))
    rows.sort(key=_row_order)
    p, m = preds.get(setting), meas.get(setting)
    chosen = Comparison(setting, p and p.tokens_per_s, m and m.tokens_per_s,
                        bool(p and p.extrapolated))
    if p and m:
        cause = disagreement_cause(p, m)
    else:
        cause = "not measured" if m is None else "not predicted"
    base = meas.get(SpecSetting.baseline()) or preds.get(SpecSetting.baseline())
    base_tps = base.tokens_per_s if base else None
    busy = m.busy if m and m.busy is not None else (p.busy if p else None)
    pick = min(preds, key=lambda s: (-preds[s].tokens_per_s, *_simpler_first(s)), default=None)
    picked = meas.get(pick) if pick is not None else None
    return Recommendation(
        batch, setting, source, tps, base_tps, chosen.error_pct, cause, tuple(rows), busy,
        pick, picked.tokens_per_s if picked else None,
    )


def recommend(
    predicted: Iterable[Prediction], measured: Iterable[Measurement] = ()
) -> list[Recommendation]:
    """One recommendation per batch size (sorted by batch): the best measured setting,
    "no speculation" (the baseline) where that wins, and how far the model was off."""
    preds: dict[int, dict[SpecSetting, Prediction]] = {}
    meas: dict[int, dict[SpecSetting, Measurement]] = {}
    for p in predicted:
        preds.setdefault(p.batch, {})[p.setting] = p
    for m in measured:
        meas.setdefault(m.batch, {})[m.setting] = m
    batches = sorted({*preds, *meas})
    return [_recommend_batch(b, preds.get(b, {}), meas.get(b, {})) for b in batches]


def steps_series(
    predicted: Iterable[Prediction], measured: Iterable[Measurement], batch: int,
    topk: int | None = 1, failed: Collection[SpecSetting] = (),
) -> dict[str, list[tuple[int, float]]]:
    """Tokens/s against steps for one batch and topk (best over draft-token budgets; topk None:
    best over every tree, topk > 1), with the baseline at steps 0: the data behind the tune
    PNG. Settings in `failed` (this batch's, that the sweep could not run) stay off the
    predicted curve, which compares with what ran, and come apart as `failed` points at their
    predicted tok/s."""
    series: dict[str, dict[int, float]] = {"predicted": {}, "measured": {}, "failed": {}}
    rows = [("predicted", p) for p in predicted] + [("measured", m) for m in measured]
    for name, r in rows:
        s = r.setting
        if r.batch == batch and (s.is_baseline or (s.topk > 1 if topk is None
                                                   else s.topk == topk)):
            if name == "predicted" and s in failed:
                name = "failed"
            best = series[name].get(s.steps, 0.0)
            series[name][s.steps] = max(best, r.tokens_per_s)
    return {name: sorted(points.items()) for name, points in series.items()}
