"""Review 8 of `draftsmith bench`: a rerun into the same --out replaced bench.json without a word
(benchmarks are rerun into one folder on purpose, so it is said, not refused)."""

from __future__ import annotations

import os
import time

from draftsmith.bench import cli as bench_cli
from draftsmith.bench import report as bench_report


def test_no_line_where_there_is_no_earlier_report(tmp_path):
    assert bench_cli.replaced(tmp_path / "bench.json") is None


def test_a_rerun_says_which_report_it_replaces_and_when_it_was_written(tmp_path, monkeypatch,
                                                                      capsys):
    written = []
    monkeypatch.setattr(bench_report, "write_json", lambda r, p: written.append(p) or p)
    monkeypatch.setattr(bench_report, "print_report", lambda *a: None)
    monkeypatch.setattr(bench_report, "write_png", lambda *a: None)
    bench_cli._write({}, tmp_path)
    assert "replacing" not in capsys.readouterr().err
    (tmp_path / "bench.json").write_text("{}")
    past = time.time() - 7200
    os.utime(tmp_path / "bench.json", (past, past))
    bench_cli._write({}, tmp_path)
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap a long path
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(past))
    assert (f"replacing the earlier report {tmp_path / 'bench.json'} (written {when}) and the "
            "files beside it") in err
    assert written == [tmp_path / "bench.json"] * 2
