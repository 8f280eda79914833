"""Refilled rows under review: bad input to the refill engines and the server's live rows answered
with one clear error, and a row's greedy answer the one its prompt gets alone wherever it joins,
at the cache's exact capacity."""

from __future__ import annotations

import random

import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Drafter

PROMPTS = [[1, 2, 3], [4, 5], [9, 8, 7, 6, 5, 4], [11]]


@pytest.fixture(scope="module")
def model():
    return tiny_target(vocab=64, seed=1, num_layers=2)


class Oracle(Eagle3Drafter):
    """A drafter pushed toward the target's greedy next token, looked up by (position, token):
    long accepts, so cycles end rows past their max_new and at the cache's end."""

    plain_head = False

    def know(self, seqs: list[list[int]], vocab: int) -> Oracle:
        vd = self.cfg.draft_vocab_size
        index = torch.full((vocab,), -1, dtype=torch.long)
        index[torch.arange(vd) + self.d2t] = torch.arange(vd)
        self.table = torch.full((max(map(len, seqs)) + 4, vocab), -1, dtype=torch.long)
        for s in seqs:
            for p in range(len(s) - 2):
                self.table[p, s[p + 1]] = index[s[p + 2]]
        return self

    def forward(self, tokens, hidden, positions, caches=None, slots=None, mask=None, at=None,
                logits=True):
        out, h = super().forward(tokens, hidden, positions, caches, slots, mask, at)
        if at is not None:
            positions, tokens = positions.gather(1, at[:, None]), tokens.gather(1, at[:, None])
        want = self.table[positions.clamp(max=self.table.shape[0] - 1), tokens]
        bump = torch.nn.functional.one_hot(want.clamp(min=0), out.shape[-1])
        return out + 30.0 * bump * (want >= 0)[..., None], h


def alone(model, prompts: list[list[int]], new: int, eos: list[int]) -> list[list[int]]:
    return [generate(Runtime(model, 1, 64, graphs=False), [p], new, eos_ids=eos)[0]
            for p in prompts]


def spec(model, max_seq: int, rows: int = 2, steps: int = 2, topk: int = 1,
         n: int | None = None, drafter=None) -> SpecDecoder:
    return SpecDecoder(Runtime(model, rows, max_seq, graphs=False),
                       drafter or make_drafter(model, 48), steps, topk, n, max_batch=rows)


@pytest.mark.parametrize("eos", [0, 2])
def test_the_refill_engines_refuse_a_bare_eos_id(model, eos):
    """`eos_ids=0` read as no EOS at all (answers ran past token 0), `eos_ids=2` was a
    TypeError: both refused by name, as plain decoding refuses them."""
    runs = (lambda: refill.generate_refill(Runtime(model, 2, 32, graphs=False), PROMPTS, 4,
                                           eos_ids=eos),
            lambda: spec_refill.generate_refill(spec(model, 40), PROMPTS, 4, eos_ids=eos))
    for run in runs:
        with pytest.raises(DraftsmithError, match=f"eos_ids must be a list of token ids, got "
                                                  f"{eos}"):
            run()


@pytest.mark.parametrize("params", [[SamplingParams()] * 4, {"temperature": 1.0}])
def test_refill_refuses_sampling_settings_of_the_wrong_type(model, params):
    with pytest.raises(DraftsmithError, match="params must be a SamplingParams"):
        refill.generate_refill(Runtime(model, 2, 32, graphs=False), PROMPTS, 4, params)


@pytest.mark.parametrize("rows", [2.5, True, "2"])
def test_refill_rows_must_be_a_whole_number(model, rows):
    """rows=2.5 passed the range check and failed later in a TypeError; True ran one row."""
    with pytest.raises(DraftsmithError, match=f"rows must be a whole number, got {rows!r}"):
        refill.generate_refill(Runtime(model, 2, 32, graphs=False), PROMPTS, 4, rows=rows)


def test_prepare_refuses_a_bare_eos_id(model):
    """prepare (tune's refilled timing) took list(eos): a bare id was a TypeError there."""
    with pytest.raises(DraftsmithError, match="eos_ids must be a list of token ids, got 2"):
        refill.prepare(Runtime(model, 2, 32, graphs=False), 2, 4, 2, SamplingParams())


