"""tune's ranking, made fast: the same predictions as the plain computations (each prompt's
cycle distribution by np.convolve a cycle, tree nodes priced afresh each call), bit for bit but
for the cycle distributions, worked out side by side since review 12 (the same to 1e-12), with
each prompt's tree priced once however many batch sizes rank it."""

from __future__ import annotations

import heapq
import math
import random

import numpy as np
import pytest

from draftsmith.tune import cost_model as cm
from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    PromptMix,
    SpecSetting,
    prompt_tree,
    rank_settings,
    tune_grid,
)


def _clear() -> None:
    for f in (cm._tree_kept, cm._tree_ranked, cm.cycle_tail, cm.row_survival, cm._row_cycles,
              cm._row_tpc):
        f.cache_clear()


def fixture(n: int, steps: int = 5, topk: int = 4, seed: int = 7):
    """n prompts' own trees (rank counts drawn at random, drawn towards pooled ones) and costs
    at batches 1, 4 and 16."""
    rng = random.Random(seed)
    chain = tuple(0.85 - 0.06 * k for k in range(steps))
    seen = [[rng.randint(50, 200) for _ in range(topk)] for _ in range(steps)]
    got = [[int(r * q) for r, q in zip(row, (0.6, 0.15, 0.05, 0.03), strict=False)]
           for row in seen]
    pooled = Acceptance.from_rank_counts(seen, got, chain=chain)
    own = []
    for _ in range(n):
        ch = tuple(min(1.0, max(0.0, p + rng.uniform(-0.25, 0.1))) for p in chain)
        r = [[rng.randint(0, 20) for _ in range(topk)] for _ in range(steps)]
        a = [[int(x * rng.uniform(0, 0.7 if k == 0 else 0.2)) for k, x in enumerate(row)]
             for row in r]
        own.append(prompt_tree(pooled, r, a, ch))
    batches = (1, 4, 16)
    costs = CostTable(
        verify={b: {w: 5.0 + 0.1 * b + 0.05 * w * b**0.5 for w in (1, 2, 4, 8, 16, 32)}
                for b in batches},
        draft_step={b: {k: 0.3 + 0.01 * k * b for k in (1, 2, 4)} for b in batches},
        extend={b: {2: 0.3, 8: 0.35} for b in batches}, overhead={b: 0.1 for b in batches},
        decode={b: 5.0 + 0.05 * b for b in batches})
    return costs, pooled, PromptMix(tuple(own)), batches


def ranking(new: int, n: int = 9) -> list[tuple]:
    costs, acc, mix, batches = fixture(n)
    grid = tune_grid(5, 4, 16)
    return [(str(p.setting), b, p.tokens_per_cycle, p.cycle_ms, p.tokens_per_s, p.busy, p.kept)
            for b in batches for p in rank_settings(costs, acc, b, grid, mix, None, new)]


# the computations as they were, the reference the fast ones must equal bit for bit


def plain_kept(acc, steps, topk, num_draft_tokens):
    candidates, frontier = [], [1.0]
    for d in range(1, steps + 1):
        children = [w * acc.q(d, r) for w in frontier for r in range(topk)]
        candidates.extend((w, d) for w in children)
        frontier = heapq.nlargest(topk, children)
    return heapq.nlargest(num_draft_tokens - 1, candidates, key=lambda c: c[0])


def plain_expected_cycles(tail, tokens):
    if tokens <= 0:
        return 0.0
    pmf = [a - b for a, b in zip(tail, [*tail[1:], 0.0], strict=True)]
    upto = min(tokens, 16 * len(tail))
    f = [0.0] * (upto + 1)
    for m in range(1, upto + 1):
        f[m] = 1.0 + math.fsum(pmf[x - 1] * f[m - x] for x in range(1, min(m, len(pmf) + 1)))
    return f[upto] + (tokens - upto) / math.fsum(tail)


def plain_survival(tail, tokens):
    if tokens <= 0:
        return 0, np.zeros(0)
    pmf = np.append(0.0, -np.diff(np.append(np.asarray(tail, dtype=np.float64), 0.0)))
    if tokens > cm.EXACT_TOKENS:
        return cm._normal_survival(pmf, tail, tokens)
    made = np.zeros(tokens)
    made[0], sv = 1.0, []
    while (left := made.sum()) > 1e-12:
        sv.append(left)
        made = np.convolve(made, pmf)[:tokens]
    return 0, np.minimum(np.asarray(sv), 1.0)


def plain_tail(acc, setting):
    if setting.is_baseline:
        return (1.0,)
    if setting.topk == 1:
        deep = np.cumprod([acc.p(k) for k in range(1, setting.steps + 1)]).tolist()
    else:
        deep = [0.0] * setting.steps
        for w, d in plain_kept(acc, setting.steps, setting.topk, setting.num_draft_tokens):
            deep[d - 1] += w
    return (1.0, *(min(1.0, x) for x in deep))


