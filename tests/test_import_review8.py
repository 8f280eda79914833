"""Import, eighth review: an SGLang-layout folder read by two engines with two keys.

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` (output of layer j; its
Llama-family classes add 1) and, where that is missing, its defaults (inputs of [2, L//2, L-3]),
ignoring a top-level list; vLLM reads the top-level list (input of layer j). Where the two
readings name other layers, the engines serve one drafter two ways: the import took one reading
without a word.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from conftest import write_tiny_folder
from test_export import make

from draftsmith.export import export_drafter, read_any
from draftsmith.export.layout import IDS, ImportNote
from draftsmith.targets import load_target


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    """8 layers: the engines' defaults, inputs of [2, 4, 5], are canonical [1, 3, 4]."""
    return load_target(write_tiny_folder(tmp_path_factory.mktemp("t8"), "llama",
                                         num_hidden_layers=8))


def _export(target, tmp_path: Path, aux: list[int]) -> Path:
    d = make(target, tmp_path / "d", aux=aux)
    return export_drafter(d, "sglang", tmp_path / "sg", target=str(target.folder))


def _edit(folder: Path, **keys) -> None:
    """Set (a value) or drop (None) top-level config keys."""
    c = json.loads((folder / "config.json").read_text())
    for k, v in keys.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (folder / "config.json").write_text(json.dumps(c))


def _read(folder: Path, target) -> tuple[list[int], list[ImportNote]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter = read_any(folder, target=str(target.folder))
    return drafter.cfg.aux_layer_ids, [w.message for w in caught
                                       if isinstance(w.message, ImportNote)]


def test_an_export_notes_nothing_about_its_two_lists(target8, tmp_path):
    folder = _export(target8, tmp_path, [0, 3, 5])
    ids, notes = _read(folder, target8)
    assert ids == [0, 3, 5] and not notes


def test_a_top_level_list_naming_other_layers_than_eagle_config_is_noted(target8, tmp_path):
    """eagle_config [0, 3, 5] is canonical [0, 3, 5] in SGLang; a top-level [0, 3, 5] (as a
    hand-made folder copies one list to both keys) is vLLM's inputs, canonical [-1, 2, 4]."""
    folder = _export(target8, tmp_path, [0, 3, 5])
    _edit(folder, **{IDS: [0, 3, 5], "draftsmith": None})
    ids, notes = _read(folder, target8)
    assert ids == [0, 3, 5]  # as SGLang, the layout's engine, reads them
    assert len(notes) == 1
    msg = str(notes[0])
    assert "[0, 3, 5]" in msg and "[-1, 2, 4]" in msg and "vLLM" in msg and "SGLang" in msg
    assert "\n" not in msg and f"{IDS} [1, 4, 6]" in notes[0].fix


def test_a_top_level_list_alone_is_noted_where_sglang_feeds_its_defaults(target8, tmp_path):
    """Without eagle_config's list SGLang ignores the top-level one and feeds its defaults,
    canonical [1, 3, 4]; vLLM (and the import) read the top-level list."""
    folder = _export(target8, tmp_path, [0, 3, 5])
    _edit(folder, eagle_config=None, draftsmith=None)
    ids, notes = _read(folder, target8)
    assert ids == [0, 3, 5]
    assert len(notes) == 1
    msg = str(notes[0])
    assert "[1, 3, 4]" in msg and "[0, 3, 5]" in msg and "defaults" in msg
    assert "\n" not in msg and f"eagle_config.{IDS} [0, 3, 5]" in notes[0].fix


def test_a_top_level_list_alone_naming_sglangs_defaults_notes_nothing(target8, tmp_path):
    folder = _export(target8, tmp_path, [1, 3, 4])
    _edit(folder, eagle_config=None, draftsmith=None)
    ids, notes = _read(folder, target8)
    assert ids == [1, 3, 4] and not notes


def test_an_old_export_read_one_layer_high_gets_its_own_note_alone(target8, tmp_path):
    """draftsmith before 2026-12-07 wrote canonical [0, 3, 5] as [1, 4, 6] in both lists: the
    record's note says what to write, which makes the two readings agree."""
    folder = _export(target8, tmp_path, [0, 3, 5])
    c = json.loads((folder / "config.json").read_text())
    c["eagle_config"][IDS] = [1, 4, 6]
    (folder / "config.json").write_text(json.dumps(c))
    _, notes = _read(folder, target8)
    assert len(notes) == 1 and "recorded the drafter's as [0, 3, 5]" in str(notes[0])
