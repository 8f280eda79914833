"""Would a draft depth chosen each cycle from the last cycle's tokens beat a fixed depth?

Records the tokens each greedy tree cycle emits (batch 1, one prompt at a time, CPU fp32: the
same accept decisions as the GPU's up to near-ties) and replays them under depth policies:
a depth-d tree of the same budget holds every node of the deep tree's at depth <= d (the
frontier at each depth is the same; fewer candidates only promote shallow ones), so it accepts
at least min(accepted, d), which is what the replay credits (a lower bound on the policy). Each
cycle is priced cycle_ms - (S - d) * depth_ms, the H200's figures for tree S/K/N. Policies:
every fixed depth, and three depths switched by two thresholds on the last cycle's tokens,
fitted on one suite and scored on the other (and on itself, as an upper bound of the fit).

Usage: python benchmarks/adaptive_depth.py --drafter DIR --out DIR [--tree 10/4/24] [--n 16]
       [--new 128] [--base-depth 7] [--cycle-ms 1.428] [--depth-ms 0.057] [--cycles FILE]
       [--base-cycles FILE]
--base-cycles: cycles recorded at the base depth itself (`--tree 7/4/24`), whose tokens a cycle
the replay's depth-7 lower bound undercounts: each policy's tok/ms is also given against them.
Writes OUT/cycles_S_K_N.json (unless --cycles), OUT/adaptive.json, adaptive.md, adaptive.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter
from pathlib import Path

import torch

SUITES = ("chat", "humaneval")


def record(drafter_dir: str, tree: tuple[int, int, int], n: int, new: int) -> dict:
    """Per suite, per prompt: the tokens each cycle emitted (accepted drafts + 1)."""
    from rich.progress import track

    from draftsmith.bench.suites import suite_messages
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target

    steps, topk, budget = tree
    t = load_target(None)
    model = t.build(torch.float32, "cpu", None)
    drafter = load_drafter(drafter_dir, "cpu", torch.float32, embed=model.embed.weight)
    out: dict = {}
    for suite in SUITES:
        ids = [t.chat_ids(m) for m in suite_messages(suite, n)]
        room = max(map(len, ids)) + new + 104
        rt = Runtime(model, 1, room, compile=False)
        drt = DrafterRuntime(drafter, 1, room + 64 * steps, False, compile=False)
        dec = SpecDecoder(rt, drt, steps, topk, budget, SamplingParams(), False)
        out[suite] = [cycles_of(dec, p, new, t.eos_ids)
                      for p in track(ids, description=f"{suite} {steps}/{topk}/{budget}")]
    return out


@torch.no_grad()
def cycles_of(dec, prompt: list[int], new: int, eos: list[int]) -> list[int]:
    st = dec.start([prompt], new, eos)
    got, before = [], int(st.count[0])
    while not bool(st.all_done):
        dec.cycle(st)
        now = int(st.count[0])
        got.append(now - before)
        before = now
    return got


def replay(seqs: list[list[int]], policy, base: int, cycle_ms: float, depth_ms: float
           ) -> tuple[float, float]:
    """(tokens a cycle, tokens a ms) of `policy(last tokens or None) -> depth` over seqs."""
    tokens = ms = cycles = 0
    for seq in seqs:
        last = None
        for got in seq:
            d = policy(last)
            last = min(got - 1, d) + 1
            tokens, ms, cycles = tokens + last, ms + cycle_ms - (base - d) * depth_ms, cycles + 1
    return tokens / cycles, tokens / ms


def switched(lo: int, mid: int, hi: int, t1: int, t2: int, first: int):
    def policy(last: int | None) -> int:
        if last is None:
            return first
        return lo if last <= t1 else hi if last > t2 else mid
    return policy


def policies(steps: int, base: int):
    for lo, mid, hi in itertools.combinations_with_replacement(range(2, steps + 1), 3):
        for t1, t2 in itertools.combinations(range(1, steps + 2), 2):
            yield (lo, mid, hi, t1, t2), switched(lo, mid, hi, t1, t2, base)


def study(cycles: dict, steps: int, base: int, cycle_ms: float, depth_ms: float,
          measured: dict | None = None) -> dict:
    def rate(suite: str, pol) -> float:
        return replay(cycles[suite], pol, base, cycle_ms, depth_ms)[1]

    res: dict = {"suites": {}}
    for s in SUITES:
        ref = rate(s, lambda _: base)
        real = ref if measured is None else sum(map(sum, measured[s])) / (
            sum(map(len, measured[s])) * cycle_ms)
        fixed = {d: rate(s, lambda _, d=d: d) / ref for d in range(1, steps + 1)}
        fits = {o: max(policies(steps, base), key=lambda kp, o=o: rate(o, kp[1]))
                for o in SUITES}
        hist = Counter(c for q in cycles[s] for c in q)
        nxt = {a: [b for q in cycles[s] for x, b in zip(q, q[1:], strict=False) if x == a]
               for a in sorted(hist)}
        res["suites"][s] = {
            "cycles": sum(map(len, cycles[s])), "tokens_per_cycle_at_base": replay(
                cycles[s], lambda _: base, base, cycle_ms, depth_ms)[0],
            "hist": dict(sorted(hist.items())),
            "after": {a: {"n": len(v), "mean_next": sum(v) / len(v),
                          "p_next_full": sum(x == steps + 1 for x in v) / len(v)}
                      for a, v in nxt.items() if v},
            "fixed": fixed,
            "switched": {f"fitted on {o}": {"policy": kp[0], "ratio": rate(s, kp[1]) / ref,
                                            "against_measured_base": rate(s, kp[1]) / real}
                         for o, kp in fits.items()},
            "measured_base_tokens_per_cycle": real * cycle_ms,
        }
    return res


def other(suite: str) -> str:
    return f"fitted on {'humaneval' if suite == 'chat' else 'chat'}"


def report(res: dict, args) -> str:
    steps = args.tree[0]
    lines = [f"tree {steps}/{args.tree[1]}/{args.tree[2]} recorded; tok/ms against a fixed depth "
             f"{args.base_depth} (cycle {args.cycle_ms} ms there, {args.depth_ms} ms a depth)", "",
             "| suite | cycles | tokens a cycle, depth " + str(args.base_depth) + " replayed | "
             + " | ".join(f"depth {d}" for d in range(3, steps + 1))
             + " | switched, fitted on chat | switched, fitted on humaneval | the switched "
             "policy fitted on the other suite against the measured depth-" + str(args.base_depth)
             + " tree (its tokens a cycle) |",
             "|" + "---|" * (6 + steps - 2)]
    for s, r in res["suites"].items():
        sw = r["switched"]
        lines.append(f"| {s} | {r['cycles']} | {r['tokens_per_cycle_at_base']:.2f} | "
                     + " | ".join(f"{r['fixed'][d]:.3f}" for d in range(3, steps + 1))
                     + " | " + " | ".join(f"{sw[k]['ratio']:.3f} {tuple(sw[k]['policy'])}"
                                          for k in ("fitted on chat", "fitted on humaneval"))
                     + f" | {sw[other(s)]['against_measured_base']:.3f} "
                       f"({r['measured_base_tokens_per_cycle']:.2f}) |")
    lines += ["", "switched policy (lo, mid, hi, t1, t2): depth lo after a cycle of <= t1 "
              "tokens, hi after > t2, mid between; the first cycle at the base depth", "",
              "| suite | last cycle's tokens | cycles after it | mean tokens next | "
              "P(next takes the whole depth) |", "|---|---|---|---|---|"]
    for s, r in res["suites"].items():
        for a, v in r["after"].items():
            lines.append(f"| {s} | {a} | {v['n']} | {v['mean_next']:.2f} | "
                         f"{v['p_next_full']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for s, r in res["suites"].items():
        ds = sorted(r["fixed"])
        ax[0].plot(ds, [r["fixed"][d] for d in ds], marker="o", label=f"{s}, fixed depth")
        ax[0].axhline(r["switched"][other(s)]["ratio"], ls="--", color=ax[0].lines[-1].get_color(),
                      label=f"{s}, switched (fitted on the other suite)")
        a = list(r["after"])
        ax[1].plot(a, [r["after"][x]["mean_next"] for x in a], marker="o", label=s)
    ax[0].set(xlabel="draft depth", ylabel="tok/ms against the base depth",
              title="depth policies (replayed, H200 costs)")
    ax[1].set(xlabel="tokens the last cycle emitted", ylabel="mean tokens the next emits",
              title=f"consecutive cycles (tree depth {steps})")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="runs/cpu/drafter")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tree", type=lambda v: tuple(int(x) for x in v.split("/")),
                   default=(10, 4, 24))
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--base-depth", type=int, default=7)
    p.add_argument("--cycle-ms", type=float, default=1.428)
    p.add_argument("--depth-ms", type=float, default=0.057)
    p.add_argument("--cycles", type=Path, help="replay these recorded cycles instead")
    p.add_argument("--base-cycles", type=Path, help="cycles recorded at the base depth")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.cycles:
        cycles = json.loads(args.cycles.read_text())
    else:
        t0 = time.time()
        cycles = record(args.drafter, args.tree, args.n, args.new)
        name = "cycles_{}_{}_{}.json".format(*args.tree)
        (args.out / name).write_text(json.dumps(cycles))
        print(f"recorded in {time.time() - t0:.0f} s")
    measured = json.loads(args.base_cycles.read_text()) if args.base_cycles else None
    res = study(cycles, args.tree[0], args.base_depth, args.cycle_ms, args.depth_ms, measured)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "adaptive.json").write_text(json.dumps(res, indent=1))
    text = report(res, args)
    (args.out / "adaptive.md").write_text(text)
    plot(res, args.tree[0], args.out / "adaptive.png")
    print(text)


if __name__ == "__main__":
    main()
