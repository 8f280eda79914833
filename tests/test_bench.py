"""`draftsmith bench` end to end on a tiny target and a saved drafter (CPU, fp32)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from draftsmith.bench.cli import bench
from draftsmith.bench.drafters import random_drafter
from draftsmith.bench.run import warm_each
from draftsmith.bench.suites import fill_batches, suite_messages
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter, save_drafter
from draftsmith.options import int_list
from draftsmith.targets import load_target


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama_dir, tmp_path_factory):
    t = load_target(tiny_llama_dir)
    d = random_drafter(t.cfg, torch.device("cpu"), torch.float32, seed=3)
    with torch.no_grad():
        d.lm_head.weight.mul_(50)  # some accepted drafts on a target this random
    d.cfg.target_fingerprint = t.fingerprint
    return save_drafter(d, tmp_path_factory.mktemp("drafter") / "d")


def bench_json(res) -> dict:
    """The whole report: bench.json, named by the headline JSON line that ends stdout."""
    line = json.loads(res.stdout.strip().splitlines()[-1])
    return json.loads(Path(line["bench_json"]).read_text())


def invoke(*args: str):
    app = typer.Typer()
    app.command()(bench)
    return CliRunner().invoke(app, list(args), catch_exceptions=True)


def test_bench_writes_table_json_and_png(tiny_llama_dir, drafter_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc def"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    res = invoke(
        "--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--suite", "chat",
        "--suite", str(prompts), "--num-prompts", "3", "--steps", "1,2", "--topk", "1,2",
        "--num-draft-tokens", "4", "--batch-size", "1,2", "--max-new-tokens", "6",
        "--device", "cpu", "--profile", "--out", str(tmp_path / "out"),
    )
    assert res.exit_code == 0, res.output
    report = bench_json(res)
    rows = report["results"]
    assert len(rows) == 2 * 2 * (1 + 3)  # suites x batches x (baseline + 3 settings)
    assert [(r["suite"], r["batch"]) for r in rows[::4]] == [
        ("chat", 1), ("chat", 2), ("p", 1), ("p", 2)]  # as given, batches smallest first
    assert [r["setting"] for r in rows[:4]] == ["baseline", "chain 1", "chain 2", "tree 2/2/4"]
    spec = [r for r in rows if r["setting"] != "baseline"]
    assert {r["setting"] for r in spec} == {"chain 1", "chain 2", "tree 2/2/4"}
    base = {(r["suite"], r["batch"]): r for r in rows if r["setting"] == "baseline"}
    for r in spec:
        assert r["agreement"]["identical"] == r["agreement"]["prompts"]  # fp32 greedy
        b = base[(r["suite"], r["batch"])]
        assert r["decode_speedup"] == pytest.approx(
            r["decode_tokens_per_s"] / b["decode_tokens_per_s"])
        assert r["phases"]["cycles"] > 0 and r["mean_accept_length"] >= 1
        assert 0 < sum(r["accept_hist"]) <= r["phases"]["cycles"] * r["batch"]
    assert "target verify" in res.output and "speedup" in res.output
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["results"] == rows
    assert (tmp_path / "out" / "bench.png").stat().st_size > 10_000


def test_bench_keeps_suites_that_share_a_file_name(tiny_llama_dir, drafter_dir, tmp_path):
    """a/p.jsonl and b/p.jsonl were both reported as "p": the second's rows replaced the
    first's; a batch size given twice ran (and was reported) twice."""
    for sub, text in (("a", "abc"), ("b", "xyz uvw")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "p.jsonl").write_text(f'{{"prompt": "{text}"}}\n')
    a, b = str(tmp_path / "a" / "p.jsonl"), str(tmp_path / "b" / "p.jsonl")
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--suite", a,
                 "--suite", b, "--suite", "chat", "--num-prompts", "1", "--steps", "1",
                 "--batch-size", "1,1", "--max-new-tokens", "3", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    rows = bench_json(res)["results"]
    assert [(r["suite"], r["setting"]) for r in rows] == [
        (a, "baseline"), (a, "chain 1"), (b, "baseline"), (b, "chain 1"),
        ("chat", "baseline"), ("chat", "chain 1")]


