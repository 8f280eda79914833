"""Engine review 6: eos ids taken as a set by every decoder (repeats never count toward
MAX_EOS), RankCounts refusing a batch-size change, and tune's measurements of no cycle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import generate
from draftsmith.engine.profiler import PhaseSummary
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.spec_state import MAX_EOS, SpecResult
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import RankCounts
from draftsmith.errors import DraftsmithError
from draftsmith.tune import measure
from draftsmith.tune.cost_model import SpecSetting

PROMPTS = [[3, 4], [5, 9, 2]]
NEW = 10
EOS = 7  # the first prompt's third greedy token (the second prompt's answer never holds it)
TOO_MANY = "65 distinct eos ids given, speculative decoding takes at most 64; pass only the"


@pytest.fixture(scope="module")
def target():
    return tiny_target(64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def decoder(target):
    return SpecDecoder(target, make_drafter(target, 32), 3, 1, None, max_batch=2, max_seq=64)


def _baseline(target, eos):
    return generate(target, PROMPTS, NEW, eos_ids=eos)


def _refill(target, eos):
    return refill.generate_refill(Runtime(target, 2, 64), PROMPTS, NEW, eos_ids=eos, rows=2)


def _spec(decoder, eos):
    return decoder.generate(PROMPTS, NEW, eos).tokens


def _spec_refill(decoder, eos):
    return spec_refill.generate_refill(decoder, PROMPTS, NEW, eos, rows=2).tokens


def _run(kind, target, decoder, eos):
    if kind in ("baseline", "refill"):
        return {"baseline": _baseline, "refill": _refill}[kind](target, eos)
    return {"spec": _spec, "spec_refill": _spec_refill}[kind](decoder, eos)


KINDS = ["baseline", "refill", "spec", "spec_refill"]


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_eos_ids_decode_as_the_set(kind, target, decoder):
    """[7] * 65 was refused by the speculative decoders (65 > MAX_EOS) and overran the eos
    buffer of spec_refill's `_reset`, though the baseline took it: a repeat is one stop id."""
    once = _run(kind, target, decoder, [EOS])
    assert once[0] == generate(target, PROMPTS[:1], 2)[0]  # the eos cut the first answer
    assert _run(kind, target, decoder, [EOS] * (MAX_EOS + 1)) == once
    assert _run(kind, target, decoder, [EOS, 60, EOS] * 40) == _run(kind, target, decoder,
                                                                   [EOS, 60])


@pytest.mark.parametrize("kind", KINDS)
def test_too_many_distinct_eos_ids_refused_by_the_speculative_decoders(kind, target, decoder):
    """65 distinct ids: one message from both speculative decoders (their buffer holds 64); the
    baseline's take any number."""
    many = list(range(1000, 1000 + MAX_EOS + 1))  # past the vocabulary: none ever ends a row
    if kind in ("baseline", "refill"):
        assert _run(kind, target, decoder, many) == _run(kind, target, decoder, [])
        return
    with pytest.raises(DraftsmithError, match=TOO_MANY):
        _run(kind, target, decoder, many)


def test_spec_reset_takes_repeated_eos_ids(decoder):
    """`_reset` (the server's refilling batches call it with the target's ids as they are)
    wrote every repeat into the 64-slot buffer: a shape error past 64."""
    st = decoder._state(2)
    spec_refill._reset(st, 4, [EOS] * (MAX_EOS + 1))
    assert st.eos.tolist() == [EOS] + [-1] * (MAX_EOS - 1)


def test_rank_counts_refuse_a_batch_size_change():
    """A RankCounts counts one batch's rows; a cycle of another batch size was a bare
    ValueError, now one line saying to count each batch apart (as tune does)."""
    counts = RankCounts(2, 2, torch.device("cpu"))
    parent = torch.zeros(2, 5, dtype=torch.long)
    depth = torch.tensor([[0, 1, 1, 2, 2]] * 2)
    tree = SimpleNamespace(node_parent=parent, node_depth=depth, node_tok=depth + 3)
    n, active = torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)
    counts.add(tree, n, torch.zeros(2, 2, dtype=torch.long), active)
    one = SimpleNamespace(node_parent=parent[:1], node_depth=depth[:1], node_tok=depth[:1])
    with pytest.raises(DraftsmithError, match=r"sized for 2 rows \(their first cycle's batch\) "
                                              r"got a cycle of 1; count each batch with a "
                                              r"RankCounts of its own"):
        counts.add(one, n[:1], torch.zeros(1, 2, dtype=torch.long), active[:1])


def _result(cycles: int, phase_cycles: int) -> SpecResult:
    res = SpecResult([[1] * 4] * 2, 0.0, 0.01, cycles, 2, [0, cycles * 2, 0], [2, 2], [1, 1])
    ms = dict.fromkeys(("draft", "verify", "accept", "extend"), 0.0 if not phase_cycles else 1.0)
    res.phases = PhaseSummary(phase_cycles, ms, dict.fromkeys(ms, 25.0), sum(ms.values()))
    return res


class _Dec:
    def __init__(self, timed: SpecResult, profiled: SpecResult) -> None:
        self.timed, self.profiled, self.profile = timed, profiled, False

    def generate(self, prompts, new, eos):
        return self.profiled if self.profile else self.timed


def _engine() -> SimpleNamespace:
    cfg = SimpleNamespace(max_position_embeddings=None, sliding_window=None)
    return SimpleNamespace(rt=SimpleNamespace(model=SimpleNamespace(cfg=cfg)))


def test_a_profiled_run_of_no_cycle_is_unprofiled(monkeypatch):
    """Its phases were taken as measured 0 ms each (`dict(prof.phases.ms)`)."""
    monkeypatch.setattr(measure, "decoder", lambda eng, s: _Dec(_result(3, 3), _result(0, 0)))
    m = measure.run_setting(_engine(), SpecSetting(2, 1, 3), PROMPTS, 2, 4, [])
    assert m.phases is None and m.cycle_ms == pytest.approx(10 / 3)
    monkeypatch.setattr(measure, "decoder", lambda eng, s: _Dec(_result(3, 3), _result(3, 3)))
    assert measure.run_setting(_engine(), SpecSetting(2, 1, 3), PROMPTS, 2, 4, []).phases == {
        "draft": 1.0, "verify": 1.0, "accept": 1.0, "extend": 1.0}


def test_a_sweep_run_of_no_cycle_is_refused(monkeypatch):
    """Its cycle time (the whole decode time) and busy share (0) were figures of nothing."""
    monkeypatch.setattr(measure, "decoder", lambda eng, s: _Dec(_result(0, 0), _result(0, 0)))
    with pytest.raises(DraftsmithError, match=r"at batch 2 ran no speculative cycle in 4 new "
                                              r"tokens: every answer ended at its first token"):
        measure.run_setting(_engine(), SpecSetting(2, 1, 3), PROMPTS, 2, 4, [])


def test_a_phase_probe_of_no_cycle_is_refused(monkeypatch):
    """probe_phases read a missing draft phase as 0 ms in the draft's cost line."""
    monkeypatch.setattr(measure, "decoder", lambda eng, s: _Dec(_result(3, 3), _result(0, 0)))
    with pytest.raises(DraftsmithError, match="ran no profiled cycle in 4 new tokens"):
        measure.probe_phases(_engine(), SpecSetting(2, 1, 3), PROMPTS, 2, 4)
