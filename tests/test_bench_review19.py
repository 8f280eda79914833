"""`draftsmith bench`, nineteenth review: the JSON line and bench.json say what each figure is
(prefill included or not, pooled over row-cycles, a median of per-round ratios), and bench.png
is never left half-written, nor an earlier run's beside a new bench.json."""

from __future__ import annotations

import json
import statistics

import pytest
from test_bench import invoke

from draftsmith.bench.report import definitions, headline, write_png
from draftsmith.bench.run import BenchConfig, run_bench


@pytest.fixture(scope="module")
def rounds_report(tiny_llama_dir) -> dict:
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1], num_prompts=2,
                      max_new_tokens=5, batch_sizes=[2], repeats=2)
    return run_bench(cfg, log=lambda s: None)


def test_the_json_line_and_bench_json_say_what_each_figure_is(rounds_report, tmp_path):
    meta = rounds_report["meta"]
    said = meta["definitions"]
    assert headline(rounds_report, tmp_path / "bench.json")["definitions"] == said
    base, spec = rounds_report["results"]
    assert "prefill and decode" in said["tokens_per_s"] and "median" in said["tokens_per_s"]
    assert "decode time alone" in said["decode_tokens_per_s"]
    assert "pooled over every row-cycle" in said["mean_accept_length"]
    assert "not a mean of per-prompt" in said["mean_accept_length"]
    assert "round 1's" in said["mean_accept_length"]  # greedy rounds
    # what the words say, the figures do: a median of per-round ratios, not a ratio of medians
    assert "not tokens_per_s / baseline_tokens_per_s" in said["speedup"]
    ups = [s["tokens_per_s"] / b["tokens_per_s"]
           for s, b in zip(spec["rounds"], base["rounds"], strict=True)]
    assert spec["speedup"] == pytest.approx(statistics.median(ups))
    h = spec["accept_hist"]
    assert spec["mean_accept_length"] == pytest.approx(sum(k * c for k, c in enumerate(h))
                                                       / sum(h))


def test_definitions_follow_the_run_they_describe():
    one = definitions({"refill": False})
    assert "median" not in one["tokens_per_s"] and "round" not in one["speedup"]
    assert one["speedup"].startswith("tokens_per_s / baseline_tokens_per_s")
    refilled = definitions({"refill": True, "repeats": 3,
                            "params": {"temperature": 0.7, "top_p": 1.0, "top_k": 0}})
    assert "wall time" in refilled["tokens_per_s"] and "null" in refilled["decode_tokens_per_s"]
    assert refilled["decode_speedup"].startswith("null")
    assert "pooled over the 3 rounds" in refilled["mean_accept_length"]


def fail_savefig(monkeypatch, error: BaseException) -> None:
    """savefig writes part of its file, then stops (a ctrl-C, a full disk)."""
    from matplotlib.figure import Figure

    def half(self, fname, *a, **k):
        fname.write(b"\x89PNG half")  # the staged file write_png opened
        raise error

    monkeypatch.setattr(Figure, "savefig", half)


def test_an_interrupted_png_write_leaves_no_half_written_file(rounds_report, tmp_path,
                                                             monkeypatch):
    png = tmp_path / "bench.png"
    png.write_bytes(b"earlier")
    fail_savefig(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write_png(rounds_report, png)
    assert png.read_bytes() == b"earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.png"]


def test_no_earlier_png_is_left_beside_a_new_bench_json(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    (out / "bench.png").write_bytes(b"an earlier run's plot")
    fail_savefig(monkeypatch, OSError(28, "No space left on device"))
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--steps", "1",
                 "--num-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
                 "--out", str(out))
    assert "cannot write bench.png (No space left on device)" in str(res.exception)
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert json.loads((out / "bench.json").read_text())["results"][1]["setting"] == "chain 1"
    assert line["results"][0]["setting"] == "chain 1"
    assert sorted(p.name for p in out.iterdir()) == ["bench.json"]  # no stale or half plot
