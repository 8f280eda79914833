"""SGLang's `top_n_sigma` was refused: now sampled as its PR #2192 (and llama.cpp) define it, the
tokens whose tempered logit lies within n standard deviations of the row's largest (n <= 0, -1
too: off), before top-k and top-p; per row in one batch, and exactly in speculative sampling."""

from __future__ import annotations

import math

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter
from test_speculative_sampling import (
    alternating_counts,
    chi_square_p,
    exact_joint,
    filtered_by_hand,
    small_target,
)

from draftsmith.engine import speculative
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


def by_hand(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-nσ from its definition, row by row (max - n * std of the tempered row, ties kept),
    then temperature, top-k and top-p over what it kept (`filtered_by_hand`)."""
    rows = logits.float().reshape(-1, logits.shape[-1])
    if p.top_n_sigma > 0:
        kept = []
        for row in rows:
            t = row / p.temperature
            floor = t.max() - p.top_n_sigma * t.std()
            kept.append(row.masked_fill(t < floor, float("-inf")))
        rows = torch.stack(kept)
    plain = SamplingParams(p.temperature, p.top_p, p.top_k)
    return filtered_by_hand(rows, plain).view(logits.shape)


SETTINGS = [SamplingParams(1.0, top_n_sigma=1.0), SamplingParams(0.7, top_n_sigma=0.5),
            SamplingParams(1.5, top_n_sigma=2.0), SamplingParams(1.0, top_n_sigma=2, top_k=3),
            SamplingParams(0.8, top_n_sigma=1.5, top_p=0.7),
            SamplingParams(1.2, top_k=20, top_p=0.9, top_n_sigma=1.0)]


def logits_of(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(4)) * 3


@pytest.mark.parametrize("p", SETTINGS, ids=str)
def test_probs_keep_what_top_n_sigma_keeps(p: SamplingParams) -> None:
    logits = logits_of(4, 2, 64)
    got = probs(logits, p)
    assert torch.allclose(got, by_hand(logits, p), atol=1e-6)
    sigma = probs(logits, SamplingParams(p.temperature, top_n_sigma=p.top_n_sigma)) > 0
    assert (sigma.sum(-1) < logits.shape[-1] / 2).all()  # it cuts every row
    others = probs(logits, SamplingParams(p.temperature, p.top_p, p.top_k)) > 0
    assert ((got > 0) <= (sigma & others)).all()  # each filter cuts on top of the others


def test_the_kept_set_does_not_depend_on_the_temperature() -> None:
    """max and std both scale by 1 / T: the support is the same at every temperature."""
    logits = logits_of(8, 64)
    supports = [probs(logits, SamplingParams(t, top_n_sigma=1.0)) > 0 for t in (0.3, 1.0, 3.0)]
    assert all(torch.equal(supports[0], s) for s in supports[1:])


def test_rows_of_one_batch_each_take_their_own_n() -> None:
    rows = SETTINGS + [SamplingParams(1.0), SamplingParams(0.9, top_p=0.8)]
    logits = logits_of(len(rows), 3, 64)
    rs = RowSampling(len(rows), "cpu", SETTINGS[0])
    rs.set(torch.arange(len(rows)), rows)
    got = rs.probs(logits)
    for i, p in enumerate(rows):
        assert torch.allclose(got[i], by_hand(logits[i], p), atol=1e-6), p
        assert torch.allclose(got[i], probs(logits[i], p), atol=1e-6), p


def test_off_values_and_the_kind() -> None:
    assert SamplingParams(1.0, top_n_sigma=-1) == SamplingParams(1.0)
    assert SamplingParams(1.0, top_n_sigma=0).kind == "temperature"
    assert SamplingParams(1.0, top_n_sigma=0.5).kind == "filtered"
    assert SamplingParams(0.0, top_n_sigma=0.5).kind == "greedy"
    logits = logits_of(2, 64)
    assert torch.equal(probs(logits, SamplingParams(1.0, top_n_sigma=-1)),
                       probs(logits, SamplingParams(1.0)))


@pytest.mark.parametrize("bad", [-2.5, -0.5, math.nan, math.inf, "1", True])
def test_a_bad_top_n_sigma_is_refused_by_name(bad: object) -> None:
    with pytest.raises(DraftsmithError, match=r"^top_n_sigma must be a finite number >= 0 \(0 or "
                                              r"-1: off\), got "):
        SamplingParams(1.0, top_n_sigma=bad)  # type: ignore[arg-type]


@torch.no_grad()
def test_speculative_rows_draw_their_top_n_sigma_target(monkeypatch) -> None:
    """A chain decoder's batch, half the rows at top-nσ and half at plain temperature: each
    half's 2048 draws of (x1, x2, x3) match its own setting's exact joint, not the other's."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target, prompt, b = small_target(), [3, 1, 4], 512
    settings = (SamplingParams(1.0, top_n_sigma=0.8), SamplingParams(1.0))
    joints = [exact_joint(target, prompt, p, 8) for p in settings]
    assert (joints[0] > 0).sum() < (joints[1] > 0).sum() / 2  # top-nσ cuts much here
    seq = greedy_seq(Runtime(target, 1, 24), [prompt], 4).expand(b, -1).contiguous()
    drafter = make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq, 1.0)
    rows = list(settings) * (b // 2)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, 2, 1, None, settings[0])
    res, counts = alternating_counts(dec, prompt, b, rows)
    assert res.mean_accept_length > 1.3
    assert chi_square_p(counts[0], joints[0]) > 1e-3 and chi_square_p(counts[1], joints[1]) > 1e-3
    assert chi_square_p(counts[0], joints[1]) < 1e-6


@pytest.mark.parametrize("topk,n", [(1, None), (3, 5)])
@torch.no_grad()
def test_drawn_drafts_keep_the_top_n_sigma_target(topk: int, n: int | None, monkeypatch) -> None:
    """Drafts drawn from the drafter (its q under the same top-nσ) and rejection-sampled, in a
    chain and a tree: 2048 draws of (x1, x2, x3) match top-nσ's exact joint, not plain T's."""
    drawn_drafts_keep(SamplingParams(1.0, top_n_sigma=0.8), topk, n, monkeypatch)


def drawn_drafts_keep(params: SamplingParams, topk: int, n: int | None, monkeypatch) -> None:
    """2048 draws of (x1, x2, x3) under drafts drawn from the drafter and rejection-sampled
    match `params`' exact joint, and not plain T's."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")
    target, prompt, b = small_target(), [3, 1, 4], 512
    drafter = make_drafter(target, 6, seed=6, std=0.6)
    drafter.lm_head.weight.mul_(0.1)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, 2, topk, n, params)
    assert dec.drawn
    torch.manual_seed(7)
    counts = torch.zeros(8, 8, 8)
    for _ in range(4):
        for t in dec.generate([prompt] * b, 3, eos_ids=[]).tokens:
            counts[t[0], t[1], t[2]] += 1
    assert chi_square_p(counts, exact_joint(target, prompt, params, 8)) > 1e-3
    assert chi_square_p(counts, exact_joint(target, prompt, SamplingParams(1.0), 8)) < 1e-6
