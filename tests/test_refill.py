"""Refill generation: every row stays busy, and each prompt gets the answer it gets alone."""

from __future__ import annotations

import pytest
import torch
from test_speculative import tiny_target

from draftsmith.engine.generate import generate, run_generation
from draftsmith.engine.refill import generate_refill
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.errors import DraftsmithError

PROMPTS = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20],
           [3, 4], [1, 2, 3, 4, 5, 6], [9], [1, 40, 41, 42]]


@pytest.fixture(scope="module")
def model():
    return tiny_target(vocab=128, seed=1)


def alone(model, eos: list[int], new: int) -> list[list[int]]:
    return [generate(Runtime(model, 1, 64, graphs=False), [p], new, eos_ids=eos)[0]
            for p in PROMPTS]


def stop_tokens(model) -> list[int]:
    """Two tokens the greedy answers really produce, so some rows stop early, at different
    steps, and free their row for the next prompt."""
    free = alone(model, [], 20)
    return sorted({free[0][3], free[2][7]})


@pytest.mark.parametrize(("rows", "check_every"), [(3, 1), (3, 4), (8, 16), (1, 2)])
def test_greedy_answers_equal_each_prompt_alone(model, rows, check_every):
    eos = stop_tokens(model)
    want = alone(model, eos, 20)
    assert len({len(w) for w in want}) > 2  # the stops really vary the lengths
    rt = Runtime(model, 8, 64, graphs=False)
    got = generate_refill(rt, PROMPTS, 20, eos_ids=eos, rows=rows, check_every=check_every)
    assert got == want


def test_a_second_call_reuses_rows_without_stale_state(model):
    eos = stop_tokens(model)
    rt = Runtime(model, 3, 64, graphs=False)
    generate_refill(rt, PROMPTS[::-1], 12, eos_ids=eos, rows=3)
    assert generate_refill(rt, PROMPTS, 20, eos_ids=eos, rows=3) == alone(model, eos, 20)


def test_sampled_answers_are_seeded_and_bounded(model):
    rt = Runtime(model, 4, 64, graphs=False)
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(7)
    a = generate_refill(rt, PROMPTS, 10, params, eos_ids=[5], rows=4)
    torch.manual_seed(7)
    b = generate_refill(rt, PROMPTS, 10, params, eos_ids=[5], rows=4)
    assert a == b and all(len(x) <= 10 and 5 not in x for x in a)
    assert len({tuple(x) for x in a}) > 4  # sampled, not one answer repeated


def test_steps_stop_with_the_rows_and_the_spacing_follows_short_answers(model):
    """A prompt whose first token is an eos frees its row at once, and answers of 8 tokens are
    looked at every 2 steps (a quarter), not every 16: the steps run say so."""
    rt = Runtime(model, 1, 64, graphs=False)
    runs, first = [], alone(model, [], 1)[1][0]
    for prompts, eos in (([PROMPTS[0]], []), ([PROMPTS[0], PROMPTS[1]], [first])):
        stats: dict = {}
        got = generate_refill(rt, prompts, 8, eos_ids=eos, rows=1, check_every=16, stats=stats)
        runs.append((got, stats["steps"]))
    (one, steps_one), (two, steps_two) = runs
    assert len(one[0]) == 8 and two[1] == []
    assert steps_one == 8  # 7 decode steps after the prompt's token, looked at every 2
    assert steps_two <= steps_one + 2  # the ended row is harvested at the next look


BAD_INPUT = [
    ([[1, 2], []], 4, "empty prompt"), ([[1] * 60], 8, "exceeds max_seq"),
    ([[1, 2]], 0, "max_new_tokens must be >= 1"), ([[1, 2]], -3, "max_new_tokens must be >= 1"),
    ([[1, 2], [5, 128]], 4, r"prompt 1 holds token id 128, outside .* \[0, 128\)"),
    ([[1, -1]], 4, "token id -1"), ([1, 2, 3], 4, "prompts: lists of token ids")]


@pytest.mark.parametrize(("prompts", "new", "what"), BAD_INPUT)
def test_bad_input_is_refused(model, prompts, new, what):
    with pytest.raises(DraftsmithError, match=what):
        generate_refill(Runtime(model, 2, 64, graphs=False), prompts, new)


@pytest.mark.parametrize(("prompts", "new", "what"), BAD_INPUT)
def test_plain_decoding_refuses_bad_input_too(model, prompts, new, what):
    """Token ids past the embedding were an IndexError (on a GPU a device-side assert), and a
    negative max_new_tokens returned the output buffer's zeros."""
    with pytest.raises(DraftsmithError, match=what):
        generate(Runtime(model, 2, 64, graphs=False), prompts, new)
    if "max_seq" not in what:  # a model, not a runtime: one is made to fit the request
        with pytest.raises(DraftsmithError, match=what):
            generate(model, prompts, new)


def test_bad_rows_and_settings_are_refused(model):
    rt = Runtime(model, 2, 64, graphs=False)
    with pytest.raises(DraftsmithError, match="rows must be >= 1, got -2"):
        generate_refill(rt, [[1, 2]], 4, rows=-2)
    with pytest.raises(DraftsmithError, match="0 sampling settings for 2 prompts"):
        run_generation(rt, [[1, 2], [3]], 4, [])


def test_an_eos_id_past_the_vocabulary_ends_rows_as_the_others_do(model):
    """A row done in plain decoding was fed eos_ids[0]: one past the vocabulary took the
    embedding out of range once any row ended."""
    rt = Runtime(model, 2, 64, graphs=False)
    stop = alone(model, [], 6)[0][3]
    want = generate(rt, PROMPTS[:2], 12, eos_ids=[stop])
    assert len(want[0]) == 3
    assert generate(rt, PROMPTS[:2], 12, eos_ids=[500, stop]) == want
    assert generate_refill(rt, PROMPTS[:2], 12, eos_ids=[500, stop]) == want


def test_warm_prompts_covers_every_padded_row_count_and_bucket():
    """Refills pad their rows to a power of two (or the prefill runtime's rows) and their
    prompts to a bucket: the warm-up must have run each pair, so none is captured while timed.
    It never starts more rows than the state has (3 rows pad to 4 all the same), largest pairs
    first (the graphs share one pool), and skips pairs too big for a graph (eager anyway)."""
    from types import SimpleNamespace

    from draftsmith.engine.refill import warm_prompts

    pre = SimpleNamespace(graphs=object(), max_batch=5, device="cpu",
                          bucket=lambda b, n: 16 if n <= 16 else 24)
    for rows, sizes in ((5, (1, 2, 4, 5)), (9, (1, 2, 4, 5)), (3, (1, 2, 4)), (1, (1,))):
        calls = []
        warm_prompts(pre, [[1] * 3, [2] * 20, [3] * 9],
                     lambda r, p, calls=calls: calls.append((len(r), len(p[0]))), rows)
        assert sorted(calls) == [(min(s, rows), n) for s in sizes for n in (9, 20)]
        assert calls == sorted(calls, reverse=True)
    pre.bucket = lambda b, n: None if b * n > 64 else (16 if n <= 16 else 24)
    calls = []
    warm_prompts(pre, [[3] * 9, [2] * 20], lambda r, p: calls.append((len(r), len(p[0]))), 4)
    assert sorted(calls) == [(1, 9), (1, 20), (2, 9), (2, 20), (4, 9)]  # 4 x 20: eager
