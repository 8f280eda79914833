"""Review 7 of `draftsmith bench`: timings taken on a busy machine are said to be (a 2-core user
read 0.35x with other work running where a quiet rerun gave 0.71x, and nothing told them)."""

from __future__ import annotations

import json

import pytest
from test_bench import invoke

from draftsmith.bench import load
from draftsmith.bench.load import Mark
from draftsmith.bench.report import headline, notes, results_table, write_png


def quiet_or_busy(monkeypatch, other_cores: float, *, stat: bool = True) -> None:
    """A 2-core machine where this process ran 0.8 cores for 10 s and other work `other_cores`
    (through /proc/stat, or without it through the load average)."""
    monkeypatch.setattr(load, "cores", lambda: 2)
    end = Mark(10.0, 8.0, 0.8 + other_cores, 100.0 + 10 * (0.8 + other_cores) if stat else None)
    monkeypatch.setattr(load, "mark", lambda: end)


@pytest.mark.parametrize("stat", [True, False])
def test_other_work_on_the_cores_is_flagged(monkeypatch, stat):
    start = Mark(0.0, 0.0, 2.5, 100.0 if stat else None)
    quiet_or_busy(monkeypatch, 0.1, stat=stat)
    quiet = load.Tally().add(start, load.mark()).result()
    assert quiet["busy"] is False and quiet["own_cores"] == 0.8
    assert quiet["other_cores"] == pytest.approx(0.1) and load.busy_note(quiet) is None
    quiet_or_busy(monkeypatch, 1.2, stat=stat)
    busy = load.Tally().add(start, load.mark()).result()
    assert busy["busy"] is True and busy["other_cores"] == pytest.approx(1.2)
    assert busy["load_before"] == 2.5 and busy["cores"] == 2
    assert load.busy_note(busy) == (
        "timings taken while the machine was busy (load 2.5 on 2 cores, other work on 1.2 of "
        "them): rerun on a quiet machine")


def test_a_platform_without_load_figures_never_fails(monkeypatch):
    monkeypatch.setattr(load, "busy_seconds", lambda: None)
    monkeypatch.setattr(load, "load_average", lambda: None)
    got = load.Tally().add(load.mark(), load.mark()).result()
    assert got["busy"] is False and got["other_cores"] is None and load.busy_note(got) is None


def test_the_busy_seconds_are_this_process_cpus_only(monkeypatch, tmp_path):
    """A container pinned to 2 of a host's 4 CPUs: the others' work is no load on its cores."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  400 0 0 400 0 0 0 0 0 0\n"
                    "cpu0 10 0 5 100 0 0 0 0 0 0\ncpu1 20 0 5 100 0 0 0 0 0 0\n"
                    "cpu2 300 0 0 100 0 0 0 0 0 0\ncpu3 60 0 0 100 0 0 0 0 0 0\n")
    monkeypatch.setattr(load, "STAT", str(stat))
    monkeypatch.setattr(load, "cpus", lambda: {0, 1})
    assert load.busy_seconds() * load.os.sysconf("SC_CLK_TCK") == pytest.approx(40)


def report(machine: dict | None) -> dict:
    base = {"suite": "chat", "batch": 1, "setting": "baseline", "tokens_per_s": 10.0,
            "decode_tokens_per_s": 9.0}
    spec = {**base, "setting": "chain 3", "steps": 3, "topk": 1, "num_draft_tokens": 4,
            "tokens_per_s": 3.5, "decode_tokens_per_s": 3.4, "speedup": 0.35,
            "decode_speedup": 0.38, "mean_accept_length": 1.5, "accept_rate": 0.375,
            "accept_hist": [0, 1, 1, 0, 0], "position_rates": [0.5, 0.0, None]}
    return {"meta": {"device": "cpu", "dtype": "float32", "machine_load": machine},
            "results": [base, spec]}


BUSY = {"cores": 2, "load_before": 3.1, "load_after": 3.4, "own_cores": 0.9,
        "other_cores": 1.3, "busy": True}


def test_the_table_the_notes_and_the_json_line_say_the_machine_was_busy(tmp_path):
    rep = report(BUSY)
    assert "BUSY MACHINE" in results_table(rep).title
    assert notes(rep)[-1].startswith("timings taken while the machine was busy (load 3.4 on 2")
    line = headline(rep, tmp_path / "bench.json")
    assert line["machine_busy"] is True and "rerun on a quiet machine" in line["note"]
    quiet = report({**BUSY, "other_cores": 0.1, "busy": False})
    assert "BUSY" not in results_table(quiet).title and not notes(quiet)
    line = headline(quiet, tmp_path / "bench.json")
    assert line["machine_busy"] is False and "note" not in line
    assert headline(report(None), tmp_path / "bench.json")["machine_busy"] is False  # old ones


def test_the_png_says_it_too(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    titles: list[str] = []
    suptitle = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle",
                        lambda fig, t, **k: titles.append(t) or suptitle(fig, t, **k))
    write_png(report(BUSY), tmp_path / "b.png")
    assert titles and "busy" in titles[0]


def test_bench_records_the_load_while_timing(tiny_llama_dir, tmp_path, monkeypatch):
    """The run itself: bench.json's meta and the JSON line carry the load it measured."""
    ticks = iter(range(0, 10**9, 10**6))  # the machine a million CPU-seconds busier each read
    monkeypatch.setattr(load, "busy_seconds", lambda: float(next(ticks)))
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--steps", "1",
                 "--num-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["machine_busy"] is True and "rerun on a quiet machine" in res.stderr
    meta = json.loads((tmp_path / "o" / "bench.json").read_text())["meta"]
    assert meta["machine_load"]["busy"] is True and meta["machine_load"]["cores"] >= 1


