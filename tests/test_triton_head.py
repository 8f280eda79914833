"""The Triton head + top-k (models/triton_head.py) gives what the vocabulary head followed by
the tree's top-k of log-softmax gives: on CPU in Triton's interpreter (fp32), on a GPU in bf16."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head in the weights' dtype (cuBLAS on a GPU: fp32 sums rounded to bf16), then the
    tree's top-k of log-softmax over those logits in fp32."""
    from draftsmith.engine.tree import top_k_by_max

    logits = (x @ w.T).float()
    v, i = top_k_by_max(logits, k)
    return v - logits.logsumexp(-1, keepdim=True), i


@pytest.mark.parametrize("rows,vocab,hidden,k", [(4, 1000, 96, 4), (1, 300, 64, 1),
                                                 (20, 517, 32, 8)])
def test_head_top_k_equals_the_head_then_top_k(rows, vocab, hidden, k):
    """Rows past one program's block, a vocabulary that ends inside a block (300 < 3 blocks),
    hidden sizes past and below one step; values and ids as the reference gives them."""
    from draftsmith.models.triton_head import head_top_k

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE)
    w = torch.randn(vocab, hidden, generator=g).to(DEVICE) / hidden ** 0.5
    v, i = head_top_k(x, w, k)
    rv, ri = reference(x, w, k)
    assert v.shape == (rows, k) and i.dtype == torch.int64
    assert torch.equal(i, ri)
    assert torch.allclose(v, rv, atol=1e-5)
    assert (v[:, :-1] >= v[:, 1:]).all()


def test_ties_go_to_the_lower_id_within_and_across_blocks():
    """Vocabulary rows 5, 7 (one block) and 200 (the next) equal: ids 5, 7, 200 in that order,
    as the tree's own top-k orders them."""
    from draftsmith.models.triton_head import head_top_k

    g = torch.Generator().manual_seed(0)
    # small integers and eighths: every logit is exact in fp32 whatever order a BLAS or the
    # interpreter sums in, so the three tied logits are bitwise equal on any machine
    x = torch.randint(1, 4, (2, 32), generator=g).float().to(DEVICE)
    w = (torch.randint(-2, 3, (300, 32), generator=g).float() * 0.125).to(DEVICE)
    w[7] = w[200] = w[5] = 1.0
    v, i = head_top_k(x, w, 4)
    assert i[:, :3].tolist() == [[5, 7, 200]] * 2
    assert torch.equal(i, reference(x, w, 4)[1])
    assert v[0, 0] == v[0, 1] == v[0, 2]


@pytest.mark.parametrize("rows,vocab,hidden,k", [(4, 1000, 96, 4), (1, 300, 64, 1),
                                                 (33, 2000, 64, 4)])
def test_the_kernel_joins_its_blocks_as_the_tensor_ops_do(rows, vocab, hidden, k):
    """DRAFTSMITH_HEAD_JOIN=kernel: each row block's last program joins the blocks (the counter
    names it); ids equal to the tensor ops' join, values to rounding, over three row blocks and
    a vocabulary ending inside a block, twice in a row on one counter, left at zero."""
    from draftsmith.models.triton_head import counter, head_top_k

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE)
    w = torch.randn(vocab, hidden, generator=g).to(DEVICE) / hidden ** 0.5
    counts = counter(DEVICE)
    want_v, want_i = head_top_k(x, w, k)
    for _ in range(2):
        v, i = head_top_k(x, w, k, counts)
        assert torch.equal(i, want_i)
        assert torch.allclose(v, want_v, atol=1e-6)
        assert not counts.any()
    small = torch.zeros(-(-rows // 16) - 1, dtype=torch.int32, device=DEVICE)
    for bad in (small, counts.long()):
        with pytest.raises(DraftsmithError, match="int32 counter"):
            head_top_k(x, w, k, bad)


COMPILE_FOR_HOPPER = """
from draftsmith.models import triton_head as th

kern = th._kernel()
types = ["*bf16", "*bf16", "*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*i64", "*i32"] + ["i32"] * 8
sig = dict(zip(kern.arg_names, types))
for join in (False, True):
    const = dict(K=4, BLOCK_V=th.BLOCK_V, BLOCK_H=th.BLOCK_H, BLOCK_R=th.BLOCK_R, IEEE=False,
                 JOIN=join, CANDS=1024, BLOCKS=256)
    src = ASTSource(fn=kern, signature={**sig, **dict.fromkeys(const, "constexpr")},
                    constexprs={(kern.arg_names.index(n),): v for n, v in const.items()})
    triton.compile(src, target=hopper, options={"num_warps": th.WARPS, "num_stages": th.STAGES})
print("compiled")
"""


def test_the_kernel_compiles_for_a_hopper_gpu():
    """The real compiler, for sm_90, with and without the join (no GPU needed). The interpreter
    runs kernels as Python and misses what only the compiler checks: the join once reused a
    name the kernel had typed as a tensor, which the compiler refuses."""
    from conftest import compile_for_hopper

    compile_for_hopper(COMPILE_FOR_HOPPER)


def test_bad_calls_are_refused():
    from draftsmith.models.triton_head import head_top_k

    x, w = torch.randn(2, 32).to(DEVICE), torch.randn(40, 32).to(DEVICE)
    for args in ((x, w, 0), (x, w, 17), (x, w[:, :16], 2), (x.double(), w, 2), (x[None], w, 2)):
        with pytest.raises(DraftsmithError, match="head_top_k"):
            head_top_k(*args)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 dot is wrong)")
def test_head_top_k_in_bf16_at_the_default_drafters_shape():
    """Draft vocabulary 24,576 x hidden 576, 4 rows (batch 1 at top-k 4): the ids the cuBLAS
    head and the tree's top-k pick, logits rounded to bf16 alike (bf16 ties, which go to the
    lower id, are common; H200 run 22's fp32 logits built other trees and accepted 4.15 tokens
    a cycle against 4.22)."""
    from draftsmith.models.triton_head import counter, head_top_k

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 576, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(24_576, 576, generator=g) / 24).to(DEVICE, torch.bfloat16)
    v, i = head_top_k(x, w, 4)
    rv, ri = reference(x, w, 4)
    assert torch.equal(i, ri) and torch.allclose(v, rv, atol=1e-3)
    counts = counter(DEVICE)  # DRAFTSMITH_HEAD_JOIN=kernel: the last program joins, on the GPU
    for _ in range(3):
        jv, ji = head_top_k(x, w, 4, counts)
        assert torch.equal(ji, i) and torch.allclose(jv, v, atol=1e-6) and not counts.any()
