"""bench review 22: MT-bench's and Spec-Bench's question records carry a `category`; bench
reports decode speed and acceptance per category at batch 1 (`by_category`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from test_bench import bench_json, drafter_dir, invoke  # noqa: F401

from draftsmith.bench.report import print_report
from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.bench.suites import suite_messages, suite_prompts
from draftsmith.data.prompts import load_prompts, parse_record

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?"]},
    {"question_id": 83, "category": "writing", "turns": ["Write a poem."]},
    {"question_id": 84, "category": "math", "turns": ["What is 3 * 7?"]},
    # opens as 81 does: asked once, under 81's category
    {"question_id": 85, "category": "math", "turns": ["Write a haiku.", "Count its syllables."]},
]


def question_file(tmp_path: Path, records: list, name: str = "question.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_record_keeps_its_category_and_ignores_one_not_text() -> None:
    got = parse_record(QUESTIONS[0])
    assert got.meta == {"category": "writing"}
    for bad in (3, None, "", "  ", ["writing"]):
        assert parse_record({**QUESTIONS[0], "category": bad}).meta == {}
    plain = parse_record({"turns": QUESTIONS[0]["turns"]})
    assert plain.id == got.id  # ids hash the messages alone


def test_categories_change_no_repeat_dropping(tmp_path: Path) -> None:
    """The same turns under two categories are one repeat, the first kept."""
    path = question_file(tmp_path, [QUESTIONS[1], {**QUESTIONS[1], "category": "other"}])
    read = load_prompts(path)
    assert read.duplicates == 1 and [c.meta for c in read.conversations] == [
        {"category": "math"}]


def test_suite_prompts_keep_each_kept_prompts_category(tmp_path: Path) -> None:
    path = str(question_file(tmp_path, QUESTIONS))
    got = suite_prompts(path, 0)
    assert [m for m, _ in got] == suite_messages(path, 0)
    assert [c for _, c in got] == ["writing", "math", "writing", "math"]
    assert [c for _, c in suite_prompts("chat", 3)] == [None] * 3


@pytest.fixture(scope="module")
def by_cat_report(tiny_llama_dir, tmp_path_factory) -> dict:
    path = question_file(tmp_path_factory.mktemp("q"), QUESTIONS)
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", suites=[str(path), "chat"],
                      steps=[1, 2], num_prompts=4, max_new_tokens=6, batch_sizes=[1, 2])
    return run_bench(cfg, log=lambda s: None)


def test_batch_one_rows_carry_consistent_per_category_figures(by_cat_report) -> None:
    rows = [r for r in by_cat_report["results"] if r["suite"] == "question" and r["batch"] == 1]
    base, *spec = rows
    assert "by_category" not in base and len(spec) == 2
    for row in spec:
        cats = row["by_category"]
        assert [c["category"] for c in cats] == ["writing", "math"]
        assert [c["prompts"] for c in cats] == [2, 2]
        # pooled over categories: the row's own tokens, histogram and cycles
        assert sum(c["new_tokens"] for c in cats) == row["new_tokens"]
        hist = [sum(col) for col in zip(*(c["accept_hist"] for c in cats), strict=True)]
        assert hist == row["accept_hist"] and sum(c["cycles"] for c in cats) == sum(hist)
        pooled = sum(k * n for k, n in enumerate(hist)) / sum(hist)
        assert pooled == pytest.approx(row["mean_accept_length"])
        for c in cats:
            h = c["accept_hist"]
            assert c["mean_accept_length"] == pytest.approx(
                sum(k * n for k, n in enumerate(h)) / sum(h))
            assert c["decode_speedup"] == pytest.approx(
                c["decode_tokens_per_s"] / c["baseline_decode_tokens_per_s"])


def test_batches_of_several_rows_and_suites_without_categories_have_none(by_cat_report):
    for r in by_cat_report["results"]:
        if r["suite"] == "chat" or r["batch"] > 1:
            assert "by_category" not in r
    assert not any("categor" in w for w in by_cat_report["meta"]["warnings"])


def test_the_category_table_follows_the_main_one(by_cat_report, tmp_path, capsys) -> None:
    out = io.StringIO()
    print_report(by_cat_report, Console(file=out, width=250), tmp_path / "bench.json")
    text = out.getvalue()
    assert "by category" in text and "writing" in text and "math" in text
    assert text.index("by category") > text.index("chain 2")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not any("by_category" in r for r in line["results"])  # the JSON line as it was


def test_no_category_table_without_categories(tiny_llama_dir, tmp_path, capsys) -> None:
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1], num_prompts=2,
                      max_new_tokens=4)
    report = run_bench(cfg, log=lambda s: None)
    assert not any("by_category" in r for r in report["results"])
    assert "by_category" not in report["meta"]["definitions"]
    out = io.StringIO()
    print_report(report, Console(file=out, width=250), tmp_path / "bench.json")
    assert "categor" not in out.getvalue()


def test_rounds_pool_per_category_figures(tiny_llama_dir, tmp_path) -> None:
    path = question_file(tmp_path, QUESTIONS[:2])
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", suites=[str(path)],
                      steps=[1], num_prompts=0, max_new_tokens=5, repeats=2)
    report = run_bench(cfg, log=lambda s: None)
    _, row = report["results"]
    cats = row["by_category"]
    assert [(c["category"], c["prompts"]) for c in cats] == [("writing", 1), ("math", 1)]
    hist = [sum(col) for col in zip(*(c["accept_hist"] for c in cats), strict=True)]
    assert hist == row["accept_hist"]  # greedy: round 1's, as the row's
    assert "pooled" in report["meta"]["definitions"]["by_category"]


@pytest.mark.parametrize("refill", [False, True])
def test_batches_or_refill_without_batch_one_say_so_once(tiny_llama_dir, tmp_path, refill):
    path = question_file(tmp_path, QUESTIONS[:2])
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", suites=[str(path)],
                      steps=[1], num_prompts=0, max_new_tokens=4,
                      batch_sizes=[1] if refill else [2], refill=refill)
    report = run_bench(cfg, log=lambda s: None)
    assert not any("by_category" in r for r in report["results"])
    said = [w for w in report["meta"]["warnings"] if "categor" in w]
    assert said == [f"--suite {path}: its prompts carry categories; per-category figures are "
                    "timed at --batch-size 1 without --refill only (a batch mixes categories)"]


def test_the_cli_writes_by_category_to_bench_json(tiny_llama_dir, drafter_dir,  # noqa: F811
                                                  tmp_path) -> None:
    path = question_file(tmp_path, QUESTIONS)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--suite",
                 str(path), "--steps", "1", "--max-new-tokens", "5", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    _, row = bench_json(res)["results"]
    assert [c["category"] for c in row["by_category"]] == ["writing", "math"]
    assert "by category" in res.stderr



def test_sampled_rounds_pool_category_acceptance_as_the_row(tiny_llama_dir, tmp_path) -> None:
    from draftsmith.engine.sampling import SamplingParams

    path = question_file(tmp_path, QUESTIONS[:2])
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", suites=[str(path)],
                      steps=[1], num_prompts=0, max_new_tokens=5, repeats=2,
                      params=SamplingParams(temperature=1.0))
    _, row = run_bench(cfg, log=lambda s: None)["results"]
    hist = [sum(col) for col in zip(*(c["accept_hist"] for c in row["by_category"]),
                                    strict=True)]
    assert hist == row["accept_hist"]  # every round's cycles, as the row pools them
