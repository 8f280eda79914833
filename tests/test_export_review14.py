"""Export review 14: the speculators layout's ids where vLLM reads them."""

from __future__ import annotations

import json
import warnings

import pytest
from test_export import make

from draftsmith.export import export_drafter, read_any
from draftsmith.export.layout import ImportNote, engine_ids

NESTED = {  # where vLLM's draft config (transformer_layer_config) may hold the ids
    "top": lambda layer, ids: layer.update({"eagle_aux_hidden_state_layer_ids": ids}),
    "eagle_config": lambda layer, ids: layer.update(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}),
}


def _nested_folder(target, tmp_path, where: str) -> tuple:
    """A speculators export whose ids sit inside transformer_layer_config, none at the top."""
    out = export_drafter(make(target, tmp_path / "d", aux=[0, 2, 3]), "speculators",
                         tmp_path / "sp", target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    ids = c.pop("eagle_aux_hidden_state_layer_ids")
    c.pop("draftsmith")
    NESTED[where](c["transformer_layer_config"], ids)
    (out / "config.json").write_text(json.dumps(c))
    return out, c


@pytest.mark.parametrize("where", sorted(NESTED))
def test_ids_inside_transformer_layer_config_read_as_vllm_reads_them(target, tmp_path, where):
    """vLLM's speculators reader makes transformer_layer_config the draft's config, copying the
    top-level list over it only where non-empty (algos.update_eagle3), and the model runner
    reads that config's list, else its eagle_config's (_get_eagle3_aux_layers_from_config):
    the import took the engines' defaults instead, and the doctor named no ids."""
    out, c = _nested_folder(target, tmp_path, where)
    written, key, _ = engine_ids(c, "speculators", 6, "config.json")
    assert written == [1, 3, 4] and key.startswith("transformer_layer_config.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = read_any(out, target=str(target.folder))
    assert d.cfg.aux_layer_ids == [0, 2, 3]
    notes = [str(w.message) for w in caught if isinstance(w.message, ImportNote)]
    assert any("speculators" in n and "top level" in n for n in notes), notes


def test_top_level_ids_win_over_nested_ones(target, tmp_path):
    """update_eagle3 copies a non-empty top-level list over the layer config's."""
    out, c = _nested_folder(target, tmp_path, "top")
    c["eagle_aux_hidden_state_layer_ids"] = [2, 3, 5]
    (out / "config.json").write_text(json.dumps(c))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = read_any(out, target=str(target.folder))
    assert d.cfg.aux_layer_ids == [1, 2, 4]
    assert not [w for w in caught if "top level" in str(w.message)]


@pytest.mark.parametrize("kind,words", [(None, "Qwen3"), ("mistral", "refuse")])
def test_a_layer_type_the_engines_read_otherwise_is_noted(target, tmp_path, kind, words):
    """vLLM's update_eagle3 reads a missing model_type as llama, while speculators builds a
    Qwen3Config for a layer config naming none (Eagle3SpeculatorConfig's validator); a type
    outside {llama, qwen3} newer vLLM and speculators (model_classes) refuse. The import reads
    both as llama: it loaded them without a word."""
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp",
                         target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    c["transformer_layer_config"].pop("model_type")
    if kind is not None:
        c["transformer_layer_config"]["model_type"] = kind
    (out / "config.json").write_text(json.dumps(c))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_any(out, target=str(target.folder))
    notes = [str(w.message) for w in caught if isinstance(w.message, ImportNote)]
    assert any("model_type" in n and words in n for n in notes), notes