def test_bench_times_unprofiled_runs_and_profiles_a_second(tiny_llama_dir, drafter_dir, tmp_path,
                                                           monkeypatch):
    """--profile (or DRAFTSMITH_PROFILE=1) timed the profiled runs, whose cycles each read their
    done flag at once: a host sync a cycle in the speculative tok/s and speedup alone."""
    from draftsmith.engine import spec_refill
    from draftsmith.engine.speculative import SpecDecoder

    seen: list[tuple[str, int, bool]] = []

    def spy(kind, fn):
        def wrapped(dec, prompts, max_new, *a, **k):
            seen.append((kind, max_new, bool(dec.profile)))
            return fn(dec, prompts, max_new, *a, **k)
        return wrapped

    monkeypatch.setattr(SpecDecoder, "generate", spy("static", SpecDecoder.generate))
    monkeypatch.setattr(spec_refill, "generate_refill", spy("refill", spec_refill.generate_refill))
    args = ("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--num-prompts", "2",
            "--steps", "2", "--max-new-tokens", "9", "--device", "cpu", "--profile")
    for extra in ((), ("--refill",)):
        res = invoke(*args, *extra, "--out", str(tmp_path / "o"))
        assert res.exit_code == 0, (res.output, res.exception)
        assert bench_json(res)["results"][1]["phases"]["cycles"]
    timed = [(kind, prof) for kind, new, prof in seen if new == 9]
    assert timed == [("static", False), ("static", False), ("static", True), ("static", True),
                     ("refill", False), ("refill", True)]


def test_bench_trees_of_any_shape_get_their_frontier_slots(tiny_llama_dir, drafter_dir,
                                                           tmp_path):
    """A setting is (steps, topk, tokens): a one-depth tree of top 4 runs, and the drafter's
    cache holds (steps - 1) * topk frontier slots beyond the sequence (4/2/6: 6, not 4)."""
    from draftsmith.bench.run import BenchConfig, _runtimes

    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "1",
                 "--topk", "4", "--num-draft-tokens", "1,3", "--num-prompts", "2",
                 "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    rows = bench_json(res)["results"]
    assert [r["setting"] for r in rows] == ["baseline", "tree 1/4/3"]  # tokens 1: no tree
    model = load_target(tiny_llama_dir).build(torch.float32, "cpu")
    drafter = load_drafter(drafter_dir, "cpu", torch.float32)
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter=str(drafter_dir), steps=[4], topk=[2],
                      num_draft_tokens=[6], max_new_tokens=4, device="cpu")
    rt, drt = _runtimes(model, drafter, {"s": [[1, 2, 3]]}, cfg, cfg.settings())
    assert drt.max_seq - rt.max_seq == (4 - 1) * 2


def test_bench_bad_input_is_a_clear_error(tiny_llama_dir, tmp_path):
    res = invoke("--target", str(tiny_llama_dir), "--device", "cpu", "--out", str(tmp_path))
    assert isinstance(res.exception, DraftsmithError) and "--drafter" in str(res.exception)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--topk", "2",
                 "--device", "cpu", "--out", str(tmp_path))
    assert isinstance(res.exception, DraftsmithError) and "num-draft-tokens" in str(res.exception)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--num-prompts", "-1",
                 "--device", "cpu", "--out", str(tmp_path))
    assert isinstance(res.exception, DraftsmithError) and "--num-prompts" in str(res.exception)
    (tmp_path / "taken").write_text("x")
    res = invoke("--target", str(tmp_path / "never-loaded"), "--drafter", "random",
                 "--device", "cpu", "--out", str(tmp_path / "taken"))
    assert isinstance(res.exception, DraftsmithError)
    assert "is a file, not a folder" in str(res.exception)
    with pytest.raises(DraftsmithError):
        int_list("1,x", "--steps")
    with pytest.raises(DraftsmithError):
        int_list("0,2", "--steps")


