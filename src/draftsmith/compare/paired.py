"""Two drafters' accept lengths set side by side prompt by prompt: whether the gap between them
is larger than the spread over prompts (with 8 prompts a few percent is often noise)."""

from __future__ import annotations

import math
from typing import Any

# Student's t, two-sided 95%, by degrees of freedom 1..30 (a paired gap over few prompts)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

DEFINITION = ("each drafter against the first, prompt by prompt: the mean over prompts of its "
              "accept length minus the first's on the same prompt, its standard error and 95% "
              "Student-t interval; beyond_noise where the interval excludes 0 (null with fewer "
              "than 2 prompts measured by both)")


_Z975 = 1.959964


def t975(df: int) -> float:
    """The table to 30; past it the Cornish-Fisher series in 1/df (within 1e-4 of t's quantile)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def paired(label: str, mine: list[float | None], ref_label: str,
           ref: list[float | None]) -> dict[str, Any]:
    """`label`'s per-prompt accept lengths against `ref_label`'s on the same prompts (a prompt
    either measured no cycle of is left out)."""
    diffs = [a - b for a, b in zip(mine, ref, strict=True) if a is not None and b is not None]
    n = len(diffs)
    mean = sum(diffs) / n if n else None
    se = lo = hi = beyond = None
    if n >= 2 and mean is not None:
        var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
        se = math.sqrt(var / n)
        half = t975(n - 1) * se
        lo, hi = mean - half, mean + half
        beyond = lo > 0 or hi < 0
    return {"drafter": label, "against": ref_label, "prompts": n, "mean_difference": mean,
            "standard_error": se, "interval_95": None if lo is None else [lo, hi],
            "beyond_noise": beyond}


def words(p: dict[str, Any], fmt: str = ".2f") -> str:
    """One table cell: the gap, its 95% interval and whether it is beyond the noise (`fmt`
    the figures' format)."""
    if p["mean_difference"] is None:
        return "-"
    gap = f"{p['mean_difference']:+{fmt}}"
    if p["interval_95"] is None:
        return f"{gap} (1 prompt: no spread to judge it by)"
    lo, hi = p["interval_95"]
    return f"{gap} (95%: {lo:+{fmt}} to {hi:+{fmt}}, {p['prompts']} prompts): {_verdict(p)}"


def _verdict(p: dict[str, Any]) -> str:
    if p["beyond_noise"]:
        return "beyond the noise"
    if p["mean_difference"] == 0 and p["standard_error"] == 0:  # no prompt tells them apart
        return "the same on every prompt"
    return "within the noise: more prompts"
