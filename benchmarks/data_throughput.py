"""Data pipeline throughput: self-made prompts, regenerate, capture; engine vs HF `generate`.

Usage: python benchmarks/data_throughput.py [--device cpu] [--dtype float32] [--batch 8]
       [--prompts 16] [--new 64] [--threads N] [--out DIR]
Runs on CPU or GPU; the target is the embedded default. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import read_prompts
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.engine.generate import run_generation
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.targets import load_target


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def hf_generate(folder: Path, prompts: list[list[int]], new: int, device: str, dtype) -> float:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, -8:].to(device), attention_mask=att[:, -8:].to(device),
                       max_new_tokens=2, do_sample=False, pad_token_id=0)
        _, s = timed(device, lambda: model.generate(ids.to(device), attention_mask=att.to(device),
                                                    **kw))
    return len(prompts) * new / s


def engine_generate(model, prompts: list[list[int]], new: int, device: str) -> float:
    rt = Runtime(model, len(prompts), max(len(p) for p in prompts) + new + 1)
    run_generation(rt, [p[:8] for p in prompts], 2, SamplingParams(), [])
    _, s = timed(device, lambda: run_generation(rt, prompts, new, SamplingParams(), []))
    return len(prompts) * new / s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    out = Path(a.out or tempfile.mkdtemp(prefix="data_bench_"))
    t = load_target("default")
    model = t.build(dtype, a.device)
    log = lambda s: None  # noqa: E731
    res: dict = {"device": a.device, "dtype": a.dtype, "batch": a.batch, "torch_threads":
                 torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                 "load_avg_1m": os.getloadavg()[0], "target": t.source}

    mag = MagpieConfig(a.prompts, a.batch, 64, seed=0)
    st, s = timed(a.device, lambda: self_made_prompts(t, out / "p.jsonl", mag, model,
                                                      progress=False, log=log))
    res["prompts_per_s"] = st["kept"] / s
    res["prompts"] = st

    cfg = RegenConfig(a.new, 512, batch_size=a.batch, seed=0)
    convs = read_prompts(out / "p.jsonl")
    backend = EngineBackend(t, model, cfg)
    st, s = timed(a.device, lambda: regenerate(convs, out / "a.jsonl", backend, t.tokenizer,
                                               cfg, False, log))
    res["regenerate_answer_tokens_per_s"] = st["answer_tokens"] / s
    res["regenerate_conversations_per_s"] = st["answered"] / s

    ids = [t.chat_ids(c.messages) for c in convs[: a.batch]]
    res["engine_generate_tokens_per_s"] = engine_generate(model, ids, a.new, a.device)
    res["hf_generate_tokens_per_s"] = hf_generate(t.folder, ids, a.new, a.device, dtype)

    cap = CaptureConfig(batch_size=a.batch, max_len=512, dtype=dtype, device=a.device)
    answers = read_prompts(out / "a.jsonl")
    m, s = timed(a.device, lambda: capture(t, answers, out / "ds", cap, progress=False, log=log,
                                           model=model))
    res["capture_tokens_per_s"] = m["totals"]["tokens"] / s
    res["capture_tokens"] = m["totals"]["tokens"]
    res["capture_bytes_per_token"] = m["totals"]["bytes"] / m["totals"]["tokens"]

    for k, v in res.items():
        print(f"{k:34s} {v:.1f}" if isinstance(v, float) else f"{k:34s} {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
