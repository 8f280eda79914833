"""`draftsmith bench`, sixteenth review: `--repeats N` times each (suite, batch) in N rounds, each
round's order rotated, and reports each figure's median with its min-max range."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from test_bench import bench_json, drafter_dir, invoke  # noqa: F401 (a fixture)

import draftsmith.bench.run as bench_run
import draftsmith.targets
from draftsmith.bench.run import TIMING, BenchConfig, run_bench
from draftsmith.engine.spec_state import SpecResult
from draftsmith.errors import DraftsmithError

ARGS = ("--num-prompts", "2", "--steps", "1,2", "--max-new-tokens", "9", "--device", "cpu")
NEW = {"repeats", "tokens_per_s_min", "tokens_per_s_max", "decode_tokens_per_s_min",
       "decode_tokens_per_s_max", "speedup_min", "speedup_max", "decode_speedup_min",
       "decode_speedup_max", "within_noise", "rounds"}


def timed_order(monkeypatch) -> list[str]:
    """The runs timed (9 new tokens; warm-ups make 8), one entry a run however many batches."""
    from draftsmith.engine.speculative import SpecDecoder

    seen: list[str] = []

    def log(label: str) -> None:
        if not seen or seen[-1] != label:
            seen.append(label)

    generate, base = SpecDecoder.generate, bench_run.run_generation

    def spec(dec, prompts, max_new, *a, **k):
        if max_new == 9 and not dec.profile:
            log(f"chain {dec.steps}")
        return generate(dec, prompts, max_new, *a, **k)

    def baseline(rt, batch, max_new, *a, **k):
        if max_new == 9:
            log("baseline")
        return base(rt, batch, max_new, *a, **k)

    monkeypatch.setattr(SpecDecoder, "generate", spec)
    monkeypatch.setattr(bench_run, "run_generation", baseline)
    return seen


def test_rounds_rotate_the_order_and_report_medians_with_their_range(tiny_llama_dir,
                                                                    drafter_dir,  # noqa: F811
                                                                    tmp_path, monkeypatch):
    seen = timed_order(monkeypatch)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), *ARGS,
                 "--repeats", "3", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen == ["baseline", "chain 1", "chain 2", "chain 1", "chain 2", "baseline",
                    "chain 2", "baseline", "chain 1"]
    report = bench_json(res)
    assert report["meta"]["repeats"] == 3 and "rotated" in report["meta"]["timing"]
    base, *spec = report["results"]
    for row in (base, *spec):
        rates = [r["tokens_per_s"] for r in row["rounds"]]
        assert len(rates) == 3 and row["tokens_per_s"] == statistics.median(rates)
        assert (row["tokens_per_s_min"], row["tokens_per_s_max"]) == (min(rates), max(rates))
        assert row["decode_tokens_per_s_min"] <= row["decode_tokens_per_s"]
    for row in spec:  # greedy: every round accepts the same
        assert len({r["mean_accept_length"] for r in row["rounds"]}) == 1
        assert row["mean_accept_length"] == row["rounds"][0]["mean_accept_length"]
        ups = [s["tokens_per_s"] / b["tokens_per_s"]
               for s, b in zip(row["rounds"], base["rounds"], strict=True)]
        assert row["speedup"] == pytest.approx(statistics.median(ups))
        assert row["speedup_min"] == pytest.approx(min(ups))
        assert row["within_noise"] == (row["speedup_min"] <= 1.0 <= row["speedup_max"])
        assert row["agreement"]["identical"] == 2
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["repeats"] == 3
    assert {"speedup_min", "speedup_max", "within_noise", "tokens_per_s_min"} <= set(
        line["results"][0])
    lo, hi = spec[0]["speedup_min"], spec[0]["speedup_max"]
    assert f"{spec[0]['speedup']:.2f}x ({lo:.2f}-{hi:.2f})" in res.stderr
    assert "timed in 3 rounds" in res.stderr and "no spread is measured" not in res.stderr


def test_one_round_reports_as_before(tiny_llama_dir, drafter_dir, tmp_path,  # noqa: F811
                                    monkeypatch):
    seen = timed_order(monkeypatch)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), *ARGS,
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen == ["baseline", "chain 1", "chain 2"]
    report = bench_json(res)
    assert report["meta"]["timing"] == TIMING
    assert not NEW & (set(report["meta"]) | {k for r in report["results"] for k in r})
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert not NEW & (set(line) | {k for r in line["results"] for k in r})
    assert "no spread is measured" in res.stderr and "(0." not in res.stderr


def known_runs(monkeypatch, rates: dict[str, list[float]]) -> None:
    """Each run's timed calls give these tok/s in turn (its own rounds, whatever the order)."""
    from draftsmith.bench.run import Prepared

    def prepared(label: str, spec: bool) -> Prepared:
        left = iter(rates[label])

        def timed():
            rate = next(left)
            row = {"new_tokens": 4, "seconds": 4 / rate, "tokens_per_s": rate,
                   "decode_tokens_per_s": rate / 2}
            m = SpecResult([[1, 2], [1, 2]], 0.0, 4 / rate, 2, 1, [0, 1, 1], [2], [1])
            return ({**row, **m.accept_stats()}, m.tokens, m) if spec else (row, m.tokens, None)
        return Prepared(timed)

    monkeypatch.setattr(bench_run, "_baseline_run",
                        lambda *a, **k: prepared("baseline", False))
    monkeypatch.setattr(bench_run, "_speculative_run",
                        lambda rt, drt, s, *a: prepared(f"chain {s[0]}", True))


