"""GPU checks (run on the lent H200 with `pytest -m gpu`): graphs change nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import count_compiled_calls, write_tiny_folder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def route_one_token_attention(monkeypatch, g: int, allowed: str | None) -> torch.Tensor | None:
    """Tracing a one-token step (g query rows) through any attention but `allowed` (SDPA
    included; None: every traced one fails) fails the compile (a raise at trace time adds no
    guard); returns the counter of `allowed`'s runs in compiled code (`count_compiled_calls`)."""
    from draftsmith.models import llama, triton_attention

    places = {"small": (llama, "small_attention"), "matmul": (llama, "matmul_attention"),
              "sdpa": (torch.nn.functional, "scaled_dot_product_attention"),
              "triton": (triton_attention, "cache_attention")}

    def one_token_of(kind: str):  # the Triton kernel's q: [b, tokens, heads, d]
        if kind == "triton":
            return lambda q, *a, **kw: q.shape[1] == 1
        return lambda q, *a, **kw: q.shape[-2] == g

    def refuse(kind, plain):
        one_token = one_token_of(kind)

        def refused(q, *a, **kw):
            if torch.compiler.is_compiling() and one_token(q):
                raise AssertionError(f"a one-token step traced {kind} attention")
            return plain(q, *a, **kw)
        return refused

    for kind, (owner, name) in places.items():
        if kind != allowed:
            monkeypatch.setattr(owner, name, refuse(kind, getattr(owner, name)))
    return None if allowed is None else count_compiled_calls(monkeypatch, *places[allowed],
                                                             one_token_of(allowed))


@pytest.mark.parametrize("compile,decode_attention", [(False, "small"), (True, "small"),
                                                      (True, "matmul"), (True, "triton")])
def test_graphed_decode_equals_eager(tmp_path, monkeypatch, compile, decode_attention):
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.models import llama
    from draftsmith.targets import load_target

    monkeypatch.setattr(llama, "DECODE_ATTENTION", decode_attention)
    torch._dynamo.reset()  # the compiled layers trace the attention chosen now
    target = load_target(write_tiny_folder(tmp_path, "llama"))
    model = target.build(torch.float32, "cuda")
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10, 11, 12]]
    eager = generate(Runtime(model, 3, 128, graphs=False), prompts, 48)
    rt = Runtime(model, 4, 128, graphs=True, compile=compile)
    g = model.cfg.num_heads // model.cfg.num_kv_heads  # a one-token step's query rows
    hits = route_one_token_attention(monkeypatch, g, decode_attention if compile else None)
    rt.capture([4, 2, 1], list(range(1, 17)))
    assert generate(rt, prompts, 48) == eager
    long = [[1, *range(10, 40)], [1, 2, 3]]  # a second prompt bucket (32), after the first
    assert generate(rt, long, 48) == generate(Runtime(model, 2, 128, graphs=False), long, 48)
    assert hits is None if not compile else hits.item() > 0  # compiled steps ran the chosen one


@pytest.mark.parametrize("compile", [False, True])
def test_graphed_q_forward_equals_eager(tmp_path, compile):
    from draftsmith.engine.runtime import Runtime
    from draftsmith.targets import load_target

    target = load_target(write_tiny_folder(tmp_path, "qwen3"))
    model = target.build(torch.float32, "cuda")
    ids = torch.randint(5, 100, (3, 20), device="cuda")
    pos = torch.arange(20, device="cuda").repeat(3, 1)
    ref = Runtime(model, 4, 64, graphs=False)
    rt = Runtime(model, 4, 64, graphs=True, compile=compile)
    rt.capture([4], [4, 16], aux_ids=(0, 3))
    for r in (ref, rt):
        r.forward(ids[:, :16], pos[:, :16], aux_ids=(0, 3))
    a = ref.forward(ids[:, 16:], pos[:, 16:], aux_ids=(0, 3))
    b = rt.forward(ids[:, 16:], pos[:, 16:], aux_ids=(0, 3))
    assert torch.allclose(a.logits, b.logits, atol=1e-4)
    assert torch.allclose(a.aux, b.aux, atol=1e-4)