def test_a_suite_file_name_is_text_not_markup():
    """prompts[v2].jsonl read as "prompts" in the table (rich took [v2] for a style), so two
    versions' rows could not be told apart; the divergence line dropped it too."""
    from rich.console import Console

    from draftsmith.bench.report import print_report

    rep = report(None)
    for r in rep["results"]:
        r["suite"] = "prompts[v2]"
    rep["results"][1]["agreement"] = {"identical": 0, "prompts": 1, "max_gap": 0.5}
    shown = Console(record=True, width=250)
    print_report(rep, shown)
    text = shown.export_text()
    assert "│ prompts[v2] │" in text and "prompts[v2] batch 1 chain 3: 1 completions" in text


def test_only_the_timed_runs_count(monkeypatch):
    """An untimed warm-up's compile workers (other processes, busy between the timed spans)
    are not other work; a span timed outside any watch is recorded nowhere."""
    monkeypatch.setattr(load, "cores", lambda: 2)
    marks = iter([Mark(0.0, 0.0, 1.0, 100.0), Mark(10.0, 8.0, 1.1, 108.5),
                  Mark(50.0, 40.0, 6.0, 500.0), Mark(60.0, 48.0, 5.0, 508.5),
                  Mark(70.0, 50.0, 5.0, 600.0), Mark(80.0, 51.0, 5.0, 700.0)])
    monkeypatch.setattr(load, "mark", lambda: next(marks))
    with load.watching() as tally:
        with load.timed():
            pass
        with load.timed():
            pass
    with load.timed():  # no watch: nothing to add to
        pass
    got = tally.result()
    assert got["other_cores"] == pytest.approx(0.05) and got["busy"] is False
    assert got["load_before"] == 1.0 and got["load_after"] == 5.0 and tally.spans == 2
    assert load.Tally().result() is None and load.busy_note(None) is None


def test_a_tensor_parallel_runs_peer_ranks_are_its_own_work(monkeypatch):
    """Under `--tp 2` on a 2-core machine the peer rank's CPU time read as other work, so every
    smoke run was flagged busy."""
    start = Mark(0.0, 0.0, 2.0, 100.0)
    quiet_or_busy(monkeypatch, 0.8)  # the peer: one more rank's 0.8 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = load.Tally().add(start, load.mark()).result()
    assert got["own_cores"] == pytest.approx(1.6) and got["busy"] is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert load.Tally().add(start, load.mark()).result()["busy"] is True
