"""The Triton split linear (DRAFTSMITH_SPLIT_LINEAR_ROWS) gives F.linear's values: on CPU in
Triton's interpreter (fp32; conftest turns it on), on a GPU compiled (bf16 too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_inputs_are_split_into_at_most_eight_chunks_of_whole_blocks():
    """Inductor unrolls a sum of <= 8 partials into the consumer's loads."""
    from draftsmith.models.triton_linear import splitting

    assert splitting(576) == (128, 5)  # the default target's hidden size
    assert splitting(1536) == (192, 8)  # its MLP width
    assert splitting(1728) == (256, 7)  # the drafter's fused three aux states
    assert splitting(40) == (64, 1)


@pytest.mark.parametrize("rows,k,n,bias", [(25, 576, 960, False), (4, 1152, 70, True),
                                           (3, 100, 129, False), (32, 1536, 64, False)])
def test_split_linear_equals_f_linear(rows, k, n, bias):
    """Verify and drafter-depth rows; inputs and outputs that are not whole blocks; a bias; x as
    a strided view (a slice of a wider row), leading dims kept."""
    from draftsmith.models.triton_linear import split_linear

    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(1, rows, k + 8, generator=g).to(DEVICE)
    x = wide[..., 4 : 4 + k]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    y = split_linear(x, w, b)
    assert y.shape == (1, rows, n) and y.dtype == x.dtype
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-4)


def test_wide_outputs_and_rows_past_the_switch_keep_cublas(monkeypatch):
    from draftsmith.models import triton_linear

    monkeypatch.setattr(triton_linear, "SPLIT_LINEAR_ROWS", 32)
    w = torch.empty(960, 576)
    assert triton_linear.fits(25, w)
    assert not triton_linear.fits(33, w)
    assert not triton_linear.fits(25, torch.empty(49152, 576))  # a vocabulary head
    monkeypatch.setattr(triton_linear, "SPLIT_LINEAR_ROWS", 0)
    assert not triton_linear.fits(25, w)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 dot is wrong)")
def test_split_linear_in_bf16_at_the_default_targets_shapes():
    from draftsmith.models.triton_linear import split_linear

    g = torch.Generator("cuda").manual_seed(0)
    for rows, k, n in [(25, 576, 960), (25, 576, 3072), (25, 1536, 576), (4, 1152, 960)]:
        x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        ref = F.linear(x.float(), w.float())
        assert torch.allclose(split_linear(x, w).float(), ref, atol=3e-2)
