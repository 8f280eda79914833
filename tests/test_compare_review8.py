"""Compare review, eighth pass: a damaged draftsmith-layout drafter folder is refused in one
line naming its file before the target loads (minutes on a big model), as generate and bench
refuse their --drafter (`eagle3.check_drafter`); compare with --target read the folders only
after loading it, so a cut weights file or a bad value was named minutes late."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_review import run_main
from test_cli_review8 import HOWS, LOADED, _damaged, good  # noqa: F401 - a fixture

from draftsmith.errors import DraftsmithError


@pytest.fixture
def no_target(monkeypatch):
    """Loading or building the target fails the test: the folder was checked too late."""
    def refuse(*a, **k):
        raise AssertionError(LOADED)

    monkeypatch.setattr("draftsmith.targets.load_target", refuse)
    monkeypatch.setattr("draftsmith.train.sources.load_target", refuse)
    monkeypatch.setattr("draftsmith.targets.Target.build", refuse)


@pytest.mark.parametrize("how", HOWS)
def test_compare_refuses_a_damaged_drafter_before_the_target(monkeypatch, capsys, target,
                                                             good, tmp_path, no_target,  # noqa: F811
                                                             how):
    d, named = _damaged(good, tmp_path, how)
    code, out, err = run_main(monkeypatch, capsys, "compare", str(good), str(d), "--target",
                              str(target.folder), "--num-prompts", "1")
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"draftsmith: error: {named}"), err


def test_compare_reaches_the_target_with_sound_drafters(monkeypatch, good, target,  # noqa: F811
                                                        tmp_path):
    """The check refuses nothing sound: the target is loaded after it."""
    from draftsmith.compare import CompareOptions, run_compare

    def loaded(*a, **k):
        raise DraftsmithError(LOADED)

    monkeypatch.setattr("draftsmith.targets.load_target", loaded)
    with pytest.raises(DraftsmithError, match=LOADED):
        run_compare(CompareOptions([str(good), str(good)], target=str(target.folder)))


def test_compare_without_a_target_names_cut_weights(good, tmp_path):  # noqa: F811
    """Without --target the folders are described only: a cut file is named the same way."""
    from draftsmith.compare import CompareOptions, run_compare

    d, named = _damaged(good, tmp_path, "cut_weights")
    with pytest.raises(DraftsmithError, match=f"^{Path(named) / 'model.safetensors'}: cannot "
                                              "read its weights"):
        run_compare(CompareOptions([str(good), str(d)]))