def test_medians_ranges_and_within_noise_from_known_rounds(tiny_llama_dir, monkeypatch):
    known_runs(monkeypatch, {"baseline": [100.0, 90.0, 110.0],
                             "chain 1": [150.0, 99.0, 121.0],  # 1.5, 1.1, 1.1: faster
                             "chain 2": [95.0, 108.0, 99.0]})  # 0.95, 1.2, 0.9: noise
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1, 2],
                      num_prompts=2, max_new_tokens=4, repeats=3)
    base, one, two = run_bench(cfg, log=lambda s: None)["results"]
    assert (base["tokens_per_s"], base["tokens_per_s_min"], base["tokens_per_s_max"]) == (
        100.0, 90.0, 110.0)
    assert base["decode_tokens_per_s"] == 50.0 and base["seconds"] == pytest.approx(0.04)
    assert [one[k] for k in ("speedup", "speedup_min", "speedup_max")] == pytest.approx(
        [1.1, 1.1, 1.5])
    assert one["within_noise"] is False and one["decode_speedup"] == pytest.approx(1.1)
    assert [two[k] for k in ("speedup", "speedup_min", "speedup_max")] == pytest.approx(
        [0.95, 0.9, 1.2])
    assert two["within_noise"] is True
    assert [r["speedup"] for r in two["rounds"]] == pytest.approx([0.95, 1.2, 0.9])
    assert one["accept_hist"] == [0, 1, 1]  # greedy: the first round's, not three summed


def test_sampled_rounds_pool_their_acceptance(tiny_llama_dir, monkeypatch):
    from draftsmith.engine.sampling import SamplingParams

    known_runs(monkeypatch, {"baseline": [100.0, 100.0], "chain 1": [90.0, 110.0]})
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1], num_prompts=2,
                      max_new_tokens=4, repeats=2, params=SamplingParams(temperature=0.7))
    _, row = run_bench(cfg, log=lambda s: None)["results"]
    assert row["accept_hist"] == [0, 2, 2] and row["within_noise"] is True
    assert row["speedup"] == pytest.approx(1.0)


def test_a_run_failing_in_a_round_keeps_the_groups_finished(tiny_llama_dir,
                                                            drafter_dir,  # noqa: F811
                                                            tmp_path, monkeypatch):
    """Rounds keep a (suite, batch)'s rows to its end: the groups finished are written, the
    one under way is not run, and the failure names its run and round."""
    from draftsmith.engine.speculative import SpecDecoder

    generate = SpecDecoder.generate
    error = torch.OutOfMemoryError("CUDA out of memory")

    def fails(dec, prompts, max_new, *a, **k):
        if dec.steps == 2 and len(prompts) == 1 and max_new == 9:
            raise error
        return generate(dec, prompts, max_new, *a, **k)

    monkeypatch.setattr(SpecDecoder, "generate", fails)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), *ARGS,
                 "--batch-size", "1,2", "--repeats", "2", "--out", str(tmp_path / "o"))
    assert res.exception is error
    meta = json.loads((tmp_path / "o" / "bench.json").read_text())["meta"]
    saved = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    assert [(r["batch"], r["setting"]) for r in saved] == [
        (2, "baseline"), (2, "chain 1"), (2, "chain 2")]
    assert meta["not_run"] == ["chat batch 1: baseline", "chat batch 1: chain 1",
                               "chat batch 1: chain 2"]
    assert meta["failed"]["run"] == "chat batch 1: chain 2 (round 1 of 2)"


@pytest.mark.parametrize("value, said", [("0", "--repeats must be >= 1, got 0"),
                                         ("-2", "--repeats must be >= 1, got -2")])
def test_repeats_below_one_refused_by_flag_before_loading(drafter_dir, tmp_path,  # noqa: F811
                                                          monkeypatch, value, said):
    def load(*_a, **_k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(draftsmith.targets, "load_target", load)
    res = invoke("--target", "t", "--drafter", str(drafter_dir), *ARGS, "--repeats", value,
                 "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError) and str(res.exception) == said


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_bench_config_refuses_repeats_that_are_no_count(value):
    with pytest.raises(DraftsmithError, match="--repeats must be"):
        BenchConfig(drafter="random", repeats=value)


def test_the_png_draws_each_speedups_range(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from draftsmith.bench.report import write_png

    bars: list[dict] = []
    real = Axes.bar

    def bar(ax, *a, **k):
        bars.append(k)
        return real(ax, *a, **k)

    monkeypatch.setattr(Axes, "bar", bar)
    spec = {"suite": "chat", "batch": 1, "setting": "chain 1", "tokens_per_s": 12.0,
            "speedup": 1.2, "speedup_min": 1.1, "speedup_max": 1.5, "accept_hist": [0, 1, 1],
            "position_rates": [0.5]}
    write_png({"meta": {"repeats": 3}, "results": [spec]}, tmp_path / "b.png")
    assert bars[0]["yerr"] == [[pytest.approx(0.1)], [pytest.approx(0.3)]]
    del spec["speedup_min"], spec["speedup_max"]
    bars.clear()
    write_png({"meta": {}, "results": [spec]}, tmp_path / "c.png")
    assert "yerr" not in bars[0]
