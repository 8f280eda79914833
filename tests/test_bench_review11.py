"""Review of `draftsmith bench`'s figures: a suite's shared first turns asked once, sampled rows
seeded each on their own, and refilled rows without a decode-only rate under a decode label."""

from __future__ import annotations

import pytest
import torch
from test_bench_review import report_of, spec_row

import draftsmith.bench.run as bench_run
from draftsmith.bench.report import headline, notes, results_table
from draftsmith.bench.run import BenchConfig, _over, _refilled_speed, run_bench
from draftsmith.bench.suites import suite_messages
from draftsmith.engine.sampling import SamplingParams
from draftsmith.errors import DraftsmithError


def test_a_first_turn_that_conversations_share_is_asked_once(tmp_path):
    """Conversations differing only after their first turn opened alike: the reader drops only
    whole repeats, so one prompt was timed twice and --num-prompts left another out."""
    p = tmp_path / "p.jsonl"
    p.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}\n'
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}\n'
        '{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}\n'
        '{"prompt": "yo"}\n')
    hi, sys_hi, yo = ([{"role": "user", "content": "hi"}],
                      [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
                      [{"role": "user", "content": "yo"}])
    assert suite_messages(str(p), 0) == [hi, sys_hi, yo]  # another system prompt: its own
    assert suite_messages(str(p), 2) == [hi, sys_hi]


def test_a_sampled_row_does_not_depend_on_the_settings_timed_before_it(tiny_llama_dir,
                                                                       monkeypatch):
    """The seed was set once before loading: each run drew on from the runs before it, so
    chain 3's sampled tokens and acceptance differed by whether chain 1 ran first, under one
    --seed (3 chat prompts, 8 tokens: 18 tokens against 17). Every run now starts at the seed."""
    seen = []

    def at_start(run):
        def wrapped(*args, **kwargs):
            seen.append(torch.get_rng_state())
            return run(*args, **kwargs)
        return wrapped

    for name in ("_baseline", "_speculative"):
        monkeypatch.setattr(bench_run, name, at_start(getattr(bench_run, name)))
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", num_prompts=2,
                      steps=[1, 3], batch_sizes=[1, 2], max_new_tokens=4,
                      params=SamplingParams(temperature=1.0), seed=5)
    run_bench(cfg, log=lambda s: None)
    seeded = torch.manual_seed(5).get_state()
    assert len(seen) == 6 and all(torch.equal(s, seeded) for s in seen)


def test_refilled_rows_have_no_decode_only_rate():
    """A refilled run's wall rate (prompt passes among the cycles) was written as its decode
    tok/s and decode speedup too: the table's decode columns showed a rate with prefills in."""
    speed = _refilled_speed([[1, 2, 3], [4]], 2.0)
    assert speed["tokens_per_s"] == 2.0 and speed["decode_tokens_per_s"] is None
    assert _over(None, 9.0) is None and _over(3.0, None) is None and _over(3.0, 2.0) == 1.5
    row = {**spec_row([0.5], 1.5, [0, 1, 1]), "decode_tokens_per_s": None,
           "decode_speedup": None, "refill": True, "steps": 3, "topk": 2,
           "num_draft_tokens": 6}
    rep = report_of([row])
    rep["meta"]["refill"] = True
    rep["results"][0]["decode_tokens_per_s"] = None
    cols = {c.header: [str(x) for x in c._cells] for c in results_table(rep).columns}
    assert cols["decode tok/s"] == ["-", "-"] and cols["decode speedup"] == ["-", "-"]
    assert cols["tok/s"] == ["10.0", "12.0"]
    assert headline(rep, "b.json")["results"][0]["decode_speedup"] is None
    assert any("refilled rows: tok/s over wall time" in n for n in notes(rep))


@pytest.mark.parametrize(("kw", "says"), [
    ({"refill": True, "refill_every": -1}, "--refill-every must be a whole number >= 0"),
    ({"refill": True, "refill_every": 2.5}, "--refill-every must be a whole number >= 0"),
    ({"refill_every": 4}, "--refill-every applies to refilled rows")])
def test_bench_config_refuses_a_refill_spacing_as_it_is_made(kw, says):
    """A Python caller's --refill-every was taken unchecked: -1 refused by the engine only after
    the target loaded, and one without refill ignored, the rows timed static."""
    with pytest.raises(DraftsmithError, match=says):
        BenchConfig(drafter="random", **kw)
