"""`draftsmith bench`, fifth review: the host clock reaches the report, a ctrl-C keeps the
settings timed, integer plot axes, padding rows left out of agreement, and a headline JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)

from draftsmith.bench.report import write_png
from draftsmith.engine.spec_state import SpecResult


def part(iterations: int, launch: float, wait: float, **extra) -> SpecResult:
    host = {"iterations": iterations, "launch_ms": launch, "wait_ms": wait}
    return SpecResult([[1]], 0.1, 0.2, 2, 1, [0, 1, 1], [2], [1], extra={"host": host, **extra})


def test_merged_keeps_the_host_clock_over_every_run():
    """DRAFTSMITH_HOST_TIMING=1: `merged` dropped `extra`, so bench never showed the clock."""
    m = SpecResult.merged([part(2, 1.0, 3.0, check_every=4), part(6, 2.0, 1.0, check_every=4)])
    assert m.extra["host"] == {"iterations": 8, "launch_ms": (2 + 12) / 8,
                               "wait_ms": (6 + 6) / 8}
    assert m.extra["check_every"] == 4
    plain = SpecResult([[1]], 0.1, 0.2, 2, 1, [0, 1, 1], [2], [1])
    assert SpecResult.merged([plain, plain]).extra == {}
    assert SpecResult.merged_host([None, {"iterations": 0}]) == {"iterations": 0}


def lines(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [x for x in out if isinstance(x, dict)]


ARGS = ("--num-prompts", "3", "--batch-size", "2", "--max-new-tokens", "4", "--device", "cpu")


def test_bench_shows_the_host_clock(tiny_llama_dir, drafter_dir, tmp_path,  # noqa: F811
                                    monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HOST_TIMING", "1")
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "2",
                 *ARGS, "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    rows = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    for r in rows:  # baseline steps and speculative cycles alike
        assert r["host"]["iterations"] > 0 and r["host"]["launch_ms"] > 0, r
    assert "host launch ms" in res.output and "host wait ms" in res.output


def test_padding_rows_are_left_out_of_agreement(tiny_llama_dir, drafter_dir, tmp_path):  # noqa: F811
    """3 prompts at batch 2 run 4 rows: agreement counted the repeated prompt twice (4/4)."""
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "1",
                 *ARGS, "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    base, spec = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    assert spec["agreement"]["prompts"] == 3 and "3/3" in res.output
    assert (base["prompts"], base["padding_rows"]) == (spec["prompts"], spec["padding_rows"]) == (
        3, 1)
    assert "3 prompts, the last batch topped up with 1 repeated prompt;" in " ".join(
        res.output.split())


def test_the_json_line_is_the_headline(tiny_llama_dir, drafter_dir, tmp_path):  # noqa: F811
    """The line was the whole report (several KB, per-divergence detail): now one line of
    headline figures per setting and where bench.json is."""
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir),
                 "--steps", "2", "--topk", "1,2", "--num-draft-tokens", "3", *ARGS,
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    [line] = lines(res.stdout)  # exactly one JSON line on stdout
    assert res.stdout.strip().splitlines()[-1].startswith("{")
    full = json.loads(Path(line["bench_json"]).read_text())
    assert Path(line["bench_json"]) == (tmp_path / "o" / "bench.json").resolve()
    assert line["partial"] is False and "not_run" not in line
    base = full["results"][0]
    assert [r["setting"] for r in line["results"]] == ["chain 2", "tree 2/2/3"]
    for head, row in zip(line["results"], full["results"][1:], strict=True):
        assert head == {"suite": "chat", "batch": 2, "setting": row["setting"],
                        "steps": row["steps"], "topk": row["topk"],
                        "num_draft_tokens": row["num_draft_tokens"],
                        "baseline_tokens_per_s": base["tokens_per_s"],
                        "tokens_per_s": row["tokens_per_s"], "speedup": row["speedup"],
                        "decode_speedup": row["decode_speedup"],
                        "mean_accept_length": row["mean_accept_length"]}


def test_an_unwritable_bench_json_prints_the_whole_report(tiny_llama_dir, tmp_path,
                                                          monkeypatch):
    from draftsmith.bench import report

    def fail(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", fail)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--steps", "1",
                 "--num-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert "cannot write bench.json (No space left on device)" in str(res.exception)
    [line] = lines(res.stdout)
    assert [r["setting"] for r in line["results"]] == ["baseline", "chain 1"]
    assert "meta" in line and "bench_json" not in line


def test_a_ctrl_c_keeps_the_runs_timed(tiny_llama_dir, drafter_dir, tmp_path,  # noqa: F811
                                       monkeypatch):
    """An interrupted bench wrote nothing: the baseline and chain 1 timed were lost."""
    from draftsmith.engine.speculative import SpecDecoder

    generate = SpecDecoder.generate

    def steps_two_interrupted(dec, *a, **k):
        if dec.steps == 2:
            raise KeyboardInterrupt
        return generate(dec, *a, **k)

    monkeypatch.setattr(SpecDecoder, "generate", steps_two_interrupted)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir),
                 "--steps", "1,2,3", *ARGS, "--out", str(tmp_path / "o"))
    assert res.exit_code == 130, (res.output, res.exception)
    saved = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [r["setting"] for r in saved["results"]] == ["baseline", "chain 1"]
    assert saved["meta"]["partial"] is True
    assert saved["meta"]["not_run"] == ["chat batch 2: chain 2", "chat batch 2: chain 3"]
    [line] = lines(res.stdout)
    assert line["partial"] is True and line["not_run"] == saved["meta"]["not_run"]
    assert "PARTIAL" in res.output and (tmp_path / "o" / "bench.png").exists()
    assert "interrupted: wrote the runs finished" in res.stderr


def test_a_ctrl_c_before_anything_was_timed_writes_nothing(tiny_llama_dir, tmp_path,
                                                           monkeypatch):
    from draftsmith.bench import run

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_baseline", interrupted)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--steps", "1",
                 "--num-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 130 and not (tmp_path / "o" / "bench.json").exists()


@pytest.mark.parametrize("hist", [[0, 3, 1], [0, 1, 2, 5, 1, 0, 2]])
def test_bench_png_ticks_whole_numbers_of_tokens_and_positions(tmp_path, monkeypatch, hist):
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figs.append(self))
    depth = len(hist) - 2
    row = {"suite": "chat", "batch": 1, "setting": f"chain {depth}", "tokens_per_s": 12.0,
           "speedup": 1.2, "accept_hist": hist, "position_rates": [0.5] * depth}
    report = {"meta": {}, "results": [{"suite": "chat", "batch": 1, "setting": "baseline",
                                       "tokens_per_s": 10.0}, row]}
    write_png(report, tmp_path / "b.png")
    for ax in figs[0].axes[1:3]:  # accept-length histogram, per-position acceptance
        ax.figure.canvas.draw()
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_bench_png_of_a_run_interrupted_after_its_baseline_warns_of_nothing(tmp_path):
    """No setting timed: matplotlib's 'No artists with labels' warning on stderr."""
    import warnings

    report = {"meta": {"partial": True}, "results": [
        {"suite": "chat", "batch": 1, "setting": "baseline", "tokens_per_s": 10.0}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert write_png(report, tmp_path / "b.png").stat().st_size > 0
