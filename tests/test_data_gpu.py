"""The data pipeline on a CUDA device: graphed regenerate, bf16 capture (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation, read_prompts
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.data.shards import Dataset
from draftsmith.targets import load_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]


def test_pipeline_on_cuda(tiny_llama_dir, tmp_path):
    from draftsmith.engine.generate import generate

    t = load_target(tiny_llama_dir)
    model = t.build(torch.bfloat16, "cuda")
    stats = self_made_prompts(t, tmp_path / "p.jsonl", MagpieConfig(12, 16, 64, min_chars=1),
                              model, progress=False)
    assert stats["kept"] == 12
    convs = read_prompts(tmp_path / "p.jsonl")
    convs.append(Conversation([{"role": "user", "content": "a"},
                               {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}]))
    cfg = RegenConfig(max_new_tokens=24, max_len=160, batch_size=8, temperature=0.0)
    backend = EngineBackend(t, model, cfg)
    assert backend.rt.graphs is not None
    st = regenerate(convs, tmp_path / "a.jsonl", backend, t.tokenizer, cfg, False, print)
    assert st["answered"] == 13
    answers = read_prompts(tmp_path / "a.jsonl")
    one = answers[0]
    ids = t.chat_ids(one.messages[:1])
    want = generate(model, [ids], 24, eos_ids=t.eos_ids)[0]
    got = t.tokenizer(one.messages[1]["content"], add_special_tokens=False)["input_ids"]
    assert got[:8] == want[:8]
    cap = CaptureConfig(aux_layer_ids=[-1, 2, 5], batch_size=4, samples_per_shard=5,
                        dtype=torch.bfloat16, device="cuda")
    m = capture(t, answers, tmp_path / "ds", cap, progress=False, model=model, log=print)
    assert m["totals"]["samples"] == 13
    ds = Dataset(tmp_path / "ds")
    s = ds[3]
    with torch.no_grad():
        fo = model(s["input_ids"][None].cuda(), torch.arange(len(s["input_ids"]))[None].cuda(),
                   aux_ids=(-1, 2, 5), want_logits=False)
    assert torch.allclose(s["hidden"].float(), fo.hidden[0].float().cpu(), atol=6e-2, rtol=3e-2)
    assert torch.allclose(s["aux"].float(), fo.aux[0].float().cpu(), atol=6e-2, rtol=3e-2)
    ds.verify()


def test_sampled_regenerate_resumed_equals_uninterrupted_on_cuda(tiny_llama_dir, tmp_path):
    """Graph capture draws random numbers in its warm-up steps: the engine captures before the
    first per-chunk seed, so a run killed after a chunk and resumed samples the same answers."""
    t = load_target(tiny_llama_dir)
    model = t.build(torch.bfloat16, "cuda")
    convs = [Conversation([{"role": "user", "content": f"question {i} " * (1 + i % 4)}], f"q{i}")
             for i in range(40)]
    cfg = RegenConfig(max_new_tokens=24, max_len=160, batch_size=2, temperature=1.0)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    regenerate(convs, whole, EngineBackend(t, model, cfg), t.tokenizer, cfg, False, print)
    first = 2 * 8  # one chunk: batch_size x REFILL_CHUNK
    regenerate(convs[:first], part, EngineBackend(t, model, cfg), t.tokenizer, cfg, False, print)
    regenerate(convs, part, EngineBackend(t, model, cfg), t.tokenizer, cfg, False, print)
    assert part.read_text() == whole.read_text()
