"""Does a row's greedy answer in the server's continuous rows depend on what else is in the batch?

Usage: python benchmarks/serve_invariance.py [--device cuda] [--rows 8] [--prompts 16]
       [--max-tokens 128] [--drafter DIR [--steps 3 --topk 1 --num-draft-tokens N]]
       [--row-counts 1,2,4,8,16] [--compile] [--out DIR]
Drives `ServeEngine.open` rows directly (no HTTP, no scheduler, no timing): each chat-suite
prompt is decoded greedily (1) alone in an open batch of `--rows` rows, then compared with (2)
the same again, (3) batches of `--row-counts` rows (default one: every decode kernel at another
row count), (4) `--rows` prompts joining at once (one prefill of all rows at the longest
prompt's bucket) and (5) staggered joins, the k-th prompt of a group after 5k steps (one-row
prefills beside rows at other positions). At each first difference from (1) the top-two logit
gap of a plain forward over the common prefix says whether it sits at a near-tie. bf16 on CUDA:
kernels are picked by shape, so a row's rounding can follow its batch. This is what decides
whether texts that differ between server runs are numerics or a bug.
Writes serve_invariance.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from draftsmith.bench.run import agreement
from draftsmith.bench.suites import suite_messages
from draftsmith.engine.sampling import SamplingParams
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine, trim


@torch.no_grad()
def decode(eng: ServeEngine, rows: int, joins: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy answers of prompts that join one open batch of `rows` rows at the given steps."""
    live = eng.open(rows, SamplingParams())
    slots = list(range(len(joins)))
    step, pending = 0, sorted(range(len(joins)), key=lambda i: joins[i][1])
    last = max(j[1] for j in joins) + eng.cfg.max_tokens + 8
    while True:
        if step > last:
            raise RuntimeError(f"rows still decoding after {step} steps")
        now = [i for i in pending if joins[i][1] <= step]
        if now:
            live.add(now, [joins[i][0] for i in now])
            pending = [i for i in pending if i not in now]
        live.step(1)
        step += 1
        if not pending and (step % 4 == 0 or step >= last):
            toks, ended = live.read(slots)
            if all(ended):
                return [trim(t, eng.eos)[0] for t in toks]


def compare(eng: ServeEngine, prompts: list[list[int]], alone: list[list[int]],
            other: list[list[int]]) -> dict:
    """`bench`'s agreement check: identical answers, and each first difference's logit gaps."""
    return agreement(eng.rt.model, [prompts], alone, other, eng.eos)


def row_key(k: int) -> str:
    return "one_row_batch" if k == 1 else f"batch_of_{k}_rows"


def run(eng: ServeEngine, prompts: list[list[int]], rows: int, counts: list[int]) -> dict:
    alone = [decode(eng, rows, [(p, 0)])[0] for p in prompts]
    groups = [prompts[i: i + rows] for i in range(0, len(prompts), rows)]
    together = [t for g in groups for t in decode(eng, rows, [(p, 0) for p in g])]
    stagger = [t for g in groups for t in decode(eng, rows, [(p, 5 * k) for k, p in enumerate(g)])]
    again = [decode(eng, rows, [(p, 0)])[0] for p in prompts]
    smaller = {row_key(k): compare(eng, prompts, alone, [decode(eng, k, [(p, 0)])[0]
                                                          for p in prompts])
               for k in counts if k < rows}
    return {"alone_again": compare(eng, prompts, alone, again), **smaller,
            "together": compare(eng, prompts, alone, together),
            "staggered": compare(eng, prompts, alone, stagger),
            "answer_tokens": sum(map(len, alone))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--row-counts", default="1",
                    help="smaller batches to decode each prompt alone in (powers of two: the "
                         "sizes the server opens and warm-up captures)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="serve-invariance-out")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    cfg = EngineConfig(max_batch=a.rows, max_prompt_tokens=256, max_tokens=a.max_tokens,
                       steps=a.steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens,
                       compile=a.compile)
    engines = {"baseline": None, **({"speculative": a.drafter} if a.drafter else {})}
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
        "dtype": str(dtype), "torch": torch.__version__, "rows": a.rows,
        "max_tokens": a.max_tokens, "compile": a.compile, "drafter": a.drafter,
        "steps": a.steps, "topk": a.topk, "num_draft_tokens": a.num_draft_tokens}
    for name, drafter in engines.items():
        eng = load_engine(a.target, drafter, a.device, dtype, cfg)
        if a.device == "cuda":
            eng.warmup()
        msgs = suite_messages("chat", a.prompts)
        prompts = [eng.chat_ids([m[-1]]) for m in msgs]
        counts = [int(k) for k in a.row_counts.split(",")]
        report[name] = r = run(eng, prompts, a.rows, counts)
        for k in [x for x in r if x != "answer_tokens"]:
            c = r[k]
            gaps = ", ".join(f"{d['top2_gap']:.3f}@{d['position']}" for d in c["divergences"])
            print(f"{name} {k}: {c['identical']}/{c['prompts']} identical to alone"
                  + (f"; top-2 gaps at the first difference: {gaps}" if gaps else ""), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_invariance.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