@pytest.fixture
def plain(monkeypatch):
    """cost_model with the plain computations in place of the fast ones, caches off."""
    def tree_tpc(acc, steps, topk, n):
        return 1.0 + math.fsum(w for w, _ in plain_kept(acc, steps, topk, n))

    monkeypatch.setattr(cm, "tree_tokens_per_cycle", tree_tpc)
    monkeypatch.setattr(cm, "cycle_tail", plain_tail)
    monkeypatch.setattr(cm, "expected_cycles", plain_expected_cycles)
    monkeypatch.setattr(cm, "cycle_survival", plain_survival)
    monkeypatch.setattr(cm, "row_survival", lambda a, s, t: plain_survival(plain_tail(a, s), t))
    monkeypatch.setattr(cm, "_row_cycles",
                        lambda a, s, t: plain_expected_cycles(plain_tail(a, s), t))
    monkeypatch.setattr(cm, "_row_tpc", cm.tokens_per_cycle)


@pytest.mark.parametrize("new", [40, 128])
def test_ranking_is_the_plain_computations(new, request):
    """Bit for bit but for the cycle distributions, now worked out many rows side by side
    (`cycle_survivals`, tests/test_tune_review12.py): the same to 1e-12."""
    _clear()
    fast = ranking(new)
    request.getfixturevalue("plain")
    plain = ranking(new)
    assert [r[:2] for r in fast] == [r[:2] for r in plain]
    assert [r[2:] for r in fast] == [pytest.approx(r[2:], rel=1e-12) for r in plain]


def test_each_piece_equals_its_plain_computation():
    _clear()
    _, _, mix, _ = fixture(6)
    grid = [SpecSetting.baseline(), *tune_grid(5, 4, 16)]
    for acc in mix.prompts:
        for s in grid:
            tail = cm.cycle_tail(acc, s)
            assert tail == plain_tail(acc, s)
            assert cm.tokens_per_cycle(acc, s) == (1.0 + math.fsum(
                w for w, _ in plain_kept(acc, s.steps, s.topk, s.num_draft_tokens))
                if s.topk > 1 and not s.is_baseline else cm.tokens_per_cycle(acc, s))
            for tokens in (1, 3, 40, 127, 300):
                assert cm.expected_cycles(tail, tokens) == plain_expected_cycles(tail, tokens)
                start, sv = cm.cycle_survival(tail, tokens)
                want_start, want = plain_survival(tail, tokens)
                assert start == want_start and len(sv) == len(want)
                np.testing.assert_allclose(sv, want, rtol=0, atol=1e-12)


def test_a_prompts_tree_is_priced_once_over_every_batch_size(monkeypatch):
    """Every batch size prices every prompt's tree at every setting (its tokens per cycle, its
    cycle tail, its cycles' distribution): each (prompt, tree) is worked out once, each depth's
    acceptance read once per rank."""
    _clear()
    costs, acc, mix, batches = fixture(10)
    grid = tune_grid(5, 4, 16)
    calls = []
    q = Acceptance.q

    def counted(self, d, r):
        calls.append(1)
        return q(self, d, r)

    monkeypatch.setattr(Acceptance, "q", counted)
    for b in batches:
        rank_settings(costs, acc, b, grid, mix, None, 64)
    # one shape (steps, topk) ranks its nodes once for every draft budget (review 12)
    shapes = {(s.steps, s.topk) for s in grid if s.topk > 1}
    per_tree = sum(steps * topk for steps, topk in shapes)
    # each prompt's, and the pooled figures' with and without their tree (`tree_gain`)
    assert len(calls) == (len(mix.prompts) + 2) * per_tree


def _nccl_report(results: list[dict]) -> dict:
    return {"tp": 2, "target_label": "random-8b", "device": "cuda", "backend": "nccl",
            "shapes": [[1, 4]], "results": results,
            "recommendation": {"per_shape": [], "overall": None, "note": "every setting failed"}}


def test_nccl_table_says_why_a_setting_failed(capsys, monkeypatch):
    """The terminal table said only "failed"; the reason was in nccl.md alone."""
    from draftsmith.tune import nccl

    monkeypatch.setenv("COLUMNS", "200")
    err = ("rank 1 died: NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details)\n"
           "  " + "x" * 300)
    report = _nccl_report([
        {"setting": "NCCL_PROTO=LL128", "status": "failed", "error": err},
        {"setting": "NCCL_ALGO=Tree", "status": "skipped", "error": "time budget spent"},
        {"setting": "NCCL_ALGO=Ring", "status": "failed"}])
    nccl.print_report(report)
    out = capsys.readouterr().out
    assert "failed: rank 1 died: NCCL error: invalid usage" in out
    assert "skipped: time budget spent" in out and "x" * 100 not in out
    assert nccl.status_text(report["results"][0]).endswith("...")
    assert len(nccl.status_text(report["results"][0])) <= len("failed: ") + 60
    assert nccl.status_text(report["results"][2]) == "failed"
    assert "| failed |" in nccl.markdown(report)  # a failure without its error: no KeyError
