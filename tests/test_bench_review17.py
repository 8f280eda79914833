"""`draftsmith bench`, seventeenth review: what the notes say matches the table they sit under,
and the rounds' order as `meta.timing` states it is the order the rounds were run in."""

from __future__ import annotations

from draftsmith.bench.report import notes, results_table
from draftsmith.bench.run import rotated, timing

BASE = {"suite": "chat", "batch": 2, "setting": "baseline", "prompts": 3, "padding_rows": 1,
        "tokens_per_s": 100.0, "decode_tokens_per_s": 110.0}
SPEC = {**BASE, "setting": "chain 1", "steps": 1, "topk": 1, "num_draft_tokens": 2,
        "tokens_per_s": 120.0, "decode_tokens_per_s": 130.0, "speedup": 1.2,
        "decode_speedup": 1.18, "mean_accept_length": 1.5, "accept_rate": 0.75,
        "position_rates": [0.5]}


def report(greedy: bool) -> dict:
    spec = {**SPEC, **({"agreement": {"prompts": 3, "identical": 3, "max_gap": 0.0}}
                       if greedy else {})}
    params = {"temperature": 0.0 if greedy else 0.7, "top_p": 1.0, "top_k": 0}
    return {"meta": {"params": params, "seed": None if greedy else 0, "not_run": []},
            "results": [BASE, spec]}


def columns(rep: dict) -> list[str]:
    return [str(c.header) for c in results_table(rep).columns]


def test_the_padding_note_names_same_only_where_the_table_has_it():
    """A sampled run has no 'same' column (no greedy agreement), yet its padding note said the
    padding rows were left out of 'same'."""
    greedy, sampled = report(True), report(False)
    assert "same" in columns(greedy) and "same" not in columns(sampled)
    pad = [n for n in notes(greedy) if "topped up" in n]
    assert len(pad) == 1 and pad[0].endswith("(accept len, per position, histogram), not in "
                                             "'same'")
    pad = [n for n in notes(sampled) if "topped up" in n]
    assert len(pad) == 1 and "same" not in pad[0]
    assert pad[0].endswith("(accept len, per position, histogram)")


def test_a_run_interrupted_before_any_setting_does_not_name_a_same_column():
    rep = {"meta": {"params": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
                    "not_run": ["chat batch 2: chain 1"]}, "results": [BASE]}
    assert "same" not in columns(rep)
    assert not any("same" in n for n in notes(rep) if "topped up" in n)


def test_the_timing_text_starts_each_round_where_the_rounds_ran():
    """Rounds are numbered from 1 (the log's 'round 1/3', `failed.run`'s 'round 1 of 3'); the
    text said round r starts at run r mod (settings + 1), which read as round 1 starting at
    the first setting, not the baseline."""
    labels = ["baseline", "chain 1", "chain 2"]
    text = timing(3)
    assert "rotated" in text and "mod" not in text
    assert "round 1 in the grid's order (baseline first)" in text
    assert "round r starts at run r, counting from 1, wrapping round" in text
    for r in range(1, 7):  # round r (from 1) starts at run r (from 1), wrapping round
        assert rotated(labels, r - 1)[0] == labels[(r - 1) % len(labels)]
