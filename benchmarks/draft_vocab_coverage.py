"""How large a draft vocab does the default target need? Coverage against its size.

A draft token outside the draft vocab can never be accepted, so the share of the target's
answer tokens inside it caps every position's acceptance. The vocab is built as `draftsmith
train` builds it (the most frequent assistant tokens of the training conversations); coverage
is measured on held-out conversations of the same kind and on the target's greedy answers to
the chat suite and HumanEval. Token counts only (CPU): no speed figure comes from here.

Usage: python benchmarks/draft_vocab_coverage.py --answers answers.jsonl --out DIR
       [--holdout 2000] [--sizes 4096,8192,16384,24576,32768] [--n 16] [--new 128]
Writes OUT/coverage.json, OUT/coverage.md and OUT/coverage.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def assistant_counts(target, convs, vocab: int) -> torch.Tensor:
    """Frequencies of the assistant tokens of `convs`, tokenized as training tokenizes them."""
    from draftsmith.data.chat import encode_many
    from draftsmith.data.vocab import count_ids

    return count_ids(encode_many(target.tokenizer, [c.messages for c in convs]), vocab)


def suite_counts(target, suites: list[str], n: int, new: int, vocab: int
                 ) -> dict[str, torch.Tensor]:
    """Per suite, frequencies of the target's greedy answer tokens to n of its prompts."""
    from acceptance_by_confidence import answers

    model = target.build(torch.float32, "cpu")
    return {s: sum((torch.bincount(torch.tensor(seq[plen:], dtype=torch.long), minlength=vocab)
                    for plen, seq in runs), torch.zeros(vocab, dtype=torch.long))
            for s, runs in answers(target, model, suites, n, new).items()}


def coverage(train: torch.Tensor, sizes: list[int], sets: dict[str, torch.Tensor]) -> list[dict]:
    """For each draft vocab size: the share of each set's tokens inside the vocab built from
    `train` (ties in the counts broken as build_vocab breaks them)."""
    from draftsmith.data.vocab import build_vocab

    rows = []
    for size in sizes:
        keep = build_vocab(train, size, train.numel()).t2d
        rows.append({"size": size, **{name: float(c[keep].sum()) / float(c.sum())
                                      for name, c in sets.items()}})
    return rows


def report(res: dict, out: Path) -> str:
    names = list(res["rows"][0])[1:]
    lines = ["| draft vocab | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in res["rows"]:
        lines.append(f"| {r['size']:,} | " + " | ".join(f"{r[n]:.3f}" for n in names) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n in names:
        ax.plot([r["size"] for r in res["rows"]], [r[n] for r in res["rows"]], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocab size (most frequent training tokens)")
    ax.set_ylabel("share of the target's tokens inside it")
    ax.legend()
    ax.set_title("Draft vocab coverage, default target")
    fig.tight_layout()
    fig.savefig(out / "coverage.png", dpi=120)
    return "\n".join(lines)


def main() -> None:
    from draftsmith.data.prompts import load_prompts
    from draftsmith.targets import load_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--holdout", type=int, default=2000)
    ap.add_argument("--sizes", default="4096,8192,16384,24576,32768")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--suites", default="chat,humaneval")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target = load_target("default")
    vocab = target.cfg.vocab_size
    convs = load_prompts(args.answers).conversations
    train = assistant_counts(target, convs[: -args.holdout], vocab)
    sets = {"training conversations": train,
            f"held-out conversations ({args.holdout})": assistant_counts(
                target, convs[-args.holdout :], vocab)}
    for s, counts in suite_counts(target, args.suites.split(","), args.n, args.new,
                                  vocab).items():
        sets[f"{s}, greedy answers"] = counts
    sizes = [int(x) for x in args.sizes.split(",")]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "answers": args.answers,
           "conversations": len(convs), "holdout": args.holdout, "n": args.n, "new": args.new,
           "tokens": {k: int(v.sum()) for k, v in sets.items()},
           "rows": coverage(train, sizes, sets)}
    res["seconds"] = time.time() - t0
    from acceptance_by_prompts import write_results

    write_results(res, out, "coverage", report)


if __name__ == "__main__":
    main()
