"""compare, third review: what reading an engine folder warns is a line of the report, not a
Python warning on stderr."""

from __future__ import annotations

import warnings

import torch
from test_export import make
from test_import_review import _edit

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.export import export_drafter


def test_import_warnings_are_report_lines_not_python_warnings(target, tmp_path):
    """An SGLang folder whose stored embedding SGLang replaces: compare printed
    `artifacts.py:NNN: ImportNote: ...` on stderr, and its report said nothing."""
    src = make(target, tmp_path / "d")
    sg = _edit(export_drafter(src, "sglang", tmp_path / "sg"),
               weights=lambda w: w.update({"embed_tokens.weight": torch.randn(128, 64)}))
    opts = CompareOptions([str(src), str(sg)], target=str(target.folder), num_prompts=1,
                          max_new=4, steps=1, out=tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning that escapes fails the test
        res = run_compare(opts)
    said = [n for n in res["notes"] if "stored embed_tokens.weight differs" in n]
    assert len(said) == 1 and said[0].startswith("sg: ") and "(fix: check that" in said[0]
    assert said[0] in (tmp_path / "out" / "compare.md").read_text()
