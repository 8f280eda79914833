"""Our decoder against HF transformers on tiny random configs of every supported family."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, write_tiny_folder

from draftsmith.targets import load_target


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    import transformers as tf

    folder = write_tiny_folder(tmp_path_factory.mktemp(request.param), request.param)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    target = load_target(folder)
    return hf, target.build(torch.float32), target


def test_logits_and_hidden_states_match_hf(pair):
    hf, ours, _ = pair
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (2, 23))
    pos = torch.arange(23).expand(2, 23)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, pos, aux_ids=(-1, 0, 2, 4, 5))
    assert (out.logits - ref.logits).abs().max() < 1e-4
    for i, j in enumerate((-1, 0, 2, 4)):  # the last layer's HF entry is after the final norm
        assert torch.allclose(out.aux[:, :, i], ref.hidden_states[j + 1], atol=1e-5)


def test_cached_forward_matches_uncached(pair):
    from draftsmith.engine.runtime import Runtime

    _, ours, _ = pair
    rt = Runtime(ours, max_batch=2, max_seq=64)
    ids = torch.randint(5, 100, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        full = ours(ids, pos).logits
        a = rt.forward(ids[:, :7], pos[:, :7]).logits
        b = rt.forward(ids[:, 7:], pos[:, 7:]).logits
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


def test_greedy_64_tokens_match_hf(pair):
    from draftsmith.engine.generate import generate

    hf, ours, target = pair
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61]]
    with torch.no_grad():
        got = generate(ours, prompts, max_new_tokens=64, eos_ids=[])
        for p, g in zip(prompts, got, strict=True):
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(p):].tolist()
            assert g == ref
