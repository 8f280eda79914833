"""Engine review 12 (CPU): each sampling filter keeps the target's filtered distribution in
speculative decoding (a chi-square test per filter, top-nσ alone and with top-k and top-p), several
stop ids end rows exactly where plain decoding ends them, a one-token prompt and a prompt that
fills the decoder's capacity decode as plain greedy does (one token more is refused), and a
drafter whose vocabulary holds none of the target's greedy tokens changes nothing."""

from __future__ import annotations

import pytest
import torch
from test_engine_review10 import PROMPT, joint_counts, sampled_decoder
from test_speculative import Steered, greedy_seq, init_, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p, exact_joint

from draftsmith.engine import spec_refill, speculative
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

FILTERS = {"top_p": SamplingParams(1.0, top_p=0.7), "top_k": SamplingParams(1.0, top_k=3),
           "top_n_sigma": SamplingParams(1.0, top_n_sigma=1.0),
           "all": SamplingParams(1.1, top_k=5, top_p=0.95, top_n_sigma=1.5)}
SETTINGS = [(1, 1, None), (3, 1, None), (3, 2, 6), (2, 3, 4), (4, 4, 10)]
PROMPTS = [[1, 5, 9, 30, 44], [1, 60, 61], [3], [1, 20]]
NEW = 30


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@pytest.mark.parametrize("name", list(FILTERS))
@torch.no_grad()
def test_each_filter_keeps_the_targets_filtered_joint(name, steps, topk, n, drafts,
                                                      monkeypatch):
    """4096 draws of (x1, x2, x3) (x2, x3 from the first cycle), chain and tree, both sampled-
    draft rules: they follow the exact joint of the target under that filter, not unfiltered."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    params, b = FILTERS[name], 1024
    target, dec = sampled_decoder(drafts, steps, topk, n, params, b)
    counts = joint_counts(dec, b, 4)
    joint = exact_joint(target, PROMPT, params, 8)
    assert chi_square_p(counts, joint) > 1e-3
    assert (counts[joint == 0] == 0).all()  # nothing the filter drops is ever emitted
    unfiltered = SamplingParams(params.temperature)
    assert chi_square_p(counts, exact_joint(target, PROMPT, unfiltered, 8)) < 1e-6


@pytest.fixture(scope="module")
def base():
    target = tiny_target(64, seed=0)
    ref = generate(target, PROMPTS, NEW, eos_ids=[])
    seq = greedy_seq(Runtime(target, 4, 128), PROMPTS, NEW + 8)
    return target, ref, make_drafter(target, 48, Steered, seed=1).steer(seq, 1.0)


@pytest.mark.parametrize("steps,topk,n", SETTINGS)
def test_several_stop_ids_end_rows_where_plain_decoding_does(base, steps, topk, n):
    """Stop ids: row 2's first token, row 0's sixth (row 1's fourth too), row 3's eleventh, an
    id inside a prompt, one past the vocabulary and a negative one: each row ends where plain
    greedy decoding ends it, in a static batch and refilled."""
    target, ref, drafter = base
    eos = [ref[2][0], ref[0][5], ref[3][10], 5, 1000, -7]
    want = generate(target, PROMPTS, NEW, eos_ids=eos)
    assert [len(r) for r in want] == [5, 3, 0, 10]
    dec = SpecDecoder(target, drafter, steps, topk, n, max_batch=4, max_seq=128)
    res = dec.generate(PROMPTS, NEW, eos_ids=eos)
    assert res.tokens == want and res.mean_accept_length > 1.5
    again = spec_refill.generate_refill(dec, PROMPTS + PROMPTS[:1], NEW, eos_ids=eos, rows=2,
                                        check_every=1)
    assert again.tokens == want + want[:1]


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("steps,topk,n", SETTINGS)
def test_one_token_and_capacity_filling_prompts_decode_as_plain_greedy(base, steps, topk, n,
                                                                       buckets):
    """A one-token prompt beside a prompt that fills the decoder's capacity with max_new (the
    prompt pass padded to a bucket or not): plain greedy's tokens, static and refilled; one
    token more is a DraftsmithError naming the capacity, not a write past the static cache."""
    target, _, _ = base
    drafter = make_drafter(target, 48, seed=1)
    dec = SpecDecoder(Runtime(target, 2, 48, prompt_buckets=buckets), drafter, steps, topk, n)
    new = 5
    full = [(7 * i + 1) % 64 for i in range(dec.capacity() - new)]
    prompts = [full, [3]]
    want = generate(target, prompts, new, eos_ids=[])
    assert dec.generate(prompts, new, eos_ids=[]).tokens == want
    refilled = spec_refill.generate_refill(dec, prompts + prompts[::-1], new, eos_ids=[],
                                           rows=2, check_every=1)
    assert refilled.tokens == want + want[::-1]
    with pytest.raises(DraftsmithError, match=f"exceeds this decoder's capacity "
                                              f"{dec.capacity()}"):
        dec.generate(prompts, new + 1, eos_ids=[])


def drafter_without(target, banned: set[int], dvocab: int) -> Eagle3Drafter:
    """A random drafter whose draft vocabulary is `dvocab` target ids none of which is banned."""
    used = torch.tensor(sorted(set(range(target.cfg.vocab_size)) - banned)[:dvocab])
    cfg = target.cfg
    drafter = Eagle3Drafter(Eagle3Config.for_target(cfg, dvocab,
                                                    default_aux_layers(cfg.num_layers)))
    torch.manual_seed(2)
    init_(drafter, 0.1)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed.weight)
        drafter.set_vocab(used - torch.arange(dvocab), t2d)
    return drafter.eval()


@pytest.mark.parametrize("dvocab", [4, 16])
@pytest.mark.parametrize("steps,topk,n", SETTINGS)
def test_a_drafter_without_the_greedy_tokens_changes_nothing(base, steps, topk, n, dvocab):
    """No draft id maps to any token plain greedy emits: every draft is rejected (one token a
    cycle, nothing accepted) and the answers are plain greedy's."""
    target, ref, _ = base
    drafter = drafter_without(target, {t for r in ref for t in r}, dvocab)
    res = SpecDecoder(target, drafter, steps, topk, n, max_batch=4,
                      max_seq=128).generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert sum(res.accepted) == 0 and res.mean_accept_length == 1.0
