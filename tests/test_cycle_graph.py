"""One graph a cycle (DRAFTSMITH_CYCLE_GRAPH): captured beside the four phase graphs and
replayed where nothing reads between phases. Captures run eagerly here (CPU): a stand-in
`Graphs` keeps each captured function and calls it again at every replay, keyed as on CUDA."""

from __future__ import annotations

import pytest
import torch
from test_speculative import (
    NEW,
    PROMPTS,
    Steered,
    make_drafter,
    setup,  # noqa: F401 (the fixture)
)

from draftsmith.engine import speculative
from draftsmith.engine.graphs import Graphs
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import RankCounts


class Replaying(Graphs):
    """Graphs whose replay calls the captured function again, counting replays by phase."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.replayed: list[str] = []

    def capture(self, key, fn, warmup=2):
        self.graphs[key] = (fn, None)
        return fn()

    def replay(self, key):
        self.replayed.append(key[-1] if isinstance(key, tuple) else key)
        return self.graphs[key][0]()


@pytest.fixture(autouse=True)
def cycle_graph_on(monkeypatch):
    monkeypatch.setattr(speculative, "CYCLE_GRAPH", True)


def decoder(target, seq, steps: int, topk: int, n: int | None, **kw) -> SpecDecoder:
    rt = Runtime(target, 4, 128)
    rt.graphs = Replaying()
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    return SpecDecoder(rt, drafter, steps, topk, n, **kw)


def phases_of(replayed: list[str]) -> set[str]:
    return {k for k in replayed if k in ("draft", "verify", "accept", "extend", "cycle")}


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (4, 4, 10)])
def test_the_cycle_graph_decodes_plain_greedy_and_replaces_the_phase_replays(setup, steps, topk,  # noqa: F811
                                                                            n):
    target, _, ref, seq = setup
    dec = decoder(target, seq, steps, topk, n)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert res.mean_accept_length > 1.5  # the steered drafter is accepted: drafts ran
    replayed = dec.graphs.replayed
    assert phases_of(replayed) == {"cycle"}
    assert replayed.count("cycle") == res.cycles
    assert all((dec.gkey, 4, p) in dec.graphs for p in ("draft", "verify", "accept", "extend",
                                                        "cycle"))


def test_a_profiled_run_replays_the_phase_graphs_and_agrees(setup):  # noqa: F811
    """The profiler marks each phase, so it runs the four graphs; the tokens are the cycle
    graph's."""
    target, _, ref, seq = setup
    dec = decoder(target, seq, 4, 4, 10, profile=True)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert phases_of(dec.graphs.replayed) == {"draft", "verify", "accept", "extend"}
    assert res.phases is not None and res.phases.cycles == res.cycles
    dec.profile = False
    dec.graphs.replayed.clear()
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert phases_of(dec.graphs.replayed) == {"cycle"}


def test_rank_counts_read_between_phases_so_they_take_the_phase_graphs(setup):  # noqa: F811
    target, _, ref, seq = setup
    dec = decoder(target, seq, 4, 4, 10)
    dec.rank_counts = counts = RankCounts(4, 4, dec.device)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert "cycle" not in dec.graphs.replayed
    assert int(counts.reached.sum()) > 0


def test_switched_off_no_cycle_graph_is_captured(setup, monkeypatch):  # noqa: F811
    target, _, ref, seq = setup
    monkeypatch.setattr(speculative, "CYCLE_GRAPH", False)
    dec = decoder(target, seq, 3, 1, None)
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert not any(k[-1] == "cycle" for k in dec.graphs.graphs if isinstance(k, tuple))
    assert phases_of(dec.graphs.replayed) == {"draft", "verify", "accept", "extend"}
