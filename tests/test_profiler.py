"""The phase profiler: nothing at all when off; every phase timed when on."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from test_speculative import PROMPTS, make_drafter, tiny_target

from draftsmith.engine import profiler
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder


@pytest.fixture(scope="module")
def decoder_parts():
    target = tiny_target()
    return Runtime(target, 4, 96), make_drafter(target, 96)


def counting_clock(monkeypatch) -> list[int]:
    calls = [0]
    real = profiler.clock

    def clock() -> float:
        calls[0] += 1
        return real()

    monkeypatch.setattr(profiler, "clock", clock)
    return calls


def test_off_creates_nothing(monkeypatch, decoder_parts):
    monkeypatch.delenv("DRAFTSMITH_PROFILE", raising=False)
    monkeypatch.delenv("DRAFTSMITH_HOST_TIMING", raising=False)
    calls = counting_clock(monkeypatch)
    assert isinstance(profiler.make_profiler("cpu"), profiler.NullProfiler)
    rt, drafter = decoder_parts
    res = SpecDecoder(rt, drafter, 3).generate(PROMPTS, 12, eos_ids=[])
    assert res.phases is None and calls[0] == 0


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_on_times_every_phase(monkeypatch, tmp_path, decoder_parts, how):
    rt, drafter = decoder_parts
    monkeypatch.delenv("DRAFTSMITH_HOST_TIMING", raising=False)
    if how == "environment":
        monkeypatch.setenv("DRAFTSMITH_PROFILE", "1")
    calls = counting_clock(monkeypatch)
    dec = SpecDecoder(rt, drafter, 3, 2, 5, profile=True if how == "argument" else None)
    res = dec.generate(PROMPTS, 12, eos_ids=[])
    ph = res.phases
    assert ph is not None and ph.cycles == res.cycles and calls[0] == 5 * res.cycles
    assert set(ph.ms) == set(profiler.PHASES) and all(v > 0 for v in ph.ms.values())
    assert abs(sum(ph.pct.values()) - 100) < 1e-6
    assert ph.accept_length == res.mean_accept_length
    out = Console(width=100, record=True)
    out.print(profiler.table(ph))
    text = out.export_text()
    assert "target verify" in text and "accept rate" in text
    saved = json.loads(profiler.write_json(ph, tmp_path / "p.json").read_text())
    assert saved["cycles"] == res.cycles and set(saved["ms"]) == set(profiler.PHASES)


def test_host_clock_splits_each_step_into_launch_and_wait(monkeypatch, decoder_parts):
    """DRAFTSMITH_HOST_TIMING=1: one launch and one wait lap per cycle (speculative) or per step
    after the first token (plain), on top of the unchanged output; off, nothing is recorded."""
    from draftsmith.engine.generate import run_generation

    rt, drafter = decoder_parts
    monkeypatch.delenv("DRAFTSMITH_HOST_TIMING", raising=False)
    dec = SpecDecoder(rt, drafter, 3, 2, 5)
    plain_off, spec_off = run_generation(rt, PROMPTS, 12), dec.generate(PROMPTS, 12, eos_ids=[])
    assert plain_off.host is None and "host" not in spec_off.extra
    monkeypatch.setenv("DRAFTSMITH_HOST_TIMING", "1")
    plain, spec = run_generation(rt, PROMPTS, 12), dec.generate(PROMPTS, 12, eos_ids=[])
    assert plain.tokens == plain_off.tokens and spec.tokens == spec_off.tokens
    # + at most one inert cycle: the late done flag is read one cycle behind
    assert plain.host["iterations"] == 11
    assert spec.cycles <= spec.extra["host"]["iterations"] <= spec.cycles + 1
    for h in (plain.host, spec.extra["host"]):
        assert h["launch_ms"] > 0 and h["wait_ms"] >= 0
        assert (h["launch_ms"] + h["wait_ms"]) * h["iterations"] <= 1e3 * (
            plain.decode_s if h is plain.host else spec.decode_s)


def test_cuda_marks_are_events(monkeypatch):
    """On CUDA a mark is a recorded event (checked without a GPU by faking the event class)."""
    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream=None) -> None:
            recorded.append(self)

        def elapsed_time(self, other) -> float:
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    p = profiler.PhaseProfiler("cuda")
    for _ in range(3):
        p.start()
        for ph in profiler.PHASES:
            p.mark(ph)
    s = p.summary()
    assert len(recorded) == 15 and s.ms == dict.fromkeys(profiler.PHASES, 2.0)
    assert s.cycle_ms == 8.0 and s.pct["verify"] == 25.0


def test_switches_are_read_strictly(monkeypatch):
    """DRAFTSMITH_PROFILE=false turned the profiler on (a host sync a cycle in every timed run);
    a value other than 1 or 0 is refused, unset or empty is off."""
    from draftsmith.errors import DraftsmithError

    for name, make in (("DRAFTSMITH_PROFILE", lambda: profiler.make_profiler("cpu")),
                       ("DRAFTSMITH_HOST_TIMING", profiler.make_clock)):
        for value, on in (("", False), ("0", False), (" 1 ", True)):
            monkeypatch.setenv(name, value)
            assert isinstance(make(), (profiler.PhaseProfiler, profiler.HostClock)) == on
        monkeypatch.setenv(name, "false")
        with pytest.raises(DraftsmithError, match=f"{name}='false': use 1 or 0"):
            make()


def test_a_summary_of_no_cycle_shows_nothing_timed():
    """Zero cycles (every row ended at the prefill): the table showed 0.000 ms at 0.0 % a phase
    under a total of 100.0 %, and an accept length of 0.00; now a dash where nothing was timed,
    and the JSON says 0 cycles."""
    s = profiler.PhaseProfiler("cpu").summary()
    out = Console(width=100, record=True)
    out.print(profiler.table(s))
    text = out.export_text()
    assert "100.0%" not in text and "0.000" not in text and "0.00 " not in text
    assert [ln.split("│")[2].strip() for ln in text.splitlines()
            if "target verify" in ln or "accept length" in ln] == ["-", "-"]
    assert json.loads(json.dumps(s.to_dict()))["cycles"] == 0
    p = profiler.PhaseProfiler("cpu")
    p.start()
    for ph in profiler.PHASES:
        p.mark(ph)
    one = Console(width=100, record=True)
    one.print(profiler.table(p.summary(), "mine[v2] · batch 1"))
    text = one.export_text()
    assert "100.0%" in text and "mine[v2] · batch 1" in text  # a suite's name, not markup