def test_bench_refuses_a_drafter_for_another_target_before_timing_anything(drafter_dir,
                                                                          tmp_path):
    """A drafter whose hidden size is not the target's is refused before the baseline runs (it
    used to fail only at the first speculative setting, after the baseline's timings)."""
    from conftest import write_tiny_folder

    wider = write_tiny_folder(tmp_path / "wider", hidden_size=96)
    res = invoke("--target", str(wider), "--drafter", str(drafter_dir), "--num-prompts", "1",
                 "--max-new-tokens", "4", "--steps", "1", "--device", "cpu",
                 "--out", str(tmp_path / "out"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "hidden 64" in str(res.exception) and "hidden 96" in str(res.exception)
    assert "baseline" not in res.output and not (tmp_path / "out").exists()


def test_suites_and_batches():
    assert len(suite_messages("chat", 0)) >= 20
    he = suite_messages("humaneval", 2)
    assert len(he) == 2 and "def " in he[0][-1]["content"]
    assert fill_batches([[1], [2], [3]], 2) == [[[1], [2]], [[3], [1]]]
    assert fill_batches([[1]], 3) == [[[1], [1], [1]]]


def test_warm_each_runs_every_distinct_batch_once():
    calls = []
    batches = [[[1, 2]], [[3]], [[1, 2]], [[3, 4, 5]], [[3]]]
    assert warm_each(calls.append, batches) == 3
    assert calls == [[[1, 2]], [[3]], [[3, 4, 5]]]  # first-seen order, repeats skipped


def test_progress_plot_reads_each_runs_decode_only_heading():
    """benchmarks/progress_plot.py: one point per run heading that states a decode-only figure,
    in run order, whatever order the file lists them; headings without one are left out."""
    mod = load_benchmark("progress_plot")
    md = """# x
## Run 9 (2026-12-02, 01:00 UTC): more; decode-only 2.61x at batch 1
text decode-only 9.99x
## Run 3 (2026-11-30): whole generation 1.30x
## Run 4 (2026-12-01, 02:46 UTC): decode-only speedups at most 1.10x; prefill
## Run 12 (2026-12-02, 00:22 UTC): the baseline 21-26 % faster; decode-only 1.82x at batch 1
the baseline 5 % faster
"""
    assert mod.runs(md) == [(4, "2026-12-01", 1.10), (9, "2026-12-02", 2.61),
                            (12, "2026-12-02", 1.82)]
    assert mod.rebased(md) == {12: "21-26 %"}


def suite_json(path, rows: list[tuple]) -> str:
    """A gpu_suite.json of the spec stage: rows (suite, batch, setting, decode tok/s, draft ms,
    accepted a cycle) as the suite writes them (no phases for a baseline)."""
    out = []
    for suite, batch, setting, tps, draft, acc in rows:
        r = {"suite": suite, "batch": batch, "setting": setting, "tok_s": tps * 0.97,
             "decode_tok_s": tps}
        if not setting.startswith("baseline"):
            r |= {"accept_length": acc, "wall_cycle_ms": draft + 1.0,
                  "phases": {"ms": {"draft": draft, "verify": 0.93}}}
        out.append(r)
    path.write_text(json.dumps({"device": "x", "torch": "y", "date": "z",
                                "spec": {"result": {"new_tokens": 8, "rows": out}}}))
    return str(path)


def test_ab_report_sets_shared_rows_side_by_side_with_each_runs_own_baseline(tmp_path, capsys):
    """benchmarks/ab_report.py: the rows both files hold, baseline first; speedups over each
    file's own baseline, ratios to the first file; a row only one file has is left out; a file
    without spec rows, or a pair with no baseline to divide by, is a clear error."""
    mod = load_benchmark("ab_report")
    a = suite_json(tmp_path / "a.json", [("chat", 1, "7/4/24", 2676, 0.469, 4.22),
                                         ("chat", 1, "baseline", 1415, 0, 0),
                                         ("chat", 1, "3/4/8", 2400, 0.2, 3.0)])
    b = suite_json(tmp_path / "b.json", [("chat", 1, "baseline", 1409, 0, 0),
                                         ("chat", 1, "7/4/24", 2774, 0.415, 4.22)])
    mod.main([f"cublas={a}", f"triton={b}", "--out", str(tmp_path / "o")])
    lines = (tmp_path / "o" / "ab.md").read_text().splitlines()
    assert "cublas / triton" in lines[0] and len(lines) == 4  # head, rule, baseline, 7/4/24
    assert lines[2].startswith("| chat | 1 | baseline | 1,415 / 1,409 |")
    want = ("| chat | 1 | 7/4/24 | 2,676 / 2,774 | 1.89x / 1.97x | 1.037 | 1.469 / 1.415 | "
            "0.469 / 0.415 | 0.930 / 0.930 | 4.22 / 4.22 |")
    assert lines[3] == want
    assert (tmp_path / "o" / "ab.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text(json.dumps({"device": "x"}))
    with pytest.raises(SystemExit, match="no spec stage rows"):
        mod.load_rows(tmp_path / "bad.json")
    lone = suite_json(tmp_path / "c.json", [("chat", 1, "7/4/24", 2700, 0.4, 4.2)])
    with pytest.raises(SystemExit, match="no shared speculative row has a baseline"):
        mod.main([f"a={a}", f"c={lone}", "--out", str(tmp_path / "o2")])
    assert "2,774" in capsys.readouterr().out


def test_sampled_rows_divide_by_the_baseline_sampled_alike(tmp_path, monkeypatch):
    """gpu_suite's SPEC_TEMPS rows ("7/4/24 T0.7" beside "baseline T0.7"): ab_report divides
    each by the baseline of its own temperature, suite_report plots chains per temperature,
    and gpu_suite reads the list (0 = greedy) with one top-p, refusing a bad temperature."""
    ab, sr = load_benchmark("ab_report"), load_benchmark("suite_report")
    rows = [("chat", 1, "baseline", 1400, 0, 0), ("chat", 1, "7/4/24", 2800, 0.42, 4.2),
            ("chat", 1, "baseline T0.7", 1000, 0, 0), ("chat", 1, "7/4/24 T0.7", 2500, 0.5, 3.4),
            ("chat", 1, "3/1/4 T0.7", 1500, 0.15, 2.5)]
    a = suite_json(tmp_path / "a.json", rows)
    b = suite_json(tmp_path / "b.json", rows)
    ab.main([f"x={a}", f"y={b}", "--out", str(tmp_path / "o")])
    lines = (tmp_path / "o" / "ab.md").read_text().splitlines()
    assert [ln.split(" | ")[2] for ln in lines[2:]] == [
        "baseline", "7/4/24", "baseline T0.7", "3/1/4 T0.7", "7/4/24 T0.7"]
    assert "| 2.00x / 2.00x |" in lines[3] and "| 2.50x / 2.50x |" in lines[6]
    assert [k[2] for k in ab.plotted([ab.load_rows(tmp_path / "a.json")])] == [
        "7/4/24", "3/1/4 T0.7", "7/4/24 T0.7"]
    res = json.loads((tmp_path / "a.json").read_text())
    for r in res["spec"]["result"]["rows"]:
        r["temperature"] = 0.7 if "T0.7" in r["setting"] else 0.0
    (tmp_path / "a.json").write_text(json.dumps(res))
    sr.plot(res["spec"]["result"]["rows"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    monkeypatch.setenv("DEVICE", "cpu")  # gpu_suite names its device at import
    gs = load_benchmark("gpu_suite")
    assert [p.temperature for p in gs.spec_params()] == [0.0]
    monkeypatch.setenv("SPEC_TEMPS", "0+0.7")
    monkeypatch.setenv("SPEC_TOP_P", "0.9")
    got = gs.spec_params()
    assert [(p.temperature, p.top_p, p.greedy) for p in got] == [(0.0, 0.9, True),
                                                                (0.7, 0.9, False)]
    monkeypatch.setenv("SPEC_TEMPS", "-1")
    from draftsmith.errors import DraftsmithError
    with pytest.raises(DraftsmithError, match="temperature must be >= 0"):
        gs.spec_params()


def load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_autotune_diff_names_the_kernels_two_caches_picked_differently(tmp_path):
    """benchmarks/autotune_diff.py: each kernel's pick is found where inductor's own key function
    puts it; picks that differ only in timing are the same pick; untuned kernels are left out."""
    import json

    mod = load_benchmark("autotune_diff")

    def cache(name: str, picks: dict[str, dict | None]):
        root = tmp_path / name
        for i, (kernel, pick) in enumerate(picks.items()):
            src = root / f"c{i}" / f"c{i}hash.py"
            src.parent.mkdir(parents=True)
            src.write_text(f"import triton\n\ndef {kernel}(in_ptr0, xnumel):\n    pass\n")
            if pick is not None:
                mod.best_config_path(src).write_text(json.dumps(pick))
        return mod.collect(root)

    a = cache("a", {"triton_red_fused_softmax_0": {"XBLOCK": 1, "R0_BLOCK": 1024, "num_warps": 8,
                                                   "time_taken_ms": 3},
                    "triton_poi_fused_add_1": {"XBLOCK": 128, "num_warps": 4, "time_taken_ms": 1},
                    "triton_per_fused_norm_2": None})
    b = cache("b", {"triton_red_fused_softmax_0": {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16,
                                                   "time_taken_ms": 5},
                    "triton_poi_fused_add_1": {"XBLOCK": 128, "num_warps": 4, "time_taken_ms": 9},
                    "triton_per_fused_norm_2": None})
    assert sorted(v["kernel"] for v in a.values()) == ["triton_poi_fused_add_1",
                                                       "triton_red_fused_softmax_0"]
    rows = mod.diff(a, b)
    assert rows == [("triton_red_fused_softmax_0", {"XBLOCK": 1, "R0_BLOCK": 1024, "num_warps": 8},
                     {"XBLOCK": 1, "R0_BLOCK": 2048, "num_warps": 16})]
    assert "2 and 2 tuned kernels, 2 in both, 1 picked differently" in mod.show(a, b, rows)


def test_autotune_diff_finds_picks_under_other_torch_namings(tmp_path):
    """H200 run 11's torch named picks without `_make_local_cache_key`: a pick beside its source
    (older inductor), one named by `_prepare_key` alone, and one lone pick in a folder with one
    kernel are all attributed; a pick nobody's source explains is kept as "?", and a graph
    wrapper's embedded kernel sources name nothing. The raw archive skips wrappers."""
    import json
    import tarfile

    from torch._inductor.runtime.autotune_cache import AutotuneCache

    mod = load_benchmark("autotune_diff")
    root = tmp_path / "cache"
    names = {"triton_a_0": lambda src: src.with_suffix(".best_config"),
             "triton_b_1": lambda src: src.parent / f"{AutotuneCache._prepare_key(str(src))}"
                                                    ".best_config",
             "triton_c_2": lambda src: src.parent / "zz.best_config"}
    for i, (kernel, where) in enumerate(names.items()):
        src = root / f"d{i}" / f"c{i}hash.py"
        src.parent.mkdir(parents=True)
        src.write_text(f"def {kernel}(x):\n    pass\n")
        where(src).write_text(json.dumps({"XBLOCK": i, "time_taken_ms": 1.0}))
    (root / "orphan").mkdir()
    (root / "orphan" / "q.best_config").write_text(json.dumps({"XBLOCK": 9}))
    wrapper = root / "w" / "cwrap.py"  # a graph's wrapper embeds kernel sources: not a kernel
    wrapper.parent.mkdir()
    wrapper.write_text('k = async_compile.triton("k", """\ndef triton_a_0(x):\n    pass\n""")\n')
    (root / "w" / "w.best_config").write_text(json.dumps({"XBLOCK": 7}))
    picks = mod.collect(root)
    assert sorted(v["kernel"] for v in picks.values()) == ["?", "?", *names]
    assert {v["kernel"]: v["config"] for v in picks.values()}["triton_b_1"] == {"XBLOCK": 1}
    other = {h: {"kernel": "triton_x", "config": {"XBLOCK": -1}} for h in picks}
    assert {k for k, _, _ in mod.diff(picks, other)} == {"triton_x", *names}  # "?": B's name
    assert mod.archive(root, tmp_path / "raw.tgz") == 8  # 5 picks, 3 kernel files, no wrapper
    with tarfile.open(tmp_path / "raw.tgz") as tgz:
        assert "w/cwrap.py" not in tgz.getnames() and "orphan/q.best_config" in tgz.getnames()
    assert mod.archive(root, tmp_path / "small.tgz", cap=40) < 8  # the cap leaves files out


def test_autotune_split_names_the_kernel_whose_pick_separates_fast_from_slow(tmp_path, capsys):
    """H200 run 12: across processes, only the kernel whose fast runs and slow runs never picked
    alike is named; a pick shared by a fast and a slow run, a kernel some run lacks, and an
    unattributed "?" are left out. The command line reads json files split by `--`."""
    import json

    mod = load_benchmark("autotune_diff")

    def run(i: int, attn: int, noise: int, extra: bool = False) -> dict:
        picks = {f"h{i}a": {"kernel": "triton_per_attn_4", "config": {"XBLOCK": attn}},
                 f"h{i}b": {"kernel": "triton_poi_copy_9", "config": {"XBLOCK": noise}},
                 f"h{i}c": {"kernel": "?", "config": {"XBLOCK": i}}}
        if extra:
            picks[f"h{i}d"] = {"kernel": "triton_poi_only_here", "config": {"XBLOCK": i}}
        return picks

    fast = [run(0, 8, 128, extra=True), run(1, 32, 256)]
    slow = [run(2, 1, 256), run(3, 1, 128, extra=True)]
    twice = run(5, 8, 512)  # a name tuned twice in one run: both picks count
    twice["h5e"] = {"kernel": "triton_poi_copy_9", "config": {"XBLOCK": 64}}
    assert mod.split([twice], [run(6, 1, 64)]) == [("triton_per_attn_4", [{"XBLOCK": 8}],
                                                    [{"XBLOCK": 1}])]
    assert mod.split(fast, slow) == [("triton_per_attn_4", [{"XBLOCK": 8}, {"XBLOCK": 32}],
                                      [{"XBLOCK": 1}, {"XBLOCK": 1}])]
    assert mod.split(fast, [run(4, 32, 1)]) == [("triton_poi_copy_9", [{"XBLOCK": 128},
                                                                       {"XBLOCK": 256}],
                                                 [{"XBLOCK": 1}])]
    paths = []
    for i, r in enumerate(fast + slow):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert mod.main(["split", *map(str, paths[:2]), "--", *map(str, paths[2:])]) == 0
    out = capsys.readouterr().out
    assert "triton_per_attn_4" in out and "triton_poi_copy_9" not in out
    assert mod.main(["split", str(paths[0])]) == 2  # no "--": the usage


def test_bench_refill_decodes_every_prompt_as_the_static_batches_do(tiny_llama_dir, drafter_dir,
                                                                    tmp_path):
    args = ("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--suite", "chat",
            "--num-prompts", "5", "--steps", "2", "--topk", "1,2", "--num-draft-tokens", "4",
            "--batch-size", "2", "--max-new-tokens", "6", "--device", "cpu")
    static = invoke(*args, "--out", str(tmp_path / "s"))
    refill = invoke(*args, "--refill", "--profile", "--out", str(tmp_path / "r"))
    assert static.exit_code == 0 and refill.exit_code == 0, refill.output
    out = {k: bench_json(r)
           for k, r in (("static", static), ("refill", refill))}
    assert [out[k]["meta"]["refill"] for k in ("static", "refill")] == [False, True]
    rows = {k: v["results"] for k, v in out.items()}
    assert [r["setting"] for r in rows["refill"]] == ["baseline", "chain 2", "tree 2/2/4"]
    for s, r in zip(rows["static"], rows["refill"], strict=True):
        assert r["new_tokens"] == s["new_tokens"]  # the same prompts, the same greedy answers
        if r["setting"] != "baseline":
            assert r["refill"] and r["phases"]["ms"]["refill"] > 0  # profiled: refills timed
            assert r["agreement"]["identical"] == r["agreement"]["prompts"] == 5  # padding left out
    assert (tmp_path / "r" / "bench.png").stat().st_size > 10_000
    assert "refill (harvest, prefill)" in refill.output  # the fastest row's phase table
    bad = invoke(*args, "--refill", "--refill-every", "-1", "--out", str(tmp_path / "b"))
    assert "--refill-every must be >= 0" in str(bad.exception)  # before any model is built


def test_adaptive_depth_replay_credits_the_cut_path_and_prices_each_depth():
    """benchmarks/adaptive_depth.py: a cycle at depth d yields min(tokens - 1, d) + 1 and costs
    the base cycle less (base - d) depths; the switched policy reads the last replayed cycle."""
    mod = load_benchmark("adaptive_depth")
    seqs = [[8, 1, 3], [2]]
    tpc, tpms = mod.replay(seqs, lambda _: 7, 7, 1.0, 0.1)
    assert (tpc, tpms) == (14 / 4, 14 / 4.0)
    tpc, tpms = mod.replay(seqs, lambda _: 2, 7, 1.0, 0.1)  # 3 + 1 + 3 + 2, each 0.5 ms
    assert tpc == 9 / 4 and abs(tpms - 9 / 2.0) < 1e-12
    pol = mod.switched(2, 4, 7, 1, 3, first=7)  # <=1 token: 2; >3: 7; else 4
    assert [pol(x) for x in (None, 1, 2, 3, 4, 8)] == [7, 2, 4, 4, 7, 7]
    _, tpms = mod.replay([[8, 1, 8, 8]], pol, 7, 1.0, 0.1)  # depths 7, 7, 2, 4: 8+1+3+5
    assert abs(tpms - 17 / 3.2) < 1e-12
    res = mod.study({"chat": [[8, 1, 8, 8]], "humaneval": [[2, 2, 8]]}, 7, 7, 1.0, 0.1)
    assert res["suites"]["chat"]["fixed"][7] == 1.0
    assert res["suites"]["chat"]["after"][8] == {"n": 2, "mean_next": 4.5, "p_next_full": 0.5}


def test_decode_rate_leaves_out_the_tokens_prefill_made(tiny_llama_dir, drafter_dir, tmp_path):
    """A row's first token comes from its prefill: at --max-new-tokens 1 nothing is decoded,
    and a row that ended at once (no token) takes nothing off."""
    from draftsmith.bench.run import _speed

    assert _speed([[1, 2, 3], [], [4]], 2.0, 0.5) == {
        "new_tokens": 4, "seconds": 2.0, "tokens_per_s": 2.0, "decode_tokens_per_s": 4.0}
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "2",
                 "--num-prompts", "2", "--max-new-tokens", "1", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    rows = bench_json(res)["results"]
    assert [r["new_tokens"] for r in rows] == [2, 2]
    assert [r["decode_tokens_per_s"] for r in rows] == [0.0, 0.0]


def test_allreduce_bench_checks_its_out_file_before_measuring(tmp_path, monkeypatch, capsys):
    """An --out folder (or one under a file) was an IsADirectoryError after the whole run; a
    missing parent folder a FileNotFoundError: both lost the measured line."""
    from draftsmith.bench import allreduce

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # restored after the command sets it
    kw = dict(hidden=64, layers=2, target=None, batch="1", q="1", dtype="fp32", iters=2,
              graph_ops=2, tp=1, device="cpu", nccl_proto=None, nccl_algo=None,
              nccl_p2p_level=None, nccl=None)
    (tmp_path / "f").write_text("x")
    runs, launch = [], allreduce.launch_tp
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: runs.append(1) or launch(*a, **k))
    for out, said in ((tmp_path, "is a folder"), (tmp_path / "f" / "a.jsonl", "under the file")):
        with pytest.raises(DraftsmithError, match=said):
            allreduce.allreduce_bench(**kw, out=out)
    assert not runs
    out = tmp_path / "new" / "ar.jsonl"
    allreduce.allreduce_bench(**kw, out=out)
    assert runs and json.loads(out.read_text())["rows"][0]["batch"] == 1


def test_allreduce_bench_puts_the_environment_back(tmp_path, monkeypatch):
    """The NCCL settings it is given reach its ranks, and leave the caller's environment as it
    was (they stayed set in a Python caller for every later run)."""
    from draftsmith.bench import allreduce

    for name in ("RANK", "WORLD_SIZE", "NCCL_PROTO", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    launch = allreduce.launch_tp
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: seen.append(
        os.environ.get("NCCL_PROTO")) or launch(*a, **k))
    allreduce.allreduce_bench(hidden=64, layers=2, target=None, batch="1", q="1", dtype="fp32",
                              iters=2, graph_ops=2, tp=1, device="cpu", nccl_proto="Simple",
                              nccl_algo=None, nccl_p2p_level=None, nccl=None,
                              out=tmp_path / "ar.jsonl")
    assert seen == ["Simple"]
    assert "NCCL_PROTO" not in os.environ and "NCCL_NVLS_ENABLE" not in os.environ
