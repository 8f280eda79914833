"""`draftsmith bench`, eighteenth review: the table, the JSON line and bench.json carry the same
figures; a tree's per-position acceptance counts a position past an accepted node only where
that node has a child; the histogram sums to the row-cycles; mixed suites; seeded sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf_model

from draftsmith.bench.drafters import random_drafter
from draftsmith.bench.report import headline, results_table
from draftsmith.bench.run import BenchConfig, run_bench, short_suites
from draftsmith.bench.suites import suite_messages
from draftsmith.engine.sampling import SamplingParams
from draftsmith.measured import figure
from draftsmith.models.eagle3 import save_drafter
from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import write_byte_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A target whose head is zero (greedy: always token 0) and a drafter of zero head whose
    draft ids 0 and 1 read target tokens 1 and 0: a tree's depth-2 nodes hang under draft 0,
    so the accepted depth-1 node (draft 1) is a leaf in 3/3/6 and has a child in 3/3/8."""
    root = tmp_path_factory.mktemp("pair")
    m = tiny_hf_model()
    with torch.no_grad():
        m.lm_head.weight.zero_()
    m.save_pretrained(root / "t")
    write_byte_tokenizer(root / "t", vocab_size=128)
    t = load_target(root / "t")
    d = random_drafter(t.cfg, torch.device("cpu"), torch.float32, seed=3)
    with torch.no_grad():
        d.lm_head.weight.zero_()
    d2t = torch.zeros(128, dtype=torch.long)
    d2t[0], d2t[1] = 1, -1
    d.set_vocab(d2t, torch.ones(128, dtype=torch.bool))
    d.cfg.target_fingerprint = t.fingerprint
    return root / "t", save_drafter(d, root / "d")


@pytest.fixture(scope="module")
def greedy_report(pair) -> dict:
    cfg = BenchConfig(target=str(pair[0]), drafter=str(pair[1]), steps=[3], topk=[1, 3],
                      num_draft_tokens=[6, 8], num_prompts=2, max_new_tokens=12,
                      batch_sizes=[2])
    return run_bench(cfg, log=lambda s: None)


def by_setting(report: dict) -> dict[str, dict]:
    return {r["setting"]: r for r in report["results"]}


def test_a_tree_position_counts_only_past_an_accepted_node_with_a_child(greedy_report):
    rows = by_setting(greedy_report)
    leaf, kid = rows["tree 3/3/6"], rows["tree 3/3/8"]
    n = leaf["reached"][0]
    assert n > 0 and leaf["accepted"] == [n, 0, 0] and leaf["reached"] == [n, 0, 0]
    assert leaf["position_rates"] == [1.0, None, None]  # unreached, not rejected
    assert kid["reached"][:2] == [n, n] and kid["accepted"][:2] == [n, 0]
    assert kid["position_rates"][:2] == [1.0, 0.0]
    chain = rows["chain 3"]  # draft 0 reads token 1: the target's 0 rejects it
    assert chain["accepted"] == [0, 0, 0] and chain["position_rates"] == [0.0, None, None]


def test_the_histogram_sums_to_the_row_cycles_and_gives_the_accept_length(greedy_report):
    for r in greedy_report["results"][1:]:
        h = r["accept_hist"]
        assert sum(h) == r["reached"][0] > 0 and h[0] == 0
        made, decoded = sum(k * c for k, c in enumerate(h)), r["new_tokens"] - 2  # 2 rows
        # the prefill makes each row's first token; a cycle max_new cuts is counted whole
        assert decoded <= made < decoded + 2 * (r["steps"] + 1)
        assert r["mean_accept_length"] == pytest.approx(
            sum(k * c for k, c in enumerate(h)) / sum(h))
        assert r["accept_rate"] == pytest.approx(r["mean_accept_length"] / (r["steps"] + 1))
        for i in range(1, len(r["reached"])):  # reached past i only through an accept at i
            assert r["accepted"][i] <= r["reached"][i] <= r["accepted"][i - 1]


def cells(report: dict) -> list[dict[str, str]]:
    t = results_table(report)
    cols = {str(c.header): list(c._cells) for c in t.columns}
    return [{k: v[i] for k, v in cols.items()} for i in range(len(report["results"]))]


