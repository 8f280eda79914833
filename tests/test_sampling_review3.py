"""Settings past what a device tensor holds: a top-k past int64, a temperature or top-nσ past
float32's largest. Each means what its largest held value means (no limit; tempered logits as even
as they get while still apart), in the plain sampler and the speculative accept alike, where they
were a traceback once the target had loaded (or a top-k that kept the whole vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_speculative import make_drafter
from test_speculative_sampling import small_target

from draftsmith.engine import speculative
from draftsmith.engine.generate import run_generation
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder

LOGITS = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, -2.5], [1.5, -0.5, 2.5, 0.0, -3.0, 1.0]])

# each past the tensors' range, and the setting it means
PAST = [(SamplingParams(1.0, top_k=1 << 63), SamplingParams(1.0)),
        (SamplingParams(1.0, top_k=np.uint64((1 << 64) - 1)), SamplingParams(1.0)),
        (SamplingParams(0.8, top_k=1 << 70, top_p=0.9), SamplingParams(0.8, top_p=0.9)),
        (SamplingParams(1.0, top_n_sigma=1e39), SamplingParams(1.0, top_n_sigma=1e30)),
        (SamplingParams(1e39, top_k=2), SamplingParams(1e30, top_k=2))]


def row_probs(p: SamplingParams) -> torch.Tensor:
    rs = RowSampling(3, "cpu", SamplingParams(1.0, top_k=3))
    rs.set(torch.tensor([0, 1]), [p, p])
    return rs.probs(LOGITS, torch.tensor([0, 1]))


@pytest.mark.parametrize("past,means", PAST, ids=str)
def test_a_setting_past_the_tensors_range_means_its_largest(past: SamplingParams,
                                                            means: SamplingParams) -> None:
    want = probs(LOGITS, means)
    assert torch.equal(probs(LOGITS, past), want)
    assert torch.equal(row_probs(past), want)
    assert torch.equal(RowSampling(2, "cpu", past).probs(LOGITS), want)


def test_a_temperature_past_float32_still_cuts_to_top_k() -> None:
    """An infinite temperature ties every logit, so top-k kept the whole vocabulary
    (`SamplingParams` refuses one); 1e39 is finite to Python and infinite in float32."""
    for p in (SamplingParams(1e39, top_k=2), SamplingParams(1e38, top_k=2)):
        kept = probs(LOGITS, p)
        assert (kept > 0).sum(-1).tolist() == [2, 2]
        assert torch.allclose(kept.max(-1).values, torch.tensor(0.5))


@pytest.mark.parametrize("drafts", ["plain", "topk", "drawn"])
@torch.no_grad()
def test_a_top_k_past_int64_decodes_as_no_limit(drafts: str, monkeypatch) -> None:
    """Same seed, same text as top-k 0, plain and speculative (the drawn rule reads the
    decoder's own setting through `probs`, the others each row's through `RowSampling`)."""
    target, prompt = small_target(), [3, 1, 4]

    def text(p: SamplingParams) -> list[list[int]]:
        torch.manual_seed(3)
        if drafts == "plain":
            return run_generation(Runtime(target, 4, 24), [prompt] * 4, 6, p, eos_ids=[]).tokens
        monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
        dec = SpecDecoder(Runtime(target, 4, 24), make_drafter(target, 6, seed=6, std=0.6), 2,
                          1, None, p)
        return dec.generate([prompt] * 4, 6, eos_ids=[]).tokens

    assert text(SamplingParams(1.0, top_k=1 << 63, top_p=0.95)) == text(
        SamplingParams(1.0, top_p=0.95))