def capacity_prompts(rng: random.Random, room: int) -> tuple[list[list[int]], int]:
    """Prompts of mixed lengths, the longest filling `room` with max_new exactly."""
    new = rng.randint(1, 9)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, room - new))] for _ in range(7)]
    prompts[rng.randrange(7)] = [rng.randrange(64) for _ in range(room - new)]
    return prompts, new


@pytest.mark.parametrize(("steps", "topk", "n"), [(3, 1, None), (3, 2, 6)])
def test_refilled_rows_at_the_caches_exact_capacity_equal_each_prompt_alone(model, steps, topk,
                                                                            n):
    """A prompt + max_new filling the cache to its last slot (the speculative decoder's
    capacity, its drafting margin past it), rows ending together and apart, refilled every
    cycle and in bursts: every answer is its prompt's alone, in both refill engines."""
    rng = random.Random(steps * 10 + topk)
    room = 18
    for trial in range(3):
        prompts, new = capacity_prompts(rng, room)
        free = alone(model, prompts, new, [])
        eos = sorted({free[0][-1], free[1][0]})
        want = alone(model, prompts, new, eos)
        seqs = [p + f for p, f in zip(prompts, alone(model, prompts, new + 8, []), strict=True)]
        drafter = make_drafter(model, 48, Oracle).know(seqs, 64)
        dec = spec(model, 64, 3, steps, topk, n, drafter)
        margin = dec.rt.max_seq - dec.capacity()
        dec = spec(model, room + margin, 3, steps, topk, n, drafter)
        assert dec.capacity() == room
        every = trial + 1
        res = spec_refill.generate_refill(dec, prompts, new, eos_ids=eos, rows=3,
                                          check_every=every)
        assert res.tokens == want
        rt = Runtime(model, 3, room, graphs=False)
        assert refill.generate_refill(rt, prompts, new, eos_ids=eos, rows=3,
                                      check_every=every) == want
    assert sum(res.accept_hist[2:]) > 0  # drafts accepted: cycles emitted several tokens


# ---- the server's live rows ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from conftest import write_tiny_folder

    from draftsmith.targets import load_target

    t = load_target(str(write_tiny_folder(tmp_path_factory.mktemp("refill_review"), "llama")))
    model = t.build(torch.float32, "cpu")
    return t, model, make_drafter(model, 64)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_live_row_refuses_a_prompt_past_max_prompt_tokens(served, speculative):
    """A prompt within prompt + completion but past max_prompt_tokens, which the prefill
    runtime holds: one error naming the limit (it was an IndexError inside the prompt pass)."""
    from draftsmith.serve.engine import EngineConfig, ServeEngine

    t, model, drafter = served
    eng = ServeEngine(t, model, drafter if speculative else None,
                      EngineConfig(max_batch=2, max_prompt_tokens=8, max_tokens=12))
    live = eng.open(2, SamplingParams())
    with pytest.raises(DraftsmithError, match="prompt of 9 tokens exceeds max_prompt_tokens 8"):
        live.add([0], [[3] * 9], [SamplingParams()])
    live.add([1], [[3] * 8], [SamplingParams()])  # the longest it holds
    live.step(2)
    tokens, _ = live.read([1])
    assert len(tokens[0]) >= 3


def test_a_speculative_server_refuses_more_eos_ids_than_a_cycle_checks(served, monkeypatch):
    """A target of more eos ids than the speculative state holds: refused when the engine
    loads, not a RuntimeError failing every batch as it opens."""
    from draftsmith.serve.engine import EngineConfig, ServeEngine
    from draftsmith.targets import Target

    t, model, drafter = served
    monkeypatch.setattr(Target, "eos_ids", property(lambda self: list(range(100, 165))))
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=8, max_tokens=12)
    with pytest.raises(DraftsmithError, match="the target has 65 eos ids; speculative decoding "
                                              "takes at most 64"):
        ServeEngine(t, model, drafter, cfg)
    assert ServeEngine(t, model, None, cfg).eos == list(range(100, 165))  # plain decoding: any
