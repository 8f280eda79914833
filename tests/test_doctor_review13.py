"""Review 13 of the doctor: its engines table stays readable at 80 columns (five folded
columns ran a row over many lines), and loses no word."""

from __future__ import annotations

import io

from rich.console import Console

from draftsmith.doctor.render import engines_table
from draftsmith.doctor.verdict import engine_rows


def shown(table) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(table)
    return out.getvalue().splitlines()


def test_engines_table_is_readable_at_80_columns():
    rows = engine_rows([1, 14, 26], None, 30)
    for r in rows:  # what a drafter's config feeds each engine, with a note of some length
        r["feed"] = {"written": [2, 15, 27], "canonical": [1, 14, 26],
                     "note": "older SGLang reads these ids one layer off (PR 8120): serve it "
                             "with a version after it, or export for the one you run"}
    lines = shown(engines_table(rows))
    assert all(len(x) <= 80 for x in lines)
    assert len(lines) <= 8 * len(rows) + 5, len(lines)  # five folded columns: 55
    flat = " ".join(" ".join(lines).replace("│", " ").split())
    for r in rows:
        assert r["engine"] in flat and f"write: {r['write']}" in flat
    assert flat.count("feeds: [2, 15, 27] -> canonical [1, 14, 26]") == len(rows)
    assert flat.count("export for the one you run") == len(rows)
