"""The decode-shape attention path gives what SDPA gives."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import (
    causal_mask,
    matmul_attention,
    small_attention,
)


def test_small_attention_equals_sdpa_with_gqa_rows_and_a_mask():
    g = torch.Generator().manual_seed(0)
    b, kv_heads, groups, q, s, d = 3, 2, 3, 4, 40, 16
    qg = torch.randn(b, kv_heads, groups * q, d, generator=g)
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g)
    positions = torch.tensor([[5, 6, 7, 8], [20, 21, 22, 23], [0, 1, 2, 3]])
    mask = causal_mask(positions, s).repeat(1, 1, groups, 1)
    ref = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    out = small_attention(qg, k, v, mask)
    assert torch.allclose(out, ref, atol=1e-5)
    mask[0, 0, 0, 5] = False  # the mask is applied: row 0 loses the one slot it attended last
    assert not torch.allclose(small_attention(qg, k, v, mask)[0, 0, 0], ref[0, 0, 0], atol=1e-3)


def test_causal_mask_sees_its_own_slot_and_a_window_of_the_latest():
    """The SDPA comparisons share causal_mask with their reference, so it is pinned here: a
    position sees its own slot and those before; a window of 3 (HF's kv > q - window) the 3
    latest of them."""
    pos = torch.tensor([[0, 5]])
    seen = [torch.nonzero(row).flatten().tolist() for row in causal_mask(pos, 8)[0, 0]]
    assert seen == [[0], [0, 1, 2, 3, 4, 5]]
    seen = [torch.nonzero(row).flatten().tolist() for row in causal_mask(pos, 8, 3)[0, 0]]
    assert seen == [[0], [3, 4, 5]]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matmul_attention_equals_sdpa_at_verify_shapes(dtype, atol):
    g = torch.Generator().manual_seed(1)
    b, kv_heads, groups, q, s, d = 2, 3, 3, 8, 64, 16
    qg = torch.randn(b, kv_heads, groups * q, d, generator=g).to(dtype)
    k = torch.randn(b, kv_heads, s, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, s, d, generator=g).to(dtype)
    positions = torch.arange(q).repeat(b, 1) + torch.tensor([[10], [40]])
    mask = causal_mask(positions, s).repeat(1, 1, groups, 1)
    mask[1, 0, 5, 41] = False  # a tree-like hole: not plain causal
    ref = F.scaled_dot_product_attention(qg.float(), k.float(), v.float(), attn_mask=mask)
    out = matmul_attention(qg, k, v, mask)
    assert out.dtype == dtype and torch.allclose(out.float(), ref, atol=atol)
    mask[0, 0, 0, 10] = False  # the mask is applied
    assert not torch.allclose(matmul_attention(qg, k, v, mask)[0, 0, 0].float(), ref[0, 0, 0],
                              atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_compiled_parts_equal_eager_on_cpu(tmp_path, monkeypatch, static):
    """The torch.compile'd layer split, final norm and aux sums (inductor's CPU backend here;
    CUDA graphs run the same parts on GPU) give the eager forward's logits, aux and caches, at
    two token counts; static: under DRAFTSMITH_STATIC_SHAPES=1, a graph for each."""
    from conftest import write_tiny_folder

    from draftsmith.engine import runtime
    from draftsmith.engine.runtime import compile_layers
    from draftsmith.models.llama import KVCache
    from draftsmith.targets import load_target

    monkeypatch.setattr(runtime, "STATIC_SHAPES", static)
    torch._dynamo.reset()
    model = load_target(write_tiny_folder(tmp_path, "qwen3")).build(torch.float32, "cpu")
    compile_layers(model)
    att = model.layers[0].attn
    ids, pos = torch.randint(5, 100, (2, 7)), torch.arange(7).expand(2, 7)
    outs = []
    for compiled in (False, True):
        caches = [KVCache(torch.zeros(2, att.kv_heads, 16, att.d),
                          torch.zeros(2, att.kv_heads, 16, att.d)) for _ in model.layers]
        with torch.no_grad():
            first = model(ids[:, :4], pos[:, :4], caches, aux_ids=(-1, 0, 3), compiled=compiled)
            last = model(ids[:, 4:], pos[:, 4:], caches, aux_ids=(-1, 0, 3), compiled=compiled)
        outs.append((first, last, caches))
    (f0, l0, c0), (f1, l1, c1) = outs
    for a, b in ((f0, f1), (l0, l1)):
        assert torch.allclose(a.logits, b.logits, atol=1e-5)
        assert torch.allclose(a.aux, b.aux, atol=1e-5)
    assert all(torch.allclose(x.k, y.k, atol=1e-5) and torch.allclose(x.v, y.v, atol=1e-5)
               for x, y in zip(c0, c1, strict=True))


@pytest.mark.parametrize("rows", [1, 4, 25])
@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_reduce_linear_compiles_to_one_kernel_for_all_rows(rows):
    """Compiled, the rows' reductions of a small linear fuse into one kernel, which shares each
    weight load among them (the skinny GEMM that DRAFTSMITH_SMALL_LINEAR_ROWS relies on), with
    its bias and rounding fused in; a drafter depth's 4 rows and a 24-token tree's verify."""
    import re

    from torch._inductor.utils import run_and_get_code

    from draftsmith.models.parallel import reduce_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w, bias = (torch.randn(n, generator=g).to(torch.bfloat16) for n in ((160, 96), (160,)))
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(reduce_linear, fullgraph=True), x, w / 10, bias)
    wrapper = "\n".join(code)
    body = wrapper[wrapper.index("def call("):]
    assert len(re.findall(r"\bcpp_fused\w*\(", body[:body.index("return ")])) == 1
    ref = F.linear(x.float(), w.float() / 10, bias.float())
    assert out.shape == (rows, 160) and torch.allclose(out.float(), ref, atol=3e-2, rtol=1e-2)


TEMPLATES = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON,ATEN"}


@pytest.mark.parametrize("static", [False, True])
def test_static_shapes_compile_each_shape_and_never_go_symbolic(monkeypatch, static):
    """DRAFTSMITH_STATIC_SHAPES=1: an engine compile meets rows 2, 25, 8 and 4 (a chain's and a
    tree's verify, drafter depths) and specializes on each. Without it dynamo goes symbolic at
    the second shape and the rest reuse that graph, which is what the switch exists to test on
    the GPU; both ways the results are right."""
    from torch._dynamo.utils import counters

    from draftsmith.engine import runtime

    monkeypatch.setattr(runtime, "STATIC_SHAPES", static)
    torch._dynamo.reset()
    counters.clear()
    fn = runtime.engine_compile(lambda x, w: F.linear(x, w).relu(), fullgraph=True)
    w = torch.randn(16, 8)
    for rows in (2, 25, 8, 4):
        x = torch.randn(rows, 8)
        assert torch.allclose(fn(x, w), F.linear(x, w).relu(), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == (4 if static else 2)


@pytest.mark.parametrize("pinned,templates,extra,options", [
    (False, False, {}, None), (True, False, {}, {"deterministic": True}),
    (False, True, {}, TEMPLATES),
    (True, False, {"combo_kernels": True}, {"deterministic": True, "combo_kernels": True})])
def test_engine_compile_passes_the_switches_to_inductor(monkeypatch, pinned, templates, extra,
                                                        options):
    """DRAFTSMITH_PIN_REDUCTIONS, DRAFTSMITH_GEMM_TEMPLATES and DRAFTSMITH_INDUCTOR_OPTIONS reach
    torch.compile as inductor's options (the CPU backend has no Triton to pin or template; the GPU
    test checks the kernels carry the pin), and the compiled linear is right."""
    from draftsmith.engine import runtime

    seen, real = [], torch.compile

    def spy(fn, **kw):
        seen.append(kw.get("options"))
        return real(fn, **kw)

    monkeypatch.setattr(runtime, "PIN_REDUCTIONS", pinned)
    monkeypatch.setattr(runtime, "GEMM_TEMPLATES", templates)
    monkeypatch.setattr(runtime, "INDUCTOR_OPTIONS", extra)
    monkeypatch.setattr(runtime.torch, "compile", spy)
    torch._dynamo.reset()
    fn = runtime.engine_compile(lambda x, w: F.linear(x, w).relu(), fullgraph=True)
    x, w = torch.randn(25, 96), torch.randn(160, 96)
    assert torch.allclose(fn(x, w), F.linear(x, w).relu(), atol=1e-5)
    assert seen == [options]


def test_inductor_options_are_read_as_each_options_type(monkeypatch):
    """DRAFTSMITH_INDUCTOR_OPTIONS: dotted keys, bools as 1/0, ints as ints; `none` is none."""
    from draftsmith.engine.runtime import inductor_options
    from draftsmith.switches import env_assignments

    name = "DRAFTSMITH_INDUCTOR_OPTIONS"
    monkeypatch.setenv(name, " triton.enable_pdl=1, combo_kernels=0,combo_kernel_max_num_nodes=4 ")
    got = inductor_options(env_assignments(name, "none"))
    assert got == {"triton.enable_pdl": True, "combo_kernels": False,
                   "combo_kernel_max_num_nodes": 4}
    assert type(got["combo_kernel_max_num_nodes"]) is int
    monkeypatch.setenv(name, "fx_graph_remote_cache=0")  # None by default, declared bool | None
    assert inductor_options(env_assignments(name, "none")) == {"fx_graph_remote_cache": False}
    monkeypatch.setenv(name, "max_autotune_gemm_backends=TRITON,ATEN; combo_kernels=1")
    assert inductor_options(env_assignments(name, "none")) == {
        "max_autotune_gemm_backends": "TRITON,ATEN", "combo_kernels": True}
    for unset in ("none", ""):
        monkeypatch.setenv(name, unset)
        assert inductor_options(env_assignments(name, "none")) == {}


@pytest.mark.parametrize("value,says", [("combo_kernel=1", "no option 'combo_kernel'"),
                                        ("combo_kernels=yes", "takes 1 or 0"),
                                        ("combo_kernel_max_num_nodes=many", "takes an int"),
                                        ("combo_kernels=1,combo_kernels=0", "new key=value"),
                                        ("combo_kernels", "new key=value"),
                                        ("multi_kernel_hints=1", "takes a list, not settable")])
def test_a_bad_inductor_option_is_refused_before_any_compile(monkeypatch, value, says):
    from draftsmith.engine.runtime import inductor_options
    from draftsmith.switches import env_assignments

    monkeypatch.setenv("DRAFTSMITH_INDUCTOR_OPTIONS", value)
    with pytest.raises(DraftsmithError, match=re.escape(says)):
        inductor_options(env_assignments("DRAFTSMITH_INDUCTOR_OPTIONS", "none"))


@pytest.mark.parametrize("limit", [0, 2])
def test_pin_rows_keeps_the_pin_to_forwards_of_at_most_that_many_rows(monkeypatch, tmp_path,
                                                                       limit):
    """DRAFTSMITH_PIN_ROWS=2: the target's forwards over 1x2 token rows run the pinned compiled
    parts and those over 2x2 rows a second, unpinned set; a one-token step over more than 2 rows
    its batch size's own unpinned set, compiled for static shapes; a decode step's bookkeeping
    follows the pin by its batch. 0 pins every compile (the default is 1). A spy stands in for
    torch.compile and runs the parts eagerly, so this checks which compile each forward reaches."""
    from conftest import write_tiny_folder

    from draftsmith.engine import runtime
    from draftsmith.engine.generate import DecodeState
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.targets import load_target

    calls = []

    def spy(fn, options=None, **kw):
        def run(*args, **kwargs):
            calls.append(options if kw.get("dynamic") is None else (options, kw["dynamic"]))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(runtime, "PIN_REDUCTIONS", True)
    monkeypatch.setattr(runtime, "PIN_ROWS", limit)
    monkeypatch.setattr(runtime.torch, "compile", spy)
    model = load_target(write_tiny_folder(tmp_path)).build(torch.float32, "cpu")
    rt = runtime.Runtime(model, 4, 32, graphs=False, compile=True)
    pinned, free = {"deterministic": True}, None
    for b, want in ((1, pinned), (2, free if limit else pinned)):
        calls.clear()
        with torch.no_grad():
            model(torch.randint(5, 100, (b, 2)), torch.arange(2).expand(b, 2), compiled=True)
        assert calls == [want] * (len(model.layers) + 2)
    # one-token steps past the limit: their batch size's own unpinned set, static shapes
    step = (free, False) if limit else pinned
    for b, want in ((1, pinned), (4, step), (3, step)):
        calls.clear()
        with torch.no_grad():
            model(torch.randint(5, 100, (b, 1)), torch.full((b, 1), 3), compiled=True)
        assert calls == [want] * (len(model.layers) + 2)
    assert sorted(model.compiled["step"][1]) == [3, 4] if limit else "step" not in model.compiled
    for b, want in ((2, pinned), (4, free if limit else pinned)):
        calls.clear()
        st = DecodeState(rt, b, [0], SamplingParams())
        st.advance_compiled(torch.zeros(b, 100))
        assert calls == [want]


def test_gemm_templates_under_the_pin_are_refused_by_name(monkeypatch):
    from draftsmith.engine import runtime

    monkeypatch.setattr(runtime, "PIN_REDUCTIONS", True)
    monkeypatch.setattr(runtime, "GEMM_TEMPLATES", True)
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_PIN_REDUCTIONS=0"):
        runtime.engine_compile(lambda x: x + 1)


BAD_CHOICES = [("DRAFTSMITH_DECODE_ATTENTION", "flash"), ("DRAFTSMITH_VERIFY_ATTENTION", "small"),
               ("DRAFTSMITH_SMALL_LINEAR_ROWS", "-4"), ("DRAFTSMITH_SMALL_ATTENTION_ROWS", "many"),
               ("DRAFTSMITH_MATMUL_ATTENTION_TOKENS", "6.4"), ("DRAFTSMITH_TREE_TOPK", "heap"),
               ("DRAFTSMITH_FUSED_PHASES", "verify"), ("DRAFTSMITH_PIN_REDUCTIONS", "yes"),
               ("DRAFTSMITH_GEMM_TEMPLATES", "on"), ("DRAFTSMITH_PIN_ROWS", "all"),
               ("DRAFTSMITH_EXACT_END", "2"), ("DRAFTSMITH_STATIC_SHAPES", "yes"),
               ("DRAFTSMITH_STEP_SETS", "per-batch"), ("DRAFTSMITH_ATTN_BLOCK_N", "48"),
               ("DRAFTSMITH_ATTN_WARPS", "3"), ("DRAFTSMITH_LINEAR_BLOCK_N", "8"),
               ("DRAFTSMITH_DRAFT_HEAD", "cutlass"), ("DRAFTSMITH_NORM_LINEAR_BLOCK_N", "24"),
               ("DRAFTSMITH_ROOT_HEAD", "cublas"), ("DRAFTSMITH_HEAD_JOIN", "inductor")]
# one fresh process imports the engine under each bad value in turn (draftsmith's modules
# dropped between imports, torch kept): as a user's process would, at a fraction of the cost
IMPORT_EACH = """
import json, os, sys
import torch
out = {}
for var, bad in json.loads(sys.argv[1]) + [("(none)", "")]:
    for name in [m for m in sys.modules if m.split(".")[0] == "draftsmith"]:
        del sys.modules[name]
    os.environ[var] = bad
    try:
        import draftsmith.engine.speculative
        out[var] = None
    except Exception as e:
        out[var] = f"{type(e).__name__}: {e}"
    del os.environ[var]