def test_the_table_the_json_line_and_bench_json_show_one_set_of_figures(greedy_report,
                                                                         tmp_path):
    rows = greedy_report["results"]
    line = headline(greedy_report, tmp_path / "bench.json")
    heads = {h["setting"]: h for h in line["results"]}
    for row, shown in zip(rows, cells(greedy_report), strict=True):
        assert shown["setting"] == row["setting"]
        assert shown["tok/s"] == f"{row['tokens_per_s']:.1f}"
        if row["setting"] == "baseline":
            continue
        head = heads[row["setting"]]
        for key in ("tokens_per_s", "speedup", "decode_speedup", "mean_accept_length"):
            assert head[key] == row[key]
        assert head["baseline_tokens_per_s"] == rows[0]["tokens_per_s"]
        assert shown["speedup"] == f"{row['speedup']:.2f}x"
        assert shown["decode speedup"] == f"{row['decode_speedup']:.2f}x"
        assert shown["accept len"] == f"{row['mean_accept_length']:.2f}"
        assert shown["len/max"] == f"{row['accept_rate']:.2f}"
        rates = row["position_rates"]
        assert [shown[f"p{i + 1}"] for i in range(3)] == [figure(x, ".0%") for x in rates]
        a = row["agreement"]
        assert shown["same"] == f"{a['identical']}/{a['prompts']}" == "2/2"


def test_a_suite_file_mixing_chat_records_and_plain_prompts(tmp_path):
    p = tmp_path / "mix.jsonl"
    recs = [{"prompt": "plain"},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "later"}]},
            {"messages": [{"role": "user", "content": "u"}]},
            {"messages": [{"role": "user", "content": "u"},
                          {"role": "assistant", "content": "other"}]},  # opens as the one above
            {"text": "no prompt field"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    skipped: list[str] = []
    got = suite_messages(str(p), 0, skipped.append)
    assert got == [[{"role": "user", "content": "plain"}],
                   [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                   [{"role": "user", "content": "u"}]]
    assert len(skipped) == 1 and ":5:" in skipped[0]
    assert short_suites({"mix": got}, 5) == [
        "--suite mix has 3 prompts with a user turn, fewer than --num-prompts 5: all 3 run"]
    assert short_suites({"mix": got}, 3) == short_suites({"mix": got}, 0) == []
    assert suite_messages(str(p), 2, skipped.append) == got[:2]


def test_a_seeded_sampled_bench_repeats_its_draws(pair, monkeypatch):
    from draftsmith.engine.speculative import SpecDecoder

    generate, drawn = SpecDecoder.generate, []

    def kept(dec, *a, **k):
        out = generate(dec, *a, **k)
        drawn.append(out.tokens)
        return out

    monkeypatch.setattr(SpecDecoder, "generate", kept)

    def once(seed: int) -> tuple[list, list]:
        drawn.clear()
        cfg = BenchConfig(target=str(pair[0]), drafter=str(pair[1]), steps=[2], topk=[1, 2],
                          num_draft_tokens=[3], num_prompts=2, max_new_tokens=8,
                          batch_sizes=[2], params=SamplingParams(temperature=0.7), seed=seed)
        rep = run_bench(cfg, log=lambda s: None)
        assert rep["meta"]["seed"] == seed
        return list(drawn), [(r["setting"], r["new_tokens"], r.get("accept_hist"),
                              r.get("reached"), r.get("accepted")) for r in rep["results"]]

    first = once(7)
    assert once(7) == first
    assert once(8)[0] != first[0]  # the seed is what fixes them


def test_the_png_plots_the_reports_own_figures(greedy_report, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from draftsmith.bench.report import fastest, write_png

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)
    write_png(greedy_report, tmp_path / "bench.png")
    speed, hist, pos = figs[0].axes[:3]
    spec = greedy_report["results"][1:]
    [bars] = speed.containers
    assert [p.get_height() for p in bars.patches] == pytest.approx([r["speedup"] for r in spec])
    [best] = fastest(greedy_report)
    h = best["accept_hist"]
    [line] = hist.lines
    assert list(line.get_ydata()) == pytest.approx([c / sum(h) for c in h[1:]])
    [line] = pos.lines
    rates = [float("nan") if x is None else x for x in best["position_rates"]]
    assert list(line.get_ydata()) == pytest.approx(rates, nan_ok=True)