@pytest.mark.parametrize("compile", [False, True])
def test_graphed_prompt_equals_exact_eager(tmp_path, compile):
    """Bucketed, graphed prefill: logits, aux and caches of the exact eager prompt forward, on
    first capture and on a replay with other prompts of the same bucket."""
    from draftsmith.engine.runtime import Runtime
    from draftsmith.targets import load_target

    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cuda")
    ref = Runtime(model, 3, 128, graphs=False)
    rt = Runtime(model, 3, 128, graphs=True, compile=compile)
    assert rt.prompt_buckets and not ref.prompt_buckets
    for n, seed in ((20, 0), (22, 1)):  # both pad to 24: the second call replays
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, 100, (3, n), generator=g).cuda()
        lens = torch.tensor([n, n - 3, 7], device="cuda")
        a, b = ref.prompt(ids, lens, (0, 2)), rt.prompt(ids, lens, (0, 2))
        assert torch.allclose(a.logits, b.logits, atol=1e-4)
        assert torch.allclose(a.aux, b.aux, atol=1e-4)
        for c, d in zip(ref.caches, rt.caches, strict=True):
            for row, k in enumerate(lens.tolist()):
                assert torch.allclose(c.k[row, :, :k], d.k[row, :, :k], atol=1e-4)
                assert torch.allclose(c.v[row, :, :k], d.v[row, :, :k], atol=1e-4)
    assert ("prompt", 3, 24, (0, 2)) in rt.graphs


@pytest.mark.parametrize("compile", [False, True])
def test_graphed_refill_equals_each_prompt_alone(tmp_path, compile):
    from draftsmith.engine.generate import generate
    from draftsmith.engine.refill import generate_refill
    from draftsmith.engine.runtime import Runtime
    from draftsmith.targets import load_target

    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cuda")
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10, 11, 12], [3], [1, 2, 3, 4]]
    free = generate(Runtime(model, 1, 128, graphs=False), [prompts[0]], 24, eos_ids=[])[0]
    eos = [free[5]]  # a token the answers really produce: rows end early and are refilled
    alone = [generate(Runtime(model, 1, 128, graphs=False), [p], 24, eos_ids=eos)[0]
             for p in prompts]
    rt = Runtime(model, 2, 128, graphs=True, compile=compile)
    assert generate_refill(rt, prompts, 24, eos_ids=eos, rows=2, check_every=3) == alone


def test_compiled_loss_equals_eager_on_cuda_bf16():
    """train --compile-loss on the GPU, under bf16 autocast as in training: the eager loss and
    gradients at every TTT step and at two batch widths, and a NaN logit row where nothing
    counts still makes the loss NaN (the trainer's stop)."""
    from draftsmith.train.objective import compiled_step_loss, make_targets, step_loss

    torch.manual_seed(3)
    fn = compiled_step_loss()
    for width in (96, 90):
        b, dv, v = 3, 512, 2048
        head = torch.randn(v, 64, device="cuda")
        hidden = torch.randn(b, width, 64, device="cuda")
        used = torch.sort(torch.randperm(v, device="cuda")[:dv]).values
        mask = torch.rand(b, width, device="cuda") < 0.8
        doc = torch.zeros(b, width, dtype=torch.long, device="cuda")
        tg = make_targets(hidden, head, used, mask, doc)
        for j in range(4):
            base = torch.randn(b, width, dv, device="cuda", dtype=torch.bfloat16)
            x, y = base.clone().requires_grad_(), base.clone().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                want, got = step_loss(x, tg, j), fn(y, tg, j)
            assert torch.allclose(got[0], want[0], rtol=1e-4)
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
            want[0].backward()
            got[0].backward()
            assert torch.allclose(y.grad.float(), x.grad.float(), atol=1e-5, rtol=1e-2)
        i = int((~(tg.ok[0, 1:] & (tg.label[0, 1:] >= 0))).nonzero()[0])
        bad = torch.randn(b, width, dv, device="cuda", dtype=torch.bfloat16)
        bad[0, i] = float("nan")
        with torch.autocast("cuda", torch.bfloat16):
            assert fn(bad, tg, 0)[0].isnan()


def test_compiled_top_p_at_batch_256_over_a_full_vocab():
    """The shape that crashed inductor in run 6 (batch 256, SmolLM2's 49,152-token vocab, bf16
    logits): the compiled sampler's distribution equals the eager one, and the filter kept
    a few hundred of the 49,152 tokens in a typical row (temperature 1: no division whose
    rounding could differ). A row whose best logit stands far enough out keeps it alone (run 8
    met one)."""
    from draftsmith.engine.sampling import SamplingParams, probs

    p = SamplingParams(1.0, top_p=0.9)
    g = torch.Generator("cuda").manual_seed(0)
    x = (torch.randn(256, 49152, device="cuda", generator=g) * 4).to(torch.bfloat16)
    got = torch.compile(lambda t: probs(t, p))(x)
    ref = probs(x, p)
    kept = (got > 0).sum(-1)
    assert torch.equal(kept, (ref > 0).sum(-1)) and torch.allclose(got, ref, atol=1e-6)
    assert (kept > 1).float().mean() > 0.9 and 100 < kept.float().median() < 1000
    assert kept.max() < 5000


