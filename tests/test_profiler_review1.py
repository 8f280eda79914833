"""Review of the phase profiler, its table and JSON, and the sampling filter's edge cases."""

from __future__ import annotations

import json
import os

import pytest
import torch
from rich.console import Console
from test_speculative import PROMPTS, make_drafter, tiny_target

from draftsmith.engine import profiler
from draftsmith.engine.params import SamplingParams
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, filtered, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


def timed(cycles: int) -> profiler.PhaseSummary:
    p = profiler.PhaseProfiler("cpu")
    for _ in range(cycles):
        p.start()
        for ph in profiler.PHASES:
            p.mark(ph)
    return p.summary()


def test_a_summary_of_no_cycle_writes_null_not_zero(tmp_path):
    """JSON of a run of no cycle said cycle_ms 0.0, each phase 0.0 ms and accept length 0.0,
    where the table says "-": nothing was timed, so null."""
    d = json.loads(profiler.write_json(timed(0), tmp_path / "p.json").read_text())
    assert d["cycles"] == 0 and d["cycle_ms"] is None and d["accept_length"] is None
    assert d["accept_rate"] is None
    assert d["ms"] == dict.fromkeys(profiler.PHASES) and d["pct"] == dict.fromkeys(profiler.PHASES)
    back = Console(width=120, record=True)
    back.print(profiler.table(profiler.PhaseSummary(**d)))  # read back, as bench's report does
    shown = back.export_text()
    assert "0.000" not in shown and "│          - │          - │" in shown
    one = timed(1).to_dict()
    assert one["cycle_ms"] > 0 and all(v > 0 for v in one["ms"].values())


def test_the_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that failed at its flush (a full disk) left a truncated p.json where the earlier
    one was; now the earlier file stays and the error says which file, in one line."""
    path = profiler.write_json(timed(2), tmp_path / "p.json")
    before = path.read_text()

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DraftsmithError, match=r"p\.json: cannot write it \(No space left"):
        profiler.write_json(timed(3), path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_the_table_says_the_accept_length_is_a_rows(tmp_path):
    """At batch > 1 "accept length" next to "cycles" read as tokens a batch cycle: it is tokens
    a row-cycle (finished rows not counted), and the rate is of steps + 1."""
    s = timed(2)
    s.accept_length, s.accept_rate = 2.5, 0.625
    out = Console(width=120, record=True)
    out.print(profiler.table(s))
    text = out.export_text()
    assert "accept length (tokens a row-cycle)" in text and "2.50" in text
    assert "accept rate (length / (steps + 1))" in text and "0.625" in text
    ms = [float(ln.split("│")[2]) for ln in text.splitlines()
          if any(profiler.LABELS[k] in ln for k in profiler.PHASES)]
    total = next(float(ln.split("│")[2]) for ln in text.splitlines() if "total cycle" in ln)
    assert len(ms) == 4 and sum(ms) == pytest.approx(total, abs=0.003)


def test_off_on_cuda_records_no_event_and_no_sync(monkeypatch):
    """Profiling off creates no CUDA event and adds no synchronize, on a CUDA device too (faked:
    any event or sync fails the test)."""
    def never(*_a, **_k):
        raise AssertionError("profiling off touched CUDA")

    monkeypatch.setattr(torch.cuda, "Event", never)
    monkeypatch.setattr(torch.cuda, "synchronize", never)
    monkeypatch.setattr(torch.cuda, "current_stream", never)
    monkeypatch.setenv("DRAFTSMITH_PROFILE", "0")
    for prof in (profiler.make_profiler("cuda"), profiler.make_profiler("cuda", False)):
        assert not prof.enabled
        prof.start()
        for ph in profiler.PHASES:
            prof.mark(ph)
        assert prof.summary() is None


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False), ("  ", False),
                                      ("yes", None), ("on", None), ("2", None), ("garbage", None)])
def test_profile_switch_values(monkeypatch, value, on):
    """DRAFTSMITH_PROFILE: 1 on, 0 or unset/blank off, anything else refused naming the value."""
    monkeypatch.setenv("DRAFTSMITH_PROFILE", value)
    if on is None:
        with pytest.raises(DraftsmithError, match=f"DRAFTSMITH_PROFILE='{value}': use 1 or 0"):
            profiler.make_profiler("cpu")
    else:
        assert profiler.make_profiler("cpu").enabled is on


def test_profiled_batch_counts_rows_that_ran_only():
    """A batch of 2 where one row ends early at an EOS: the profiler's cycles are the run's, the
    histogram counts row-cycles of running rows only (fewer than rows x cycles), its accept
    length is tokens a row-cycle, and the per-position counts agree with the histogram."""
    target = tiny_target()
    rt, drafter = Runtime(target, 2, 96), make_drafter(target, 96)
    dec = SpecDecoder(rt, drafter, 3, profile=True)
    prompts = PROMPTS[:2]
    free = dec.generate(prompts, 16, eos_ids=[])
    eos = next(t for t in free.tokens[0][1:4] if t not in free.tokens[1])
    res = dec.generate(prompts, 16, eos_ids=[eos])
    ph, h = res.phases, res.accept_hist
    assert len(res.tokens[0]) < len(free.tokens[0]) and res.tokens[1] == free.tokens[1]
    assert ph.cycles == res.cycles and res.cycles <= sum(h) < 2 * res.cycles
    assert h[0] == 0 and ph.accept_length == pytest.approx(
        sum(k * c for k, c in enumerate(h)) / sum(h))
    assert ph.accept_rate == pytest.approx(ph.accept_length / 4)
    assert res.reached == [sum(h[i + 1:]) for i in range(3)]
    assert res.accepted == [sum(h[i + 2:]) for i in range(3)]
    assert ph.cycle_ms == pytest.approx(sum(ph.ms.values()))
    assert sum(ph.pct.values()) == pytest.approx(100.0)


def test_a_tiny_top_p_keeps_the_top_token():
    """top_p 1e-50 rounds to 0 in float32: the filter dropped every token, the softmax gave NaN
    and the draw picked token 0 whatever the logits; now the top token alone is kept."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for top_p in (1e-50, 1e-30, 1e-9):
        p = SamplingParams(1.0, top_p=top_p)
        assert torch.equal(probs(logits, p), one_hot), top_p
        rows = RowSampling(2, "cpu", p)
        assert torch.equal(rows.probs(logits), one_hot), top_p
        assert rows.sample(logits).tolist() == [1, 0]