print(json.dumps(out))
"""


def test_an_unknown_engine_choice_is_refused_with_the_choices():
    """Every engine switch refuses a value it does not know at import, naming the variable, the
    value and the choices."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSMITH_")}
    r = subprocess.run([sys.executable, "-c", IMPORT_EACH, json.dumps(BAD_CHOICES)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got.pop("(none)") is None  # the same imports with no bad value go through
    for var, bad in BAD_CHOICES:
        msg = got[var]
        assert msg and msg.startswith(f"DraftsmithError: {var}={bad!r}: ") and "use " in msg, msg


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_reduce_linear_equals_f_linear_eager_and_compiled(dtype, atol):
    """The reduction form of a small linear (DRAFTSMITH_SMALL_LINEAR_ROWS) gives F.linear's
    values at a drafter depth's shapes (4 rows, a fused qkv) and keeps the leading dims."""
    from draftsmith.models.parallel import reduce_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 96, generator=g).to(dtype)
    w = (torch.randn(160, 96, generator=g) / 10).to(dtype)
    bias = torch.randn(160, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float())
    for fn in (reduce_linear, torch.compile(reduce_linear, fullgraph=True)):
        out = fn(x, w)
        assert out.shape == (1, 4, 160) and out.dtype == dtype
        assert torch.allclose(out.float(), ref, atol=atol, rtol=1e-2)
        biased = fn(x, w, bias).float()
        assert torch.allclose(biased, ref + bias.float(), atol=atol, rtol=1e-2)
    assert not torch.allclose(reduce_linear(x, w.flip(0)).float(), ref, atol=atol)
    one = reduce_linear(x[0, :1], w)  # a single row without a batch dim: [1, out]
    assert one.shape == (1, 160) and torch.allclose(one.float(), ref[0, :1], atol=atol, rtol=1e-2)


def test_the_readme_switch_table_states_each_switch_and_the_codes_default():
    """Every DRAFTSMITH_ engine switch the code reads at import is a row of the README's table,
    and the row's default is the literal the code falls back to (the first one, for a default
    that depends on CUDA)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows = dict(re.findall(r"^\| `(DRAFTSMITH_\w+)` \| `([^`]+)`", (root / "README.md").read_text(),
                           re.M))
    code = {}
    for f in (root / "src" / "draftsmith").rglob("*.py"):
        for var, default in re.findall(r'(?:env_\w+|os\.environ\.get)\(\s*"(DRAFTSMITH_\w+)",\s*'
                                       r'"([^"]*)"', f.read_text()):
            code[var] = default
    assert len(code) >= 10, code
    assert rows == code
