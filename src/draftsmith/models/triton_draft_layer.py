"""The EAGLE-3 drafter's decoder layer in one persistent Triton kernel, for graphed draft steps.

A batch-1 draft depth is a few rows through one decoder layer whose 8 MB of weights stream in
under 2 us on the H200, yet the compiled graph takes about a dozen kernels of 2-5 us each for it
(the input norms, four cuBLAS linears with their split-k reduces, RoPE and the cache writes, the
attention and its join, the residual norms): H200 run 26's probe counted 132 kernels and 0.40 ms
in a tree 7/4/24 draft, 29 % of the cycle. Here one launch does the layer: the embedding rows by
token id, both input norms, q/k/v with RoPE (k and v written to the cache at the rows' slots),
the masked attention over the cache split into chunks, the chunks' join, the o projection and
residual, the post-attention norm with gate/up and silu*mul, and the down projection and
residual. Each stage is a loop over its tasks (blocks of output features, or one KV head's chunk
of the cache); the programs, no more than the SMs so all are resident, meet at a grid barrier
(an atomic counter, zeroed before the launch) between stages. The products are tl.dot over
the rows padded to 16 (fp32 accumulation, software-pipelined loads), rounded to the weights'
dtype where the module's outputs are; the norms' 1/rms scales each product's sums.

`DRAFTSMITH_DRAFT_LAYER`: `off` (the default: H200, a 4-row depth 32.7 us fused against 27.1 in
the compiled module path, benchmarks/draft_layer.md), `fused` (one launch),
`staged` (one launch a stage, no barrier; what Triton's interpreter runs, CPU tests in fp32).
"""

from __future__ import annotations

import os

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.triton_attention import chunking
from draftsmith.models.triton_support import importable
from draftsmith.switches import env_choice, env_pow2

MODE = env_choice("DRAFTSMITH_DRAFT_LAYER", "off", ("off", "fused", "staged"))
MAX_ROWS = 32  # batch x tokens a call takes (the rows live in one program's registers)
# output features a task takes, by stage (tl.dot's least is 16; o and down take two blocks)
NB_QKV, NB_O, NB_GU, NB_D = (env_pow2(f"DRAFTSMITH_DRAFT_LAYER_NB_{s}", "16", 16)
                              for s in ("QKV", "O", "GU", "D"))
