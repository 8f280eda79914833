"""Do regenerated answers round-trip through the tokenizer? Capture trains on the answers' text
tokenized again (as SpecForge does), not on the ids the target decoded; an answer whose text
tokenizes to another count than the target decoded trains the drafter on splits the target did
not make. Counts only (CPU): `meta.answers[].tokens` (the ids the engine decoded, the stop id
not counted) against the answer text's tokens.

Usage: python benchmarks/answer_roundtrip.py ANSWERS.jsonl [--target default] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def roundtrip(answers: Path, target: str) -> dict:
    from draftsmith.targets import load_target

    tok = load_target(target).tokenizer
    by: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in answers.read_text().splitlines():
        rec = json.loads(line)
        said = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        for a, text in zip(rec["meta"]["answers"], said, strict=False):
            n = len(tok(text, add_special_tokens=False)["input_ids"])
            by[a["finish"]][n - a["tokens"]] += 1
    return {f: {"answers": sum(c.values()), "same_count": c[0],
                "share_same": round(c[0] / sum(c.values()), 4),
                "differences": dict(sorted(c.items(), key=lambda x: -x[1])[:10])}
            for f, c in by.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("answers", type=Path)
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    got = roundtrip(args.answers, args.target)
    text = json.dumps(got, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