def test_compiled_graphed_sampling_with_a_tiny_top_p_is_greedy(tmp_path):
    """top_p so small that only the best token survives: compiled, graphed sampling then has to
    reproduce plain greedy decoding token for token."""
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.targets import load_target

    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cuda")
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10, 11, 12]]
    greedy = generate(Runtime(model, 3, 128, graphs=False), prompts, 32)
    rt = Runtime(model, 4, 128, graphs=True, compile=True)
    rt.capture([4, 2, 1], list(range(1, 17)))
    assert generate(rt, prompts, 32, SamplingParams(0.7, top_p=1e-6)) == greedy


@pytest.mark.parametrize("compile", [False, True])
def test_a_seeded_call_that_captures_draws_what_a_later_seeded_call_draws(tmp_path, compile):
    """Graph capture's warm-up steps leave the caller's seeded random state alone: the first
    seeded sampled call at a batch size (which captures) equals the next one under that seed,
    plain and refilled."""
    from draftsmith.engine.generate import generate
    from draftsmith.engine.refill import generate_refill
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.targets import load_target

    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cuda")
    same, params = [[1, 5, 9, 30, 44]] * 3, SamplingParams(0.9)
    for run in (lambda rt: generate(rt, same, 24, params, eos_ids=[]),
                lambda rt: generate_refill(rt, same * 2, 24, params, eos_ids=[], rows=2)):
        rt = Runtime(model, 4, 128, graphs=True, compile=compile)
        answers = []
        for _ in range(2):
            torch.manual_seed(5)
            answers.append(run(rt))
        assert len({tuple(t) for t in answers[0]}) > 1
        assert answers[0] == answers[1]


@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_reductions_are_compiled_in_deterministic_mode(monkeypatch, pinned):
    """DRAFTSMITH_PIN_REDUCTIONS=1: the engine's compiled code carries inductor's deterministic
    flag into its reduction kernels (the flag that makes inductor keep one launch config instead
    of timing candidates), and the one-token attention still equals eager; 0 leaves it off."""
    from torch._inductor.utils import run_and_get_code

    from draftsmith.engine import runtime
    from draftsmith.models.llama import small_attention

    monkeypatch.setattr(runtime, "PIN_REDUCTIONS", pinned)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 9, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 9, 1024, 64, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    mask = torch.rand(1, 1, 1, 1024, device="cuda", generator=g) < 0.3
    out, code = run_and_get_code(runtime.engine_compile(small_attention, fullgraph=True),
                                 q, k, v, mask)
    text = "\n".join(code)
    assert "persistent_reduction" in text or "@triton_heuristics.reduction" in text
    assert f"'deterministic': {pinned}" in text
    assert torch.allclose(out.float(), small_attention(q, k, v, mask).float(), atol=2e-2)


def test_pin_rows_decodes_like_eager_with_a_pinned_and_an_unpinned_set(tmp_path, monkeypatch):
    """DRAFTSMITH_PIN_ROWS=1: a batch-1 decode runs the pinned compiled layers and a batch-2 one
    a second, unpinned set (its kernels carry deterministic False); both equal eager decoding."""
    from torch._inductor.utils import run_and_get_code

    from draftsmith.engine import runtime
    from draftsmith.engine.generate import generate
    from draftsmith.targets import load_target

    monkeypatch.setattr(runtime, "PIN_REDUCTIONS", True)
    monkeypatch.setattr(runtime, "PIN_ROWS", 1)
    torch._dynamo.reset()
    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cuda")
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61]]
    ref = runtime.Runtime(model, 2, 128, graphs=False)
    rt = runtime.Runtime(model, 2, 128, graphs=True, compile=True)
    rt.capture([2, 1], list(range(1, 17)))
    for batch in (prompts, prompts[:1]):
        assert generate(rt, batch, 32) == generate(ref, batch, 32)
    h = torch.randn(1, 9, model.cfg.hidden_size, device="cuda")
    for rows, n, flag in ((1, 7, True), (2, 9, False)):
        _, code = run_and_get_code(model.compiled_for(rows)["finish"], h[:, :n], None)
        assert f"'deterministic': {flag}" in "\n".join(code)
