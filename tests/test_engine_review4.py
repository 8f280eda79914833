"""Per-position acceptance of trees: a position counts as reached only where the verified tree
held a node there (a leaf accepted before the last depth leaves the next position untried)."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, Steered, greedy_seq, make_drafter, tiny_target

from draftsmith.engine import tree as trees
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder, commit_values
from draftsmith.engine.tree import RankCounts

NEW = 24


def test_has_child_by_hand():
    # root 0; depth 1: nodes 1, 2 (children of the root); depth 2: node 3 (child of node 1)
    parent = torch.tensor([[0, 0, 0, 1]]).expand(4, 4)
    path = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 1, 3]])
    n = torch.tensor([0, 1, 1, 2])
    assert trees.has_child(parent, path, n).tolist() == [True, True, False, False]


def _reached(n: list[int], kids: list[bool] | None, done: list[bool] | None = None) -> list[int]:
    b, steps = len(n), 3
    ar = torch.arange(steps + 1)
    out = commit_values(
        torch.zeros(b, steps + 1, dtype=torch.long), ar.expand(b, -1), torch.tensor(n),
        torch.zeros(b, dtype=torch.long), torch.tensor(done or [False] * b),
        torch.zeros(b, dtype=torch.long), torch.tensor(99), torch.tensor([-1]),
        torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long),
        torch.zeros(b, steps + 1, 1, 2), ar, 50, None if kids is None else torch.tensor(kids))
    return out[6].tolist()


def test_commit_counts_a_leafs_next_position_unreached():
    """Rows accepting 0, 1, 1, 3 drafts of 3: the second's accepted node has a child, the
    first's and third's none (a tree whose tokens ran out there). Position 1 is reached by
    rows 2-4, position 2 by rows 2 and 4, position 3 by row 4; a chain's by all as before."""
    assert _reached([0, 1, 1, 3], [False, True, False, False]) == [3, 2, 1]
    assert _reached([0, 1, 1, 3], None) == [4, 3, 1]
    assert _reached([0, 1, 1, 3], [True] * 4, [False, False, False, True]) == [3, 2, 0]


@pytest.fixture(scope="module")
def small():
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    return target, rt, greedy_seq(rt, PROMPTS, NEW + 8)


def test_small_tree_never_reaches_a_depth_it_never_drafts(small):
    """An oracle over a tree 3 deep verifying 2 drafts (its depth-1 and depth-2 best): depth 3
    is never in the tree, so it is unmeasured (None), not rejected; depths 1-2 all accepted."""
    target, rt, seq = small
    oracle = make_drafter(target, 128, Steered).steer(seq, 1.0)
    res = SpecDecoder(rt, oracle, 3, 2, 3).generate(PROMPTS, NEW, eos_ids=[])
    cycles = res.reached[0]
    assert cycles > 0 and res.reached == [cycles, cycles, 0]
    assert res.measured_position_rates == [1.0, 1.0, None]


@pytest.mark.parametrize("steered,setting", [(True, (4, 3, 5)), (False, (3, 3, 4))])
def test_position_counts_agree_with_rank_counts(small, steered, setting):
    """bench's per-position counts are tune's rank counts summed: reached at depth d where the
    tree held the accepted node's rank-0 child, accepted over every rank. A random drafter's
    3-draft tree is its root's 3 children: an accepted one is a leaf, depth 2 never tried."""
    target, rt, seq = small
    drafter = (make_drafter(target, 96, Steered).steer(seq, 0.6) if steered
               else make_drafter(target, 128))
    dec = SpecDecoder(rt, drafter, *setting)
    dec.rank_counts = counts = RankCounts(*setting[:2], dec.device)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    reached, accepted = counts.counts()
    assert res.reached == [row[0] for row in reached]
    assert res.accepted == [sum(row) for row in accepted] and res.accepted[0] > 0
    if not steered:
        assert res.reached[1:] == [0, 0] and res.measured_position_rates[1:] == [None, None]
