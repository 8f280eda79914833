"""The engine's switches from the environment, read strictly: a value the engine does not know
is refused with the variable's name and what it takes, never guessed at."""

from __future__ import annotations

import os
import re

from draftsmith.errors import DraftsmithError


def env_flag(name: str, default: str) -> bool:
    """1 or 0."""
    return env_choice(name, default, ("1", "0")) == "1"


def env_count(name: str, default: str) -> int:
    """An integer >= 0."""
    value = os.environ.get(name, default)
    if not _digits(value):
        raise DraftsmithError(f"{name}={value!r}: use a count >= 0")
    return int(value)


def env_pow2(name: str, default: str, least: int = 1) -> int:
    """A power of two >= least (Triton block sizes and warp counts)."""
    value = os.environ.get(name, default)
    n = int(value) if _digits(value) else 0
    if n < least or n & (n - 1):
        raise DraftsmithError(f"{name}={value!r}: use a power of two >= {least}")
    return n


def _digits(value: str) -> bool:
    """ASCII digits, space around them aside: `isdigit` passes `²`, which int() refuses."""
    return re.fullmatch(r"[0-9]+", value.strip()) is not None


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (case and surrounding space ignored)."""
    given = os.environ.get(name, default).strip()
    if (value := given.lower()) not in choices:
        raise DraftsmithError(f"{name}={given!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return value


def env_assignments(name: str, default: str) -> dict[str, str]:
    """`key=value,key=value` (`none` or empty: none), each key once; the values stay strings.
    Pairs split at `;` instead where there is one, for values that hold commas."""
    given = os.environ.get(name, default).strip()
    given = "" if given.lower() == "none" else given  # as env_choice: case ignored
    out: dict[str, str] = {}
    sep = ";" if ";" in given else ","
    for item in filter(None, (s.strip() for s in given.split(sep))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not (key and eq and value) or key in out:
            raise DraftsmithError(f"{name}: {item!r} is not a new key=value (keys once each, "
                                  f"pairs split by {'semicolons' if sep == ';' else 'commas'})")
        out[key] = value
    return out
