"""Is a drafter's first-draft acceptance limited by the drafter or by the target's own doubt?

Each drafter's first draft (step 0, teacher-forced on the target's greedy answers: the same
prediction the engine's first chain step makes) is compared with the target's greedy token and
binned by the target's probability of that token. A drafter that is right where the target is
sure and guesses where the target hesitates is limited by the target; one that misses confident
tokens is under-trained. Acceptance only (CPU, fp32): no speed figure comes from here.

Usage: python benchmarks/acceptance_by_confidence.py --drafter DIR [--drafter DIR ...] --out DIR
       [--n 16] [--new 128] [--suites chat,humaneval]
Writes OUT/confidence.json, OUT/confidence.md and OUT/confidence.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001)


def answers(t, model, suites: list[str], n: int, new: int
            ) -> dict[str, list[tuple[int, list[int]]]]:
    """Per suite, (prompt length, prompt + greedy answer) of the target for n of its prompts,
    in batches of 8 (also used by draft_vocab_coverage.py)."""
    from draftsmith.bench.suites import suite_messages
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime

    prompts = {s: [t.chat_ids(m) for m in suite_messages(s, n)] for s in suites}
    rt = Runtime(model, 8, max(len(p) for ps in prompts.values() for p in ps) + new + 1)
    seqs: dict[str, list[tuple[int, list[int]]]] = {s: [] for s in suites}
    for s, ps in prompts.items():
        for i in range(0, len(ps), 8):
            batch = ps[i : i + 8]
            for p, a in zip(batch, generate(rt, batch, new, eos_ids=t.eos_ids), strict=True):
                seqs[s].append((len(p), p + a))
    return seqs


@torch.no_grad()
def first_drafts(model, drafter, plen: int, seq: list[int]) -> tuple[torch.Tensor, ...]:
    """Per answer token x_{p+2} (p >= plen - 1): the target's probability of it, whether the
    drafter's step-0 guess from (x_{p+1}, h_p) equals it, and whether it is in the draft vocab."""
    ids = torch.tensor([seq])
    pos = torch.arange(len(seq))[None]
    out = model(ids, pos, aux_ids=tuple(drafter.cfg.aux_layer_ids))
    prob = out.logits[0].float().softmax(-1)  # [T, V]: row j predicts x_{j+1}
    hid = drafter.fuse(out.aux[:, :-1])
    logits, _ = drafter(ids[:, 1:], hid, pos[:, :-1])  # row p predicts x_{p+2}
    guess = drafter.to_target(logits[0].argmax(-1))
    p = torch.arange(plen - 1, len(seq) - 2)
    want = ids[0, p + 2]
    return prob[p + 1, want], guess[p] == want, drafter.t2d[want]


def tally(model, drafter, seqs) -> dict:
    conf, hit, inside = (torch.cat(x) for x in zip(*(first_drafts(model, drafter, n, s)
                                                      for n, s in seqs), strict=True))
    rows = []
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        sel = (conf >= lo) & (conf < hi)
        k = int(sel.sum())
        rows.append({"bin": f"{lo:g}-{min(hi, 1):g}", "share": k / len(conf),
                     "accepted": float(hit[sel].float().mean()) if k else None,
                     "in_draft_vocab": float(inside[sel].float().mean()) if k else None})
    return {"positions": len(conf), "accepted": float(hit.float().mean()),
            "in_draft_vocab": float(inside.float().mean()),
            "target_mean_prob": float(conf.mean()), "bins": rows}


def report(res: dict, out: Path) -> str:
    names = list(res["drafters"])
    head = "| target's probability of its greedy token | share of positions | " + " | ".join(
        f"first draft accepted, {n} | in its draft vocab" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(names))]
    first = res["drafters"][names[0]]

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for i, b in enumerate(first["bins"]):
        cells = [f"{cell(res['drafters'][n]['bins'][i]['accepted'])} | "
                 f"{cell(res['drafters'][n]['bins'][i]['in_draft_vocab'])}" for n in names]
        lines.append(f"| {b['bin']} | {b['share']:.2f} | " + " | ".join(cells) + " |")
    lines.append("| all | 1.00 | " + " | ".join(
        f"{res['drafters'][n]['accepted']:.2f} | {res['drafters'][n]['in_draft_vocab']:.2f}"
        for n in names) + " |")
    plot(res, names, out / "confidence.png")
    return "\n".join(lines)


def plot(res: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = [b["bin"] for b in res["drafters"][names[0]]["bins"]]
    x = range(len(bins))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x, [b["share"] for b in res["drafters"][names[0]]["bins"]], color="0.85",
           label="share of positions")
    for n in names:
        ax.plot(x, [b["accepted"] or 0 for b in res["drafters"][n]["bins"]], marker="o",
                label=f"accepted: {n}")
    ax.set_xticks(list(x), bins)
    ax.set_xlabel("target's probability of its own greedy token")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("First draft accepted, by the target's confidence")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--suites", default="chat,humaneval")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    t = load_target("default")
    model = t.build(torch.float32, "cpu")
    seqs = [x for v in answers(t, model, args.suites.split(","), args.n, args.new).values()
            for x in v]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "suites": args.suites, "n": args.n, "new": args.new, "drafters": {}}
    for d in args.drafter:
        drafter = load_drafter(d, "cpu", torch.float32, embed=model.embed.weight).eval()
        res["drafters"][Path(d).name] = tally(model, drafter, seqs)
    res["seconds"] = time.time() - t0
    from acceptance_by_prompts import write_results

    write_results(res, out, "confidence", report)


if __name__ == "__main__":
    main()
