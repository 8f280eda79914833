"""The samplers against their definitions, written plainly here (vLLM's and HF's order: temperature,
then top-nσ, top-k and top-p over what the filters before kept), alone and combined, row by row in
one batch; the draws' frequencies, their seeds, and speculative sampling kept exact under each."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampling_review1 import drawn_drafts_keep
from test_speculative import Steered, greedy_seq, make_drafter
from test_speculative_sampling import chi_square_p, small_target

from draftsmith.engine import speculative
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder


def by_definition(row: list[float], p: SamplingParams) -> list[float]:
    """One row in float64 Python: divide by T; drop below max - n * std (N - 1); drop below the
    k-th largest of what is left (ties kept; fewer than k left: none); walk down the rest keeping
    each token while the mass above it is under top_p; normalise what is kept."""
    x = [v / p.temperature for v in row]
    keep = [True] * len(x)
    if p.top_n_sigma > 0:
        mean = sum(x) / len(x)
        std = math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))
        keep = [v >= max(x) - p.top_n_sigma * std for v in x]
    left = sorted((v for v, k in zip(x, keep, strict=True) if k), reverse=True)
    if p.top_k and len(left) >= p.top_k:
        keep = [k and v >= left[p.top_k - 1] for v, k in zip(x, keep, strict=True)]
    w = weights(x, keep)
    if p.top_p < 1:
        mass, kept = 0.0, [False] * len(x)
        for i in sorted(range(len(x)), key=lambda i: -x[i]):
            kept[i] = keep[i] and mass < p.top_p
            mass += w[i]
        w = weights(x, kept)
    return w


def defined(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return torch.tensor([by_definition(r, p) for r in logits.double().tolist()],
                        dtype=torch.float64)


def weights(x: list[float], keep: list[bool]) -> list[float]:
    top = max(v for v, k in zip(x, keep, strict=True) if k)
    e = [math.exp(v - top) if k else 0.0 for v, k in zip(x, keep, strict=True)]
    return [v / sum(e) for v in e]


def distinct_logits(rows: int, v: int, seed: int = 0) -> torch.Tensor:
    """Logits with no two equal in a row and masses off every cut above: no ties to break."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(v, generator=g).float() * 0.37 + torch.rand(v, generator=g)
                        * 0.01 for _ in range(rows)])


SETTINGS = [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(1e-3),
            SamplingParams(1.3, top_k=1), SamplingParams(0.9, top_k=4),
            SamplingParams(1.0, top_k=500),  # past the vocabulary: no limit
            SamplingParams(1.0, top_p=0.55), SamplingParams(2.0, top_p=1e-9),  # the top token
            SamplingParams(1.0, top_n_sigma=1.0), SamplingParams(0.7, top_n_sigma=0.3),
            SamplingParams(1.2, top_k=5, top_p=0.6), SamplingParams(0.8, top_k=6, top_n_sigma=1.5),
            SamplingParams(1.5, top_p=0.7, top_n_sigma=1.2),
            SamplingParams(1.1, top_k=7, top_p=0.8, top_n_sigma=1.0)]


@pytest.mark.parametrize("p", SETTINGS, ids=str)
def test_each_filter_alone_and_combined_is_its_definition(p: SamplingParams) -> None:
    logits = distinct_logits(6, 24)
    want = defined(logits, p)
    assert torch.allclose(probs(logits, p).double(), want, atol=1e-6)


def test_rows_of_one_batch_are_each_row_alone() -> None:
    """Every setting a row of one filtered batch, greedy rows among them: each row's distribution
    is its setting's alone, in full and through idx, and a greedy row draws its argmax."""
    rows = [*SETTINGS, SamplingParams()]
    logits = distinct_logits(len(rows), 24, seed=1)
    rs = RowSampling(len(rows), "cpu", SETTINGS[-1])
    rs.set(torch.arange(len(rows)), rows)
    got = rs.probs(logits)
    for i, p in enumerate(rows[:-1]):
        assert torch.allclose(got[i], probs(logits[i], p), atol=1e-6), p
        assert torch.allclose(rs.probs(logits[i:i + 1], torch.tensor([i]))[0], got[i]), p
    assert (rs.sample(logits)[-1] == logits[-1].argmax()).item()


def test_ties_at_the_top_k_cut_are_kept_and_top_p_keeps_one() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    kept = probs(logits, SamplingParams(1.0, top_k=2)) > 0
    assert kept.tolist() == [[True, False, True, True, False, True]]  # the 2nd's ties too
    for top_p in (1e-9, 1e-50):  # the second rounds to 0 in float32
        assert (probs(logits, SamplingParams(1.0, top_p=top_p)) > 0).sum() == 1


@pytest.mark.parametrize("p", SETTINGS[3:], ids=str)
def test_draws_follow_the_distribution(p: SamplingParams) -> None:
    """20,000 seeded draws of each row of a 12-token batch from `RowSampling.sample` against the
    definition; none outside what the filters keep."""
    logits = distinct_logits(2, 12, seed=2)
    want = defined(logits, p)
    rs = RowSampling(20_000, "cpu", p)
    torch.manual_seed(5)
    tok = rs.sample(logits.repeat(10_000, 1)).view(10_000, 2)
    for r in range(2):
        counts = torch.bincount(tok[:, r], minlength=12)
        assert (counts[want[r] == 0] == 0).all()
        # one token kept (top-k 1, a tiny top-p): every draw is it, no spread to test
        assert (want[r] > 0).sum() == 1 or chi_square_p(counts, want[r]) > 1e-3, (p, r)


def test_seeded_draws_repeat() -> None:
    logits = distinct_logits(64, 24, seed=3)
    rs = RowSampling(64, "cpu", SamplingParams(1.0, top_k=10, top_p=0.9))

    def drawn(seed: int, gen: bool) -> torch.Tensor:
        torch.manual_seed(seed)
        return rs.sample(logits, generator=torch.Generator().manual_seed(seed) if gen else None)

    for gen in (False, True):
        assert torch.equal(drawn(1, gen), drawn(1, gen)) and not torch.equal(drawn(1, gen),
                                                                               drawn(2, gen))


@pytest.mark.parametrize("topk,n", [(1, None), (3, 5)])
@pytest.mark.parametrize("params", [SamplingParams(1.0, top_p=0.7),
                                    SamplingParams(1.0, top_k=5, top_p=0.85, top_n_sigma=1.5)],
                         ids=str)
@torch.no_grad()
def test_drawn_drafts_stay_exact_under_top_p(params, topk: int, n: int | None,
                                             monkeypatch) -> None:
    """Drafts drawn from the drafter's filtered q and rejection-sampled, chain and tree: 2048
    draws of (x1, x2, x3) match the setting's exact joint, and not plain T's."""
    drawn_drafts_keep(params, topk, n, monkeypatch)


@torch.no_grad()
def test_a_temperature_near_zero_decodes_as_greedy(monkeypatch) -> None:
    """T 1e-5 spreads no mass past the argmax of logits that do not tie: the speculative chain
    decodes greedy's tokens."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target, prompt = small_target(), [3, 1, 4]
    seq = greedy_seq(Runtime(target, 1, 24), [prompt], 6)
    drafter = make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq.expand(4, -1), 1.0)
    dec = SpecDecoder(Runtime(target, 4, 24), drafter, 2, 1, None, SamplingParams(1e-5))
    torch.manual_seed(0)
    tokens = dec.generate([prompt] * 4, 6, eos_ids=[]).tokens
    assert all(t == seq[0, 3:9].tolist() for t in tokens)
