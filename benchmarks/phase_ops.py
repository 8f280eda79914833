"""How many separate ops (each a kernel on a GPU) a speculative cycle launches outside the
drafter's and the target's forwards, with the bookkeeping eager and torch.compile'd.

Counts, not times: on the lent H200 each such op costs a few microseconds inside a CUDA graph,
so the count is what the compiled bookkeeping is for. CPU, fp32, a tiny random target (the
count depends on the setting, not on the model's size).

Usage: python benchmarks/phase_ops.py --out benchmarks/phase_ops
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_speculative import make_drafter, tiny_target  # noqa: E402

from draftsmith.engine.runtime import Runtime  # noqa: E402
from draftsmith.engine.speculative import SpecDecoder  # noqa: E402

NO_KERNEL = {"aten::unsqueeze", "aten::slice", "aten::expand", "aten::view", "aten::select",
             "aten::reshape", "aten::as_strided", "aten::t", "aten::transpose", "aten::flatten",
             "aten::alias", "aten::_reshape_alias", "aten::squeeze", "aten::unflatten",
             "aten::detach", "aten::lift_fresh", "aten::empty", "aten::result_type",
             "aten::expand_as"}
SETTINGS = [(3, 1, None), (5, 1, None), (3, 4, 8), (5, 8, 16), (6, 10, 32)]


def count(dec: SpecDecoder, st, phase: str) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        dec._run(st, phase)
    top = [e for e in p.events() if e.cpu_parent is None]
    ops = [e.name for e in top if e.name.startswith("aten::") and e.name not in NO_KERNEL]
    compiled = sum(1 for e in top if e.name.startswith("Torch-Compiled Region"))
    return {"ops": len(ops), "compiled_calls": compiled, "top": Counter(ops).most_common(5)}


def measure(steps: int, topk: int, n: int | None, fused: bool) -> dict:
    torch.manual_seed(0)
    target = tiny_target()
    rt = Runtime(target, 1, 256)
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    inner = dec.draft_fn

    def drafter(*a, **kw):  # the drafter's own ops are not bookkeeping: hide them
        with record_function("drafter"):
            return inner(*a, **kw)

    dec.draft_fn = drafter
    if fused:
        dec.compile_bookkeeping()
    st = dec.start([[1, 5, 9, 30, 44]], 24, [])
    for _ in range(2):  # compile and settle
        dec.cycle(st)
    out = {}
    for phase in ("draft", "verify", "accept"):
        out[phase] = count(dec, st, phase)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/phase_ops"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for steps, topk, n in SETTINGS:
        name = f"{steps}/{topk}/{n or steps + 1}"
        eager, fused = measure(steps, topk, n, False), measure(steps, topk, n, True)
        rows.append({"setting": name, "eager": eager, "compiled": fused})
        print(name, {p: (eager[p]["ops"], fused[p]["ops"]) for p in ("draft", "accept")},
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "phase_ops.json").write_text(json.dumps(rows, indent=1))
    lines = ["| setting | draft ops, eager | draft ops + compiled calls | accept ops, eager | "
             "accept ops + compiled calls |", "|---|---|---|---|---|"]
    for r in rows:
        e, c = r["eager"], r["compiled"]
        lines.append(f"| {r['setting']} | {e['draft']['ops']} | {c['draft']['ops']} + "
                     f"{c['draft']['compiled_calls']} | {e['accept']['ops']} | "
                     f"{c['accept']['ops']} + {c['accept']['compiled_calls']} |")
    (args.out / "phase_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
