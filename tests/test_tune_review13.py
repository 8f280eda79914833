"""Review 13 of `draftsmith tune`: a sweep timed on a busy machine said nothing of it (a user read
"predicted 5.3 measured 15.9 (-66.6 %)" while compare ran beside it); --nccl-sweep without --tp
was "--tp 1: need >= 1 ranks, and >= 2 for --nccl-sweep"; a rerun replaced tune.json without a
word."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import torch
from test_tune_cli import _tiny_pair, invoke_tune

from draftsmith.bench import load
from draftsmith.errors import DraftsmithError

BUSY = {"cores": 2, "load_before": 2.1, "load_after": 2.3, "own_cores": 0.9,
        "other_cores": 1.4, "busy": True}


def test_an_nccl_sweep_without_tp_is_one_clear_sentence(tmp_path):
    res = invoke_tune("--drafter", str(tmp_path), "--nccl-sweep")
    assert isinstance(res.exception, DraftsmithError)
    assert str(res.exception) == ("--nccl-sweep needs --tp 2 or more (NCCL settings matter only "
                                  "across ranks), got --tp 1")
    res = invoke_tune("--drafter", str(tmp_path), "--tp", "0")
    assert str(res.exception) == "--tp must be >= 1 (tensor-parallel ranks), got 0"


def test_the_cost_timings_are_watched():
    from draftsmith.tune.measure import time_ms

    with load.watching() as tally:
        time_ms(lambda: None, torch.device("cpu"), 3)
    assert tally.spans == 1 and tally.result() is not None


def _report(tmp_path, machine_load, monkeypatch):
    from matplotlib.figure import Figure

    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.tune.cli import write_report

    titles = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (
        titles.append(fig._suptitle.get_text() if fig._suptitle else ""), real(fig, *a, **k)))
    stub = SimpleNamespace(to_dict=dict)
    report = write_report(tmp_path / "tune", stub, stub, [], [], [], ["text"], [1], "cpu", 1,
                          SamplingParams(), machine_load=machine_load)
    return report, titles[-1]


def test_the_report_records_the_load_and_a_busy_plot_says_so(tmp_path, monkeypatch):
    report, title = _report(tmp_path, BUSY, monkeypatch)
    assert json.loads((tmp_path / "tune" / "tune.json").read_text())["machine_load"] == BUSY
    assert report["machine_load"] == BUSY and title.startswith("BUSY MACHINE while timing")
    quiet = dict(BUSY, busy=False, other_cores=0.1)
    report, title = _report(tmp_path, quiet, monkeypatch)
    assert report["machine_load"]["busy"] is False and title == ""


def test_a_rerun_says_it_replaces_the_earlier_report(tmp_path, monkeypatch, capsys):
    _report(tmp_path, None, monkeypatch)
    assert "replacing" not in capsys.readouterr().out
    past = time.time() - 3600
    os.utime(tmp_path / "tune" / "tune.json", (past, past))
    _report(tmp_path, None, monkeypatch)
    out = capsys.readouterr().out
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(past))
    assert f"replacing the earlier report {tmp_path / 'tune' / 'tune.json'} (written {when}" in out


def test_a_busy_sweep_is_flagged_in_the_texts(tmp_path, monkeypatch):
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    spans = []
    monkeypatch.setattr(load.Tally, "result", lambda self: spans.append(self.spans) or BUSY)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 2, 1, "cpu", torch.float32,
                      False, tmp_path / "tune", max_topk=1, num_prompts=1)
    assert spans and spans[0] > 0  # the costs and the sweep were timed inside the watch
    assert report["machine_load"] == BUSY
    flagged = [t for t in report["texts"] if "machine was busy" in t]
    assert len(flagged) == 1 and flagged[0] in (tmp_path / "tune" / "tune.md").read_text()


def test_a_rerun_of_tune_nccl_says_it_replaces_the_earlier_sweep(tmp_path, monkeypatch):
    from draftsmith.tune import nccl

    monkeypatch.setattr(nccl, "sweep", lambda *a, **k: [])  # the spawned ranks: not the point
    said: list[str] = []
    for _ in range(2):
        nccl.run_nccl_sweep(2, "tiny", [nccl.DEFAULTS], [(1, 1)], "cpu", "fp32", 1,
                            out=tmp_path, log=said.append)
    replacing = [s for s in said if s.startswith("replacing the earlier report")]
    assert len(replacing) == 1 and str(tmp_path / "nccl.json") in replacing[0]
