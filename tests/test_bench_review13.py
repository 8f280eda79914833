"""`draftsmith bench`, thirteenth review: a run that fails midway keeps the rows it timed."""

from __future__ import annotations

import json

import pytest
import torch
from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)

from draftsmith.errors import DraftsmithError

ARGS = ("--num-prompts", "3", "--batch-size", "2", "--max-new-tokens", "4", "--device", "cpu")


def failing_at_steps_two(monkeypatch, error: Exception) -> None:
    from draftsmith.engine.speculative import SpecDecoder

    generate = SpecDecoder.generate

    def generate_or_fail(dec, *a, **k):
        if dec.steps == 2:
            raise error
        return generate(dec, *a, **k)

    monkeypatch.setattr(SpecDecoder, "generate", generate_or_fail)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"),
                                   DraftsmithError("batch 2 exceeds max_batch 1")])
def test_a_run_failing_midway_keeps_the_rows_timed(tiny_llama_dir, drafter_dir,  # noqa: F811
                                                   tmp_path, monkeypatch, error):
    """An out-of-memory tree at the largest batch lost the baseline and every setting timed
    before it: nothing was written."""
    failing_at_steps_two(monkeypatch, error)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir),
                 "--steps", "1,2,3", *ARGS, "--out", str(tmp_path / "o"))
    assert res.exception is error  # raised as it was: a traceback for a bug, one line for ours
    saved = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [r["setting"] for r in saved["results"]] == ["baseline", "chain 1"]
    meta = saved["meta"]
    assert meta["partial"] is True
    assert meta["not_run"] == ["chat batch 2: chain 2", "chat batch 2: chain 3"]
    assert meta["failed"] == {"run": "chat batch 2: chain 2",
                              "error": f"{type(error).__name__}: {error}"}
    assert "failed in chat batch 2: chain 2" in res.stderr
    assert "PARTIAL (failed)" in res.stderr and "interrupted" not in res.stderr
    head = json.loads(res.stdout.strip().splitlines()[-1])
    assert head["partial"] is True and head["failed"] == meta["failed"]
    assert (tmp_path / "o" / "bench.png").exists()


def test_a_suite_shorter_than_num_prompts_is_said_and_recorded(tiny_llama_dir, tmp_path):
    """--num-prompts 5 on a suite of 2 timed 2 without a word (the built-in chat suite has 22:
    --num-prompts 64 read as 64 prompts measured); compare says it, bench did not."""
    from draftsmith.bench.run import BenchConfig, run_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc"}\n{"prompt": "xyz uvw"}\n')
    said: list[str] = []
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1],
                      suites=[str(prompts)], num_prompts=5, max_new_tokens=2)
    rep = run_bench(cfg, log=said.append)
    line = (f"--suite {prompts} has 2 prompts with a user turn, fewer than --num-prompts 5: "
            "all 2 run")
    assert f"warning: {line}" in said and said.index(f"warning: {line}") < said.index(
        "p: batch 1, 2 batches, baseline")  # before the minutes of loading and timing
    assert rep["meta"]["warnings"].count(line) == 1
    assert rep["results"][0]["prompts"] == 2


def sampled_report(temperature: float, seed: int | None) -> dict:
    base = {"suite": "chat", "batch": 1, "setting": "baseline", "prompts": 1,
            "padding_rows": 0, "tokens_per_s": 10.0, "decode_tokens_per_s": 9.0}
    spec = {**base, "setting": "chain 1", "steps": 1, "topk": 1, "num_draft_tokens": 2,
            "speedup": 1.5, "decode_speedup": 1.6, "mean_accept_length": 1.5,
            "accept_rate": 0.75, "accept_hist": [0, 1, 1], "position_rates": [0.5]}
    params = {"temperature": temperature, "top_p": 0.9 if temperature else 1.0, "top_k": 0}
    meta = {"device": "cpu", "dtype": "float32", "params": params, "seed": seed,
            "max_new_tokens": 64}
    return {"meta": meta, "results": [base, spec]}


@pytest.mark.parametrize("temperature, seed, said", [
    (0.7, 3, "sampled: temperature 0.7, top-p 0.9, seed 3"), (0.0, None, "greedy")])
def test_the_table_the_png_and_the_json_line_say_how_tokens_were_chosen(
        tmp_path, monkeypatch, temperature, seed, said):
    """A sampled run's table, plot and JSON line read as a greedy one's (only bench.json's meta
    told them apart): speedups at T=0.7 pasted beside greedy ones."""
    from matplotlib.figure import Figure

    from draftsmith.bench.report import headline, results_table, write_png

    rep = sampled_report(temperature, seed)
    assert f"cpu · float32 · {said} · 64 new tokens" in results_table(rep).title
    line = headline(rep, tmp_path / "bench.json")
    assert line["params"] == rep["meta"]["params"] and line["seed"] == seed
    assert line["max_new_tokens"] == 64
    titles: list[str] = []
    monkeypatch.setattr(Figure, "suptitle", lambda fig, t, **k: titles.append(t))
    write_png(rep, tmp_path / "b.png")
    assert titles and said in titles[0]
