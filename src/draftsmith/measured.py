"""Figures that may be unmeasured (None: a draft position no cycle reached, a run of no cycle),
as reports show them: "-" in tables, a gap (nan) in plots, never a measured-looking 0."""

from __future__ import annotations

import math


def figure(v: float | None, fmt: str, unit: str = "") -> str:
    """`v` formatted, or "-" where nothing was measured."""
    return "-" if v is None else format(v, fmt) + unit


def gaps(vs: list[float | None]) -> list[float]:
    """`vs` for a plot: an unmeasured value is a gap."""
    return [math.nan if v is None else v for v in vs]