BLOCK_N = 64  # keys an attention task streams a step
BLOCK_K = env_pow2("DRAFTSMITH_DRAFT_LAYER_BK", "64", 16)  # input features a product's step
SPLITS = 8  # the most chunks the cache splits into (`triton_attention.chunking`)
WARPS = env_pow2("DRAFTSMITH_DRAFT_LAYER_WARPS", "4")
STAGES = 6
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# a fused launch runs only stages 1..UPTO (benchmarks/draft_layer.py --stages times the stages
# so; the layer's output is then wrong)
UPTO = STAGES


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def takes(drafter, tokens: torch.Tensor, hidden: torch.Tensor, caches, mask) -> bool:
    """Whether `forward` runs this call: the switch on, a one-layer drafter with the plain
    layer (no q/k norm, no qkv bias, unsharded), a cache, compiled CUDA code without autograd
    (or Triton's interpreter on CPU), up to MAX_ROWS rows, one dtype throughout."""
    if MODE == "off" or not AVAILABLE or caches is None or len(drafter.layers) != 1:
        return False
    attn = drafter.midlayer.self_attn
    cfg = drafter.cfg
    d = attn.d
    graphed = hidden.is_cuda and torch.compiler.is_compiling()
    return ((graphed or INTERPRETED and not hidden.is_cuda) and not torch.is_grad_enabled()
            and tokens.numel() <= MAX_ROWS and attn.qkv.bias is None and attn.q_norm is None
            and attn.heads == cfg.num_heads and attn.kv_heads == cfg.num_kv_heads
            and d >= 16 and d & (d - 1) == 0 and (d // 2) % NB_QKV == 0
            and cfg.hidden_size % (2 * NB_O) == 0 and cfg.hidden_size % (2 * NB_D) == 0
            and cfg.intermediate_size % NB_GU == 0
            and (mask is None or mask.dtype == torch.bool)
            and hidden.dtype == drafter.fc.weight.dtype == drafter.embed_tokens.weight.dtype)


def forward(drafter, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            cache, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The drafter's layer for tokens/positions/slots [B, Q] and hidden [B, Q, H] as
    `Eagle3Layer.forward` computes it, writing k/v into cache at slots; mask: [B, 1, Q, S] bool
    (one copy per query token, not per head). Returns the layer's output [B, Q, H]."""
    layer = drafter.midlayer
    b, q_len = tokens.shape
    if mask.shape != (b, 1, q_len, cache.k.shape[2]):
        raise DraftsmithError(f"draft layer kernel: mask {tuple(mask.shape)} for {b} x {q_len} "
                              f"tokens over {cache.k.shape[2]} slots")
    sync = torch.zeros(4, dtype=torch.int32, device=hidden.device)
    qkv, gate_up = folded(layer)
    return torch.ops.draftsmith.draft_layer(
        tokens, drafter.embed_tokens.weight, hidden, positions, drafter.inv_freq.float(), slots,
        mask, layer.hidden_norm.weight, qkv, layer.self_attn.o.weight, gate_up,
        layer.mlp.down.weight, cache.k, cache.v, sync, layer.input_layernorm.eps,
        drafter.cfg.norm_before_residual, MODE != "fused" or INTERPRETED,
    )


def prepare(drafter) -> None:
    """Keeps the folded weights (`folded`) on the drafter's layer, so that compiled calls read
    them instead of folding them in their graphs. Call it again after changing the weights: the
    drafter runtime does on its creation."""
    layer = drafter.midlayer
    layer.__dict__.pop("_kernel_weights", None)
    with torch.no_grad():
        layer.__dict__["_kernel_weights"] = folded(layer)


def folded(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The qkv and gate_up weights with the norms before them folded in (each input column
    scaled by its norm weight, rounded to the weights' dtype), as `prepare` kept them, else
    made now."""
    kept = layer.__dict__.get("_kernel_weights")
    if kept is not None:
        return kept
    norms = torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight]).float()
    qkv = layer.self_attn.qkv.weight
    gate_up = layer.mlp.gate_up.weight
    return ((qkv.float() * norms).to(qkv.dtype),
            (gate_up.float() * layer.post_attention_layernorm.weight.float()).to(gate_up.dtype))


def _register() -> None:
    from torch.library import triton_op, wrap_triton

    from draftsmith.models import draft_layer_kernel

    kernel = wrap_triton(draft_layer_kernel.draft_layer)

    @triton_op("draftsmith::draft_layer", mutates_args={"kc", "vc", "sync"})
    def op(tok: torch.Tensor, emb: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
           freq: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor, w_hn: torch.Tensor,
           w_qkv: torch.Tensor, w_o: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor,
           kc: torch.Tensor, vc: torch.Tensor,
           sync: torch.Tensor, eps: float, resid_normed: bool, staged: bool) -> torch.Tensor:
        b, q_len, hidden = x.shape
        kv_heads, slots, d = kc.shape[1], kc.shape[2], kc.shape[3]
        heads = w_o.shape[1] // d
        inter = w_d.shape[1]
        rows = b * q_len
        dev = {"device": x.device}
        br = _pow2(heads // kv_heads * q_len, 16)
        chunk, splits = chunking(slots)
        qb = torch.empty((rows, heads * d), dtype=x.dtype, **dev)
        mp = torch.empty((b * kv_heads * br, splits), dtype=torch.float32, **dev)
        lp = torch.empty_like(mp)
        ap = torch.empty((b * kv_heads * br, splits, d), dtype=torch.float32, **dev)
        att = torch.empty((rows, heads * d), dtype=x.dtype, **dev)
        h1 = torch.empty((rows, hidden), dtype=x.dtype, **dev)
        act = torch.empty((rows, inter), dtype=x.dtype, **dev)
        out = torch.empty((b, q_len, hidden), dtype=x.dtype, **dev)
        bm = _pow2(rows, 16)
        tasks = ((heads + 2 * kv_heads) * (d // 2 // NB_QKV), b * kv_heads * splits,
                 b * kv_heads, hidden // (2 * NB_O), inter // NB_GU, hidden // (2 * NB_D))
        args = (tok.reshape(-1), emb, x.reshape(rows, hidden), pos.reshape(-1), freq,
                slot.reshape(-1), mask, w_hn, w_qkv, w_o, w_gu, w_d, kc, vc,
                qb, mp, lp, ap, att, h1, act, out, sync, *kc.stride(), mask.stride(0),
                mask.stride(2), mask.stride(3), rows, q_len, b, slots, chunk, splits, eps,
                d ** -0.5)
        meta = dict(H=hidden, D=d, NH=heads, KVH=kv_heads, INTER=inter, BM=bm,
                    BK=BLOCK_K, BR=br, BN=BLOCK_N, SPLITS=SPLITS, NB_QKV=NB_QKV,
                    NB_O=NB_O, NB_GU=NB_GU, NB_D=NB_D, RESID_NORMED=resid_normed,
                    IEEE=x.dtype == torch.float32, num_warps=WARPS)
        if staged:
            for stage, n in enumerate(tasks, 1):
                kernel[(n,)](*args, FIRST=stage, LAST=stage, BARRIER=False, **meta)
        else:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            kernel[(min(max(tasks), sms),)](*args, FIRST=1, LAST=UPTO, BARRIER=True, **meta)
        return out


AVAILABLE = importable()
if AVAILABLE:
    _register()
