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
    assert torch.allclose(hf.model.norm(out.aux[:, :, 4]), ref.hidden_states[-1], atol=1e-5)


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


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {"attention_bias": True}),  # q, k, v and o biased
    ("qwen3", {"attention_bias": True}),
])
def test_attention_biases_match_hf(tmp_path, arch, over):
    import transformers as tf

    folder = write_tiny_folder(tmp_path / arch, arch, **over)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ours = load_target(folder).build(torch.float32)
    ids = torch.randint(5, 100, (1, 17))
    with torch.no_grad():
        diff = (ours(ids, torch.arange(17)[None]).logits - hf(ids).logits).abs().max()
    assert diff < 1e-4


def test_mlp_bias_is_refused_by_name(tmp_path):
    from draftsmith.errors import DraftsmithError

    folder = write_tiny_folder(tmp_path / "t", "llama", mlp_bias=True)
    with pytest.raises(DraftsmithError, match="mlp_bias"):
        load_target(folder)


@pytest.mark.parametrize(("arch", "over"), [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
])
def test_sliding_window_matches_hf_and_the_engine_stays_within_it(tmp_path, arch, over):
    """The uncached forward (capture, training) attends over the window as HF does past it; the
    cached engine, whose decode kernels and tree masks see the whole cache, refuses a cache
    longer than the window and matches HF within it."""
    import transformers as tf

    from draftsmith.engine.runtime import Runtime
    from draftsmith.errors import DraftsmithError

    folder = write_tiny_folder(tmp_path / arch, arch, **over)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ours = load_target(folder).build(torch.float32)
    ids = torch.randint(5, 100, (2, 30))
    pos = torch.arange(30).expand(2, 30)
    with pytest.raises(DraftsmithError, match="sliding window of 8 tokens.*max_seq 9 > 8"):
        Runtime(ours, max_batch=2, max_seq=9)
    rt = Runtime(ours, max_batch=2, max_seq=8)
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids, pos).logits
        cached = torch.cat([rt.forward(ids[:, :5], pos[:, :5]).logits,
                            rt.forward(ids[:, 5:8], pos[:, 5:8]).logits], 1)
        short = hf(ids[:, :8]).logits
    assert (full - ref).abs().max() < 1e-4
    assert (cached - short).abs().max() < 1e-4


