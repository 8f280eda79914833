"""The plain decoding engine, first runtime review: greedy answers against HF transformers'
generate (a batch of unequal prompts, EOS per row), the cache at its capacity, refill against
one prompt at a time, and requests the engine must refuse in one line (CPU, fp32; the CUDA
graph paths are the GPU suite's)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_folder
from test_speculative import tiny_target

from draftsmith.engine import refill
from draftsmith.engine.generate import generate, run_generation
from draftsmith.engine.refill import generate_refill
from draftsmith.engine.runtime import Runtime
from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target

PROMPTS = [[1, 5, 9, 30, 44, 7, 8], [1, 60, 61], [1, 20, 21, 22, 23], [9]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import transformers as tf

    folder = write_tiny_folder(tmp_path_factory.mktemp("llama"), "llama", num_hidden_layers=2)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    return hf, load_target(folder).build(torch.float32)


def hf_greedy(hf, prompt: list[int], new: int, eos: list[int] | None) -> list[int]:
    """HF's greedy answer, its eos dropped as draftsmith drops it."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=eos or None, pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(out) if t in (eos or [])), len(out))
    return out[:cut]


def test_batch_of_unequal_prompts_with_eos_matches_hf_one_at_a_time(pair):
    hf, ours = pair
    free = [hf_greedy(hf, p, 12, None) for p in PROMPTS]
    eos = sorted({free[0][4], free[2][1]})  # stops the answers really reach, at other steps
    want = [hf_greedy(hf, p, 12, eos) for p in PROMPTS]
    assert len({len(w) for w in want}) > 1
    assert generate(ours, PROMPTS, 12, eos_ids=eos) == want
    rt = Runtime(ours, 6, 64, graphs=False, prompt_buckets=True)  # padded prefill, spare rows
    assert generate(rt, PROMPTS, 12, eos_ids=eos) == want


def test_max_new_tokens_one_is_the_first_token_or_nothing_at_eos(pair):
    hf, ours = pair
    first = [hf_greedy(hf, p, 1, None) for p in PROMPTS]
    assert generate(ours, PROMPTS, 1) == first
    eos = first[1]  # row 1 ends on its first token, the others keep theirs
    got = run_generation(ours, PROMPTS, 1, eos_ids=eos)
    assert got.tokens == [[] if i == 1 else f for i, f in enumerate(first)]
    rt = Runtime(ours, 4, 64, graphs=False)
    assert generate_refill(rt, PROMPTS, 1, eos_ids=eos, rows=2) == got.tokens


@pytest.fixture(scope="module")
def model():
    return tiny_target(vocab=128, seed=3)


def test_cache_filled_to_capacity_decodes_and_one_more_token_is_refused(model):
    prompt, room = [[1, 5, 9, 30]], 12
    want = generate(Runtime(model, 1, 64, graphs=False), prompt, room - 4)
    rt = Runtime(model, 1, room, graphs=False)
    assert generate(rt, prompt, room - 4) == want
    with pytest.raises(DraftsmithError, match="^prompt \\+ max_new_tokens = 13 exceeds max_seq "
                                              "12$"):
        generate(rt, prompt, room - 3)
    assert generate_refill(rt, prompt, room - 4) == want
    with pytest.raises(DraftsmithError, match="= 13 exceeds max_seq 12$"):
        generate_refill(rt, prompt, room - 3)


def test_more_prompts_than_rows_refused_before_any_step_is_made(model):
    """3 prompts on a runtime of 2 rows: the decode state was built (on GPU: a step graph
    captured over 3 tokens and 2 cache rows) before the prefill refused the batch."""
    rt = Runtime(model, 2, 64, graphs=False)
    with pytest.raises(DraftsmithError, match="^batch 3 exceeds the runtime's max_batch 2$"):
        run_generation(rt, PROMPTS[:3], 4)
    assert not rt.__dict__.get("_steps")


def test_a_reused_runtime_answers_as_a_fresh_one(model):
    """Longer prompts, then shorter ones on the same rows: the K/V slots the first call left
    are never read."""
    rt = Runtime(model, 4, 64, graphs=False)
    generate(rt, [p * 3 for p in PROMPTS], 10, eos_ids=[])
    for batch in (PROMPTS, PROMPTS[2:]):
        assert generate(rt, batch, 10) == generate(Runtime(model, 4, 64, graphs=False), batch, 10)


def test_refill_prefilling_in_parts_answers_as_each_prompt_alone(model, monkeypatch):
    """More rows to fill than the prefill runtime has: the prompts prefill in parts."""
    alone = [generate(Runtime(model, 1, 64, graphs=False), [p], 9)[0] for p in PROMPTS]
    eos = sorted({alone[0][2], alone[3][5]})
    want = [generate(Runtime(model, 1, 64, graphs=False), [p], 9, eos_ids=eos)[0]
            for p in PROMPTS]
    monkeypatch.setattr(refill, "PREFILL_ROWS", 3)
    rt = Runtime(model, 4, 64, graphs=False)
    assert generate_refill(rt, PROMPTS * 2, 9, eos_ids=eos, rows=4, check_every=1) == want * 2


@pytest.mark.parametrize("prompts", [[], [[]], [[1, 2], []]])
def test_an_empty_prompt_is_refused_in_one_line(model, prompts):
    rt = Runtime(model, 2, 64, graphs=False)
    for call in (lambda: run_generation(rt, prompts, 4), lambda: generate_refill(rt, prompts, 4),
                 lambda: run_generation(model, prompts, 4)):
        with pytest.raises(DraftsmithError, match="empty prompt list or empty prompt"):
            call()


def test_a_prompt_past_the_targets_positions_is_refused_before_a_cache_is_sized(monkeypatch):
    """A prompt alone past max_position_embeddings: the request is refused naming them, not
    first given a cache of its length (a long one is an out-of-memory error, not this line)."""
    target = tiny_target(max_position_embeddings=16)

    def sized(*_a, **_kw):
        raise AssertionError("a cache was sized for a request past the target's positions")

    monkeypatch.setattr(Runtime, "__init__", sized)
    with pytest.raises(DraftsmithError, match="= 21 exceeds the target's "
                                              "max_position_embeddings 16$"):
        run_generation(target, [list(range(1, 20))], 2)
