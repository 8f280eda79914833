"""Prompt suites for `draftsmith bench`: HumanEval, the built-in chat suite, or any prompt file."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError

CHAT_SUITE = Path(__file__).with_name("chat_suite.jsonl")


def suite_messages(name: str, limit: int) -> list[list[dict[str, str]]]:
    """The first turn (its system prompts kept) of up to `limit` conversations of a suite:
    'humaneval', 'chat', or a path that `draftsmith.data.prompts` reads."""
    from draftsmith.data.prompts import opening, read_prompts

    if limit < 0:
        raise DraftsmithError(f"--num-prompts must be >= 0 (0 = all), got {limit}")
    source = CHAT_SUITE if name == "chat" else name
    out = [opening(c.messages) for c in read_prompts(source)  # as generate and regenerate ask
           if any(m["role"] == "user" for m in c.messages)]
    if not out:
        raise DraftsmithError(f"suite {name!r}: no prompt with a user turn")
    return out[:limit] if limit > 0 else out


def suite_label(name: str) -> str:
    return Path(name).stem if name not in ("chat", "humaneval") else name


def suite_labels(names: list[str]) -> dict[str, str]:
    """Each distinct suite's label in a report: its `suite_label`, or the name as given where
    two suites share one (a/p.jsonl and b/p.jsonl), so neither's rows replace the other's."""
    names = list(dict.fromkeys(names))
    short = [suite_label(n) for n in names]
    return {n: s if short.count(s) == 1 else n for n, s in zip(names, short, strict=True)}


def fill_batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Full batches only (one captured shape): the last is topped up from the start."""
    n = max(len(prompts), batch)
    n = -(-n // batch) * batch
    rows = [prompts[i % len(prompts)] for i in range(n)]
    return [rows[i : i + batch] for i in range(0, n, batch)]
