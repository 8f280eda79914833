"""Review of `draftsmith bench`'s statistics and the speculative result record: what was never
measured reads as such, profiled parts merge whatever phases each has, refilled runs' accept
figures, sampling flags at temperature 0, and the all-reduce bench on the CPU."""

from __future__ import annotations

import json
import math

import pytest
from test_bench import bench_json, invoke
from test_refill import PROMPTS
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target
from typer.testing import CliRunner

from draftsmith.bench.report import results_table, write_png
from draftsmith.bench.run import merge_phases
from draftsmith.engine.profiler import PhaseSummary
from draftsmith.engine.spec_state import SpecResult
from draftsmith.errors import DraftsmithError


def result(hist: list[int], reached: list[int], accepted: list[int]) -> SpecResult:
    return SpecResult([[1, 2]], 0.1, 0.2, sum(hist), len(reached), hist, reached, accepted)


def test_spec_result_says_none_where_nothing_was_measured():
    """A position no cycle reached read 0.0 (measured and rejected), and a run of no cycle an
    accept length 0.0 and rate 0.0; the older float view keeps 0.0 for its callers."""
    deep = result([0, 2, 1, 0], [3, 1, 0], [1, 0, 0])
    assert deep.measured_position_rates == [1 / 3, 0.0, None]
    assert deep.position_rates == [1 / 3, 0.0, 0.0]
    d = deep.to_dict()
    assert d["position_rates"] == [1 / 3, 0.0, None] and d["mean_accept_length"] == 4 / 3
    idle = result([0, 0, 0], [0, 0], [0, 0])
    assert idle.measured_accept_length is None and idle.mean_accept_length == 0.0
    d = idle.to_dict()
    assert d["position_rates"] == [None, None]
    assert d["mean_accept_length"] is None and d["accept_rate"] is None


def report_of(rows: list[dict]) -> dict:
    base = {"suite": "chat", "batch": 1, "setting": "baseline", "tokens_per_s": 10.0,
            "decode_tokens_per_s": 9.0}
    return {"meta": {"device": "cpu", "dtype": "float32"}, "results": [base, *rows]}


def spec_row(rates: list[float | None], length: float | None, hist: list[int]) -> dict:
    return {"suite": "chat", "batch": 1, "setting": "tree 3/2/6", "tokens_per_s": 12.0,
            "decode_tokens_per_s": 11.0, "speedup": 1.2, "decode_speedup": 1.2,
            "mean_accept_length": length, "accept_rate": None if length is None else length / 4,
            "accept_hist": hist, "position_rates": rates}


def test_bench_table_shows_a_dash_where_nothing_was_measured():
    rep = report_of([spec_row([0.5, 0.25, None], 1.75, [0, 2, 1, 1])])
    cols = {c.header: [str(x) for x in c._cells] for c in results_table(rep).columns}
    assert cols["p1"] == ["", "50%"] and cols["p3"] == ["", "-"]  # baseline: no positions
    idle = report_of([spec_row([None, None, None], None, [0, 0, 0, 0])])
    cols = {c.header: [str(x) for x in c._cells] for c in results_table(idle).columns}
    assert cols["accept len"] == ["", "-"] and cols["len/max"] == ["", "-"]
    assert cols["p1"] == ["", "-"]


def test_bench_png_leaves_a_gap_where_nothing_was_measured(tmp_path, monkeypatch):
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: figs.append(self))
    rep = report_of([spec_row([0.5, None, None], 1.5, [0, 1, 1, 0])])
    rep["results"].append({**spec_row([None, None], None, [0, 0, 0]), "batch": 2})
    write_png(rep, tmp_path / "b.png")
    ax = figs[0].axes
    rates = [list(line.get_ydata()) for line in ax[2].lines]  # per-position acceptance
    assert rates[0][0] == 0.5 and all(math.isnan(v) for v in rates[0][1:])
    assert all(math.isnan(v) for v in rates[1])
    shares = [list(line.get_ydata()) for line in ax[1].lines]  # accept-length histogram
    assert len(shares) == 1 and shares[0] == [0.5, 0.5, 0.0]  # the idle row: no line of zeros


def test_bench_json_has_null_accept_figures_for_a_run_of_no_cycle(tiny_llama_dir, tmp_path):
    """At --max-new-tokens 1 the prefill makes every token: no cycle ran, nothing was drafted;
    the row said accept length 0.00, rate 0.00 and 0 % at every position."""
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--steps", "2",
                 "--num-prompts", "2", "--max-new-tokens", "1", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    base, spec = bench_json(res)["results"]
    assert spec["position_rates"] == [None, None] and spec["reached"] == [0, 0]
    assert spec["mean_accept_length"] is None and spec["accept_rate"] is None
    assert spec["decode_speedup"] is None  # nothing decoded by either: it read 0.00x
    assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / base["tokens_per_s"])
    shown = " ".join(res.output.split())
    assert "0.00x" not in shown and "0%" not in shown
    saved = json.loads((tmp_path / "o" / "bench.json").read_text())["results"][1]
    assert saved["position_rates"] == [None, None]