def test_filter_edges_keep_the_distribution():
    """top_p 1 and top_k past the vocabulary filter nothing; top_k 1 keeps the argmax; top-k ties
    with the k-th are kept; a tiny temperature samples the argmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    plain = logits.softmax(-1)
    assert torch.allclose(probs(logits, SamplingParams(1.0, top_p=1.0)), plain)
    assert torch.allclose(probs(logits, SamplingParams(1.0, top_k=500)), plain)
    assert torch.allclose(probs(logits, SamplingParams(1.0, top_k=50, top_p=1.0)), plain)
    top1 = probs(logits, SamplingParams(1.0, top_k=1))
    assert torch.equal(top1.argmax(-1), logits.argmax(-1)) and torch.equal(top1.max(-1).values,
                                                                           torch.ones(3))
    ties = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    kept = filtered(ties, torch.tensor([[2]]), torch.tensor([[1.0]]))
    assert torch.isinf(kept).tolist() == [[False, True, False, False, True]]
    cold = probs(logits, SamplingParams(1e-9))
    assert torch.equal(cold.argmax(-1), logits.argmax(-1)) and not cold.isnan().any()
    assert torch.allclose(cold.max(-1).values, torch.ones(3))
    half = probs(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), SamplingParams(1.0, top_p=0.5))
    assert torch.allclose(half, torch.tensor([[1.0, 0.0, 0.0]]))  # mass 0.5 reached by one


def test_bench_notes_say_padding_rows_count_in_the_acceptance():
    """Padding rows (a repeated prompt topping up the last batch) count in the accept length,
    per-position rates and histogram as in tok/s (a decoder's histogram over [p, p] is twice
    p's); the note said tok/s only."""
    from draftsmith.bench.report import notes

    target = tiny_target()
    dec = SpecDecoder(Runtime(target, 2, 96), make_drafter(target, 96), 3)
    one, two = dec.generate(PROMPTS[:1], 12, eos_ids=[]), dec.generate(PROMPTS[:1] * 2, 12,
                                                                       eos_ids=[])
    assert two.accept_hist == [2 * c for c in one.accept_hist]
    report = {"meta": {}, "results": [{"suite": "chat", "batch": 2, "setting": "baseline",
                                       "prompts": 1, "padding_rows": 1}]}
    [note] = notes(report)
    assert "count in tok/s and in the acceptance figures" in note


def report_edges() -> dict:
    """Baseline that decoded nothing, a setting that accepted every draft, one of no cycle."""
    from draftsmith.bench.run import merge_phases

    ph = merge_phases([profiler.PhaseSummary(3, {"draft": 1.0, "verify": 2.0, "accept": 0.5,
                                                 "extend": 0.5}, {}, 4.0)], 4.0, 3)
    base = {"suite": "chat", "batch": 1, "setting": "baseline", "tokens_per_s": 10.0,
            "decode_tokens_per_s": 12.0, "prompts": 1}
    full = {"suite": "chat", "batch": 1, "setting": "chain 3", "steps": 3, "topk": 1,
            "num_draft_tokens": 4, "tokens_per_s": 25.0, "decode_tokens_per_s": 36.0,
            "speedup": 2.5, "decode_speedup": 3.0, "mean_accept_length": 4.0,
            "accept_rate": 1.0, "accept_hist": [0, 0, 0, 1, 5], "reached": [6, 6, 6],
            "accepted": [6, 6, 5], "position_rates": [1.0, 1.0, 5 / 6], "phases": ph}
    idle = {**full, "setting": "chain 2", "steps": 2, "num_draft_tokens": 3,
            "tokens_per_s": 0.0, "decode_tokens_per_s": 0.0, "speedup": 0.0,
            "decode_speedup": 0.0, "mean_accept_length": None, "accept_rate": None,
            "accept_hist": [0, 0, 0, 0], "reached": [0, 0], "accepted": [0, 0],
            "position_rates": [None, None], "phases": None}
    return {"meta": {"device": "cpu", "dtype": "float32"}, "results": [base, full, idle]}


def test_bench_table_json_line_and_png_agree(tmp_path, monkeypatch, capsys):
    """The table, the JSON line and the PNG show the same speedups, accept lengths and
    histogram (its x the tokens a cycle emits, 1..steps + 1); a run of no cycle plots no
    histogram and writes no NaN."""
    import matplotlib.figure

    from draftsmith.bench.report import print_report, write_png

    report = report_edges()
    shown = Console(width=250, record=True)
    print_report(report, shown, tmp_path / "bench.json")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = shown.export_text()
    table = {ln.split("│")[3].strip(): [c.strip() for c in ln.split("│")[1:-1]]
             for ln in text.splitlines() if ln.startswith("│ chat")}
    got = {r["setting"]: r for r in line["results"]}
    assert got["chain 3"]["speedup"] == 2.5 and table["chain 3"][4] == "2.50x"
    assert got["chain 3"]["baseline_tokens_per_s"] == 10.0 and table["baseline"][3] == "10.0"
    assert got["chain 3"]["mean_accept_length"] == 4.0 and table["chain 3"][7] == "4.00"
    assert got["chain 2"]["mean_accept_length"] is None and table["chain 2"][7] == "-"
    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda f, *a, **k: figs.append(f))
    write_png(report, tmp_path / "bench.png")
    ax = figs[0].axes
    bars = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in ax[0].patches}
    assert bars == {0: 2.5, 1: 0.0}
    [hist] = ax[1].get_lines()  # the fastest setting's
    assert list(hist.get_xdata()) == [1, 2, 3, 4]
    assert list(hist.get_ydata()) == pytest.approx([0, 0, 1 / 6, 5 / 6])
    assert list(ax[2].get_lines()[0].get_ydata()) == pytest.approx([1.0, 1.0, 5 / 6])


def test_a_baseline_that_decoded_nothing_is_no_1x():
    """--max-new-tokens 1: the baseline decoded nothing, every setting's decode speedup read "-"
    but the baseline's own row still read 1.00x over its 0 tok/s; now "-" there too."""
    from draftsmith.bench.report import results_table

    report = report_edges()
    base = report["results"][0]
    base["decode_tokens_per_s"] = 0.0
    report["results"][1]["decode_speedup"] = None
    shown = Console(width=250, record=True)
    shown.print(results_table(report))
    row = next(ln.split("│")[1:-1] for ln in shown.export_text().splitlines()
               if "baseline" in ln)
    assert [c.strip() for c in row[3:7]] == ["10.0", "1.00x", "0.0", "-"]
