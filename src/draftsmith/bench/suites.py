"""Prompt suites for `draftsmith bench`: HumanEval, the built-in chat suite, or any prompt file."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.data.prompts import HUMANEVAL, Conversation, opening, read_prompts, repeat_key
from draftsmith.errors import DraftsmithError

CHAT_SUITE = Path(__file__).with_name("chat_suite.jsonl")


def suite_messages(name: str, limit: int, warn: Callable[[str], None] | None = None,
                   flag: str = "--suite") -> list[list[dict[str, str]]]:
    """The first turn (its system prompts kept) of up to `limit` conversations of a suite:
    'humaneval', 'chat', or a path that `draftsmith.data.prompts` reads; `warn` takes its
    skipped records (default: stderr)."""
    return [m for m, _ in suite_prompts(name, limit, warn, flag)]


def suite_prompts(name: str, limit: int, warn: Callable[[str], None] | None = None,
                  flag: str = "--suite") -> list[tuple[list[dict[str, str]], str | None]]:
    """`suite_messages`, each prompt beside its record's `category` (MT-bench's, Spec-Bench's;
    None where it has none): a prompt asked once keeps the category of the record kept."""
    if limit < 0:
        raise DraftsmithError(f"--num-prompts must be >= 0 (0 = all), got {limit}")
    source = builtin_chat() if name == "chat" else name
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        (warn or _stderr)(line)

    read = read_prompts(source, warn=skip, flag=flag)
    firsts = [(opening(c.messages), _category(c))  # as generate asks
              for c in read if any(m["role"] == "user" for m in c.messages)]
    # one prompt once: conversations that differ after their first turn open alike, and the
    # reader drops only whole repeats (a repeat was timed twice, another prompt left out);
    # alike as the reader judges repeats, whitespace around each text aside, the first kept
    kept: dict[str, tuple[list[dict[str, str]], str | None]] = {}
    for m, cat in firsts:
        kept.setdefault(repeat_key(Conversation(m)), (m, cat))
    out = list(kept.values())
    if not out:
        raise DraftsmithError(f"suite {name!r}: no prompt with a user turn"
                              + _why_none(read, skipped))
    return out[:limit] if limit > 0 else out


def _category(conv: Conversation) -> str | None:
    cat = conv.meta.get("category")  # a draftsmith-written file's meta may hold anything
    return cat if isinstance(cat, str) and cat else None


def _stderr(line: str) -> None:
    print(f"draftsmith: warning: {line}", file=sys.stderr)


def _why_none(read: list[Any], skipped: list[str]) -> str:
    """Why a suite gave no prompt, where it was not system turns alone: records that could not
    be read (the CLI reads suites before loading with their warnings silenced), or none at all."""
    problems = [s.removeprefix("skipped ") for s in skipped if s.startswith("skipped ")]
    if problems:
        more = "more than 20" if len(skipped) > len(problems) else str(len(problems))
        plural = "record" if more == "1" else "records"
        return f": {more} {plural} could not be read, the first: {problems[0]}"
    return "" if read else ": it holds no record"


def builtin_chat() -> Path:
    """The built-in chat suite, refused where a file or folder named `chat` is here too: which
    one was meant cannot be told, and the wrong prompts would be timed."""
    here = Path("chat")
    if here.exists():
        kind = "folder" if here.is_dir() else "file"
        raise DraftsmithError(
            f"'chat' names both the built-in chat suite and the {kind} chat here: give the "
            f"{kind} as {here.resolve()}, or for the chat suite run where no chat is")
    return CHAT_SUITE


def prompt_ids(target: Any, conversations: list[list[dict[str, str]]],
               what: str) -> list[list[int]]:
    """Each conversation's token ids under the target's chat template; one the template refuses
    (a system turn to Gemma's, roles out of turn to Mistral's) is named, not a jinja traceback."""
    out = []
    for i, messages in enumerate(conversations):
        try:
            out.append(target.chat_ids(messages))
        except DraftsmithError:
            raise
        except Exception as e:  # jinja raises anything a template author chose
            raise DraftsmithError(f"{what}: the target's chat template refused prompt {i + 1} "
                                  f"({type(e).__name__}: {e})") from None
    return out


def suite_label(name: str) -> str:
    if _humaneval(name):
        return HUMANEVAL
    return Path(name).stem if name != "chat" else name


def suite_key(name: str) -> str:
    """What a suite's name reads: HumanEval, or the file or folder it resolves to (chat: the
    built-in file), so p.jsonl and ./p.jsonl are one suite."""
    if _humaneval(name):
        return HUMANEVAL
    return str((CHAT_SUITE if name == "chat" else Path(name)).resolve())


def _humaneval(name: str) -> bool:
    """The bundled HumanEval, named in any case, as the prompt reader takes it."""
    return name.lower() == HUMANEVAL


def distinct_suites(names: list[str]) -> dict[str, list[str]]:
    """Each suite once, by its first name as given, with every name given for it."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(suite_key(n), []).append(n)
    return {g[0]: g for g in groups.values()}


def repeated_suites(names: list[str]) -> list[str]:
    """A line for each suite named more than once: it is timed and reported once."""
    out = []
    for first, given in distinct_suites(names).items():
        if len(given) > 1:
            also = [n for n in dict.fromkeys(given) if n != first]
            out.append(f"--suite {first} named {len(given)} times"
                       + (f" (also as {', '.join(also)})" if also else "") + ": run once")
    return out


def suite_labels(names: list[str]) -> dict[str, str]:
    """Each distinct suite's label in a report: its `suite_label`, or the name as given where
    that label is another suite's too (a/p.jsonl and b/p.jsonl, or a suite named foo.bar beside
    d/foo.bar.jsonl), so neither's rows replace the other's."""
    names = list(distinct_suites(names))
    short = [suite_label(n) for n in names]
    return {n: s if short.count(s) == 1 and s not in names[:i] + names[i + 1:] else n
            for i, (n, s) in enumerate(zip(names, short, strict=True))}


def fill_batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Full batches only (one captured shape): the last is topped up from the start."""
    n = max(len(prompts), batch)
    n = -(-n // batch) * batch
    rows = [prompts[i % len(prompts)] for i in range(n)]
    return [rows[i : i + batch] for i in range(0, n, batch)]