def phases(cycles: int, **ms: float) -> PhaseSummary:
    full = {"draft": 1.0, "verify": 2.0, "accept": 0.5, "extend": 0.5, **ms}
    return PhaseSummary(cycles, full, {}, sum(full.values()))


def test_merge_phases_takes_every_parts_phases():
    """Keys came from the first part: a refill phase only a later part had was dropped, and one
    only the first part had was a KeyError."""
    plain, refilled = phases(3), phases(1, refill=4.0)
    for parts in ([plain, refilled], [refilled, plain]):
        m = merge_phases(parts, 2.0, 3)
        assert m["cycles"] == 4 and m["ms"]["refill"] == pytest.approx(1.0)  # 4 ms over 4 cycles
        assert m["ms"]["verify"] == pytest.approx(2.0)
        assert m["cycle_ms"] == pytest.approx(5.0) and sum(m["pct"].values()) == pytest.approx(100)


def test_refilled_accept_figures_count_only_rows_that_decoded():
    """The claim: a refilled run's final idle cycle dilutes its accept length. Its cycle count
    does include the cycles launched after the rows ended (the done flags are read one cycle
    late; they cost wall time as any other), but an idle row adds nothing to the histogram or
    the position counts: the accept figures equal the static runs' of the same prompts."""
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.spec_refill import generate_refill
    from draftsmith.engine.speculative import SpecDecoder

    target = tiny_target(vocab=128, seed=1)
    seq = greedy_seq(Runtime(target, len(PROMPTS), 96, graphs=False), PROMPTS, 20)
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.8)
    dec = SpecDecoder(Runtime(target, 1, 96, graphs=False), drafter, 3, 1, None, max_batch=1)
    prompts = PROMPTS[:3]
    static = SpecResult.merged([dec.generate([p], 12, []) for p in prompts])
    refilled = generate_refill(dec, prompts, 12, [], rows=1, check_every=1)
    assert refilled.tokens == static.tokens
    assert refilled.accept_hist == static.accept_hist and refilled.reached == static.reached
    assert refilled.mean_accept_length == static.mean_accept_length > 1
    assert sum(refilled.accept_hist) == static.cycles  # one row: a row-cycle a live cycle
    assert refilled.cycles == static.cycles + len(prompts)  # each end seen a cycle late


@pytest.mark.parametrize("flags", [("--top-k", "20"), ("--top-p", "0.9")])
def test_bench_refuses_sampling_flags_at_temperature_zero(tmp_path, flags):
    res = invoke("--target", str(tmp_path / "never-loaded"), "--drafter", "random", *flags,
                 "--device", "cpu", "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--top-k and --top-p apply to sampling" in str(res.exception)
    ok = invoke("--target", str(tmp_path / "never-loaded"), "--drafter", "random", *flags,
                "--temperature", "0.7", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert "apply to sampling" not in str(ok.exception)  # sampled: on to the (missing) target


def test_bench_refuses_refill_every_without_refill(tmp_path):
    """--refill-every without --refill was accepted and ignored (static batches ran)."""
    res = invoke("--target", str(tmp_path / "never-loaded"), "--drafter", "random",
                 "--refill-every", "2", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "give --refill with it" in str(res.exception)


@pytest.mark.parametrize("flags", [("--top-k", "20"), ("--top-p", "0.9")])
def test_generate_refuses_sampling_flags_at_temperature_zero(tmp_path, flags):
    from draftsmith.cli import app

    res = CliRunner().invoke(app, ["generate", "--target", str(tmp_path / "never-loaded"),
                                   "-p", "hi", *flags, "--device", "cpu"])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--top-k and --top-p apply to sampling" in str(res.exception)


def test_allreduce_bench_on_the_cpu_says_it_is_no_gpu_figure(tmp_path, monkeypatch, capsys):
    """--device cpu times gloo on the host: its table was titled with the NCCL settings as if
    it measured the GPUs' all-reduce, and its JSON line told nothing apart."""
    from draftsmith.bench.allreduce import allreduce_bench

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    # as `python -m draftsmith bench-allreduce` runs it: the record held __main__.py's path
    monkeypatch.setattr("sys.argv", ["/x/draftsmith/__main__.py", "bench-allreduce", "--tp", "1"])
    out = tmp_path / "ar.jsonl"
    allreduce_bench(hidden=64, layers=2, target=None, batch="1", q="1", dtype="fp32", iters=2,
                    graph_ops=2, tp=1, device="cpu", nccl_proto=None, nccl_algo=None,
                    nccl_p2p_level=None, nccl=None, out=out)
    res = json.loads(out.read_text())
    assert res["backend"] == "gloo" and res["smoke_test"] is True
    assert res["command"] == "draftsmith bench-allreduce --tp 1"
    assert "not a GPU" in res["note"]
    assert res["rows"][0]["busbw_GBps"] is None  # one rank moves nothing: it read 0.0 GB/s
    printed = capsys.readouterr()
    title = " ".join(printed.err.split())  # the table's title may wrap
    assert "gloo smoke test, not a GPU figure" in title and "NCCL {" not in title
    assert json.loads(printed.out) == res  # stdout: the JSON line alone, as bench's
    assert "not a GPU" in printed.err
