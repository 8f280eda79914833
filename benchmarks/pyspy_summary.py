"""Where one thread's time went, from `py-spy record -f raw` stacks.

Usage: python benchmarks/pyspy_summary.py RAW [--within Scheduler._loop] [--top 20]
Keeps the samples whose stack passes through a frame named like `--within` (default: the
server's batch loop) and counts them by the deepest draftsmith frame (what our code was doing,
or waiting in) and by the leaf frame (where the interpreter actually was). Shares are of the
kept samples; with `py-spy --idle` waits count too.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def frames_of(line: str) -> tuple[list[str], int]:
    stack, n = line.rstrip("\n").rsplit(" ", 1)
    return stack.split(";"), int(n)


def name(frame: str) -> str:
    """'fn (path/file.py:12)' -> 'fn (file.py)'."""
    fn, _, where = frame.partition(" (")
    return f"{fn} ({Path(where.split(':')[0]).name})" if where else fn


def summarize(raw: Path, within: str, top: int) -> str:
    ours: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    kept = total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        frames, n = frames_of(line)
        total += n
        if not any(within in f for f in frames):
            continue
        kept += n
        mine = [f for f in frames if "draftsmith/" in f]
        ours[name(mine[-1]) if mine else "(none)"] += n
        leaf[name(frames[-1])] += n
    out = [f"{kept} of {total} samples pass through {within!r}", "",
           "| deepest draftsmith frame | samples | share |", "|---|---|---|"]
    out += [f"| {k} | {v} | {100 * v / kept:.1f} % |" for k, v in ours.most_common(top)]
    out += ["", "| leaf frame | samples | share |", "|---|---|---|"]
    out += [f"| {k} | {v} | {100 * v / kept:.1f} % |" for k, v in leaf.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw", type=Path)
    ap.add_argument("--within", default="_loop (")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    print(summarize(a.raw, a.within, a.top))


if __name__ == "__main__":
    main()
