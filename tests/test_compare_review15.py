"""compare, fifteenth review: a speculators folder's aux ids as written listed at every key
where they are written, as vLLM reads them (`export.layout.speculators_lists`), so the "as
written" rows agree with the canonical ids printed beside them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.compare.describe import describe
from draftsmith.errors import DraftsmithError

IDS = "eagle_aux_hidden_state_layer_ids"
LAYER = "transformer_layer_config"


def _moved(src: Path, dest: Path, *path: str) -> Path:
    """A copy of a speculators folder whose top-level ids sit at `path` instead."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    ids = cfg.pop(IDS)
    at = cfg
    for key in path[:-1]:
        at = at.setdefault(key, {})
    at[path[-1]] = ids
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _no_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a target fails the test: what it checks is refused before."""
    import draftsmith.targets as targets

    def never(*a: object, **k: object) -> None:
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(targets, "load_target", never)


def test_ids_inside_transformer_layer_config_are_listed_as_written(drafters,  # noqa: F811
                                                                   tmp_path):
    """vLLM reads a speculators folder's ids inside transformer_layer_config where the top
    level holds none; compare printed them as canonical but its "as written" rows listed
    nothing, as if the folder named no ids."""
    inner = _moved(drafters["B-speculators"], tmp_path / "inner", LAYER, IDS)
    d = describe(inner, "inner")
    assert d.ids_canonical == [1, 2, 3]  # vLLM's [2, 3, 4], inputs of those layers
    assert d.ids_written == {f"{LAYER}.{IDS}": [2, 3, 4]}
    deeper = _moved(drafters["B-speculators"], tmp_path / "deeper", LAYER, "eagle_config", IDS)
    d = describe(deeper, "deeper")
    assert d.ids_canonical == [1, 2, 3]
    assert d.ids_written == {f"{LAYER}.eagle_config.{IDS}": [2, 3, 4]}


def test_every_place_written_is_a_row_of_the_report(drafters, tmp_path):  # noqa: F811
    """A folder writing ids at the top level and inside transformer_layer_config: both keys
    listed (vLLM takes the top level, copied over its draft config), in compare.md too."""
    both = tmp_path / "both"
    shutil.copytree(drafters["B-speculators"], both)
    cfg = json.loads((both / "config.json").read_text())
    cfg[LAYER][IDS] = [1, 2, 3]
    (both / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    res = run_compare(CompareOptions([str(drafters["B-speculators"]), str(both)], out=out))
    written = res["drafters"][1]["aux_ids_written"]
    assert written == {f"{IDS} (top level)": [2, 3, 4], f"{LAYER}.{IDS}": [1, 2, 3]}
    assert res["drafters"][1]["aux_ids_canonical"] == [1, 2, 3]  # the top level wins
    md = (out / "compare.md").read_text()
    assert f"| as written: {LAYER}.{IDS} | - | 1, 2, 3 |" in md


def test_a_malformed_list_inside_transformer_layer_config_is_one_line(
        drafters, tmp_path, tiny_llama_dir, monkeypatch):  # noqa: F811
    """Ids inside transformer_layer_config are not checked as the folder is read (the top-level
    and eagle_config ones are): a number there was a TypeError, a text a ValueError; named
    before a target loads."""
    _no_target(monkeypatch)
    for name, bad in (("number", 5), ("text", "2,3")):
        folder = _moved(drafters["B-speculators"], tmp_path / name, LAYER, IDS)
        cfg = json.loads((folder / "config.json").read_text())
        cfg[LAYER][IDS] = bad
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(DraftsmithError, match=rf"{name}/config.json: {LAYER}\.{IDS} is "
                           rf"{re.escape(repr(bad))}, not a list of integer layer ids"):
            run_compare(CompareOptions([str(drafters["A"]), str(folder)],
                                       target=str(tiny_llama_dir)))


def test_a_topk_past_one_drafters_draft_vocab_is_refused_before_the_target_loads(
        drafters, tiny_llama_dir, monkeypatch):  # noqa: F811
    """Drafters of different draft vocab sizes: a --topk past the smaller one's was refused by
    its decoder only after the target's weights were built, as "with this --target" though
    no target would do; bench, serve and tune refuse it before loading."""
    _no_target(monkeypatch)
    with pytest.raises(DraftsmithError, match=r"^--topk 40 exceeds drafter small's draft "
                       r"vocabulary of 32: give --topk 32 or less$"):
        run_compare(CompareOptions([str(drafters["B"]), str(drafters["A"])],
                                   target=str(tiny_llama_dir), topk=40, num_draft_tokens=8))
