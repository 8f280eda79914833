"""Engine review 14 (CPU): a bool is no token id (a prompt of [True, 5] decoded as [1, 5], an
eos list of [True] stopped on token 1), at every entry; a one-token answer, an EOS as some rows'
first token and a profiled run at batch > 1 over prompts of different lengths decode as plain
greedy, the profiler's phases adding up to its cycle and its cycles to the run's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import eos_list, generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError

PROMPTS = [[1, 5, 9, 30, 44, 7, 8], [1, 60, 61], [3], [1, 20, 2, 2]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(64, seed=0)
    return target, make_drafter(target, 48, seed=1)


def _engines(pair):
    """Each decoding entry point as f(prompts, eos)."""
    target, drafter = pair
    rt = Runtime(target, 2, 64, graphs=False)
    dec = SpecDecoder(Runtime(target, 2, 64, graphs=False), drafter, 2, 1, None)
    return [lambda p, e: generate(target, p, 3, eos_ids=e),
            lambda p, e: generate(rt, p, 3, eos_ids=e),
            lambda p, e: refill.generate_refill(rt, p, 3, eos_ids=e),
            lambda p, e: dec.generate(p, 3, e),
            lambda p, e: spec_refill.generate_refill(dec, p, 3, e)]


@pytest.mark.parametrize("prompt", [[True, 5], [1, np.True_], np.array([1, 5]) > 2])
def test_a_bool_in_a_prompt_is_refused(pair, prompt):
    for run in _engines(pair):
        with pytest.raises(DraftsmithError, match="^prompt 1 is not a list of whole-number "
                                                  "token ids"):
            run([[1, 2], prompt], [])


@pytest.mark.parametrize("prompt", [{3, 4}, {3: 1}, b"ab", bytearray(b"ab"), 3.5, None,
                                    (t for t in [3]), np.array(3), torch.tensor([[3, 4]])])
def test_a_prompt_that_is_no_sequence_of_ids_is_refused_by_position(pair, prompt):
    """A set or dict was a RuntimeError from torch ("Could not infer dtype"), bytes decoded as
    token ids 97, 98, and a float or None was called an empty prompt."""
    for run in _engines(pair):
        with pytest.raises(DraftsmithError, match=r"^prompt 1 is not a list of whole-number "
                                                  r"token ids \(prompts: lists of token ids\)$"):
            run([[1, 2], prompt], [])


def test_prompts_as_ranges_tuples_and_arrays_still_decode(pair):
    target, _ = pair
    want = generate(target, [[3, 4, 5], [1, 2]], 3, eos_ids=[])
    for prompts in ([range(3, 6), (1, 2)], [np.array([3, 4, 5]), torch.tensor([1, 2])]):
        assert generate(target, prompts, 3, eos_ids=[]) == want


@pytest.mark.parametrize("eos", [[True], [2, False], torch.tensor([True]),
                                 np.array([True, False])])
def test_a_bool_eos_id_is_refused(pair, eos):
    with pytest.raises(DraftsmithError, match="^eos ids must be whole numbers within int64"):
        eos_list(eos)
    for run in _engines(pair):
        with pytest.raises(DraftsmithError, match="^eos ids must be whole numbers"):
            run([[1, 2]], eos)


def test_integer_ids_of_any_integer_type_still_pass():
    assert eos_list([np.int64(2), 3, torch.tensor([4, 4]).tolist()[0]]) == [2, 3, 4]
    assert eos_list(np.array([7, 7], dtype=np.int32)) == [7]


@pytest.mark.parametrize("steps,topk,n", [(1, 1, None), (3, 1, None), (3, 2, 6), (2, 3, 4)])
def test_short_answers_and_first_token_stops_decode_as_plain_greedy(pair, steps, topk, n):
    target, drafter = pair
    ref = generate(target, PROMPTS, 12, eos_ids=[])
    dec = SpecDecoder(Runtime(target, 4, 64, graphs=False), drafter, steps, topk, n)
    assert dec.generate(PROMPTS, 1, eos_ids=[]).tokens == [r[:1] for r in ref]
    stop = [ref[1][0], ref[3][0]]  # rows 1 and 3 end on their first token
    want = generate(target, PROMPTS, 12, eos_ids=stop)
    assert [want[1], want[3]] == [[], []]
    assert dec.generate(PROMPTS, 12, eos_ids=stop).tokens == want
    every = dec.generate(PROMPTS, 12, eos_ids=[r[0] for r in ref])
    assert every.tokens == [[]] * 4 and every.cycles == 0 and not any(every.accept_hist)


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 6)])
def test_a_profiled_run_decodes_as_plain_greedy_and_its_phases_add_up(pair, steps, topk, n):
    target, drafter = pair
    ref = generate(target, PROMPTS, 12, eos_ids=[])
    dec = SpecDecoder(Runtime(target, 4, 64, graphs=False), drafter, steps, topk, n,
                      profile=True)
    res = dec.generate(PROMPTS, 12, eos_ids=[])
    ph = res.phases
    assert res.tokens == ref and ph is not None and ph.cycles == res.cycles > 0
    assert sum(ph.ms.values()) == pytest.approx(ph.cycle_ms)
    assert sum(ph.pct.values()) == pytest.approx(100.0)
    assert ph.cycle_ms * ph.cycles <= res.decode_s * 1e3  # the phases lie inside the decode
    assert ph.accept_length == res.mean_accept_length
