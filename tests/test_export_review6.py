"""Export/import, sixth review: a speculators folder without lm_head weights (vLLM shares the
target's head), the recorded target kept by an import that needs none, JSON-null config
sections, and vLLM's edge aux ids (0, L) that only newer vLLM captures."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from test_drafter import random_drafter
from test_export import make
from test_import_review import _edit
from test_train_helpers import AUX

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter, read_any
from draftsmith.export.layout import ImportNote
from draftsmith.models.eagle3 import Eagle3Config, load_drafter, save_drafter
from draftsmith.train.sources import target_head


def _headless(target, tmp_path, name: str, draft_vocab: int = 40):
    cfg = Eagle3Config.for_target(target.cfg, draft_vocab, AUX,
                                  target_fingerprint=target.fingerprint,
                                  target_source=str(target.folder), max_position_embeddings=64,
                                  target_architectures=["LlamaForCausalLM"])
    d = random_drafter(cfg)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.weights["model.embed_tokens.weight"])
    src = save_drafter(d, tmp_path / f"{name}-d", training={"steps": 0})
    sp = export_drafter(src, "speculators", tmp_path / name)
    return _edit(sp, weights=lambda w: w.pop("lm_head.weight"))


def test_a_headless_speculators_folder_imports_with_the_targets_head(target, tmp_path):
    """vLLM marks a checkpoint without lm_head weights as having none of its own and shares
    the target's; the import refused it ("missing lm_head.weight")."""
    sp = _headless(target, tmp_path, "sp", 128)  # the whole vocabulary
    with pytest.warns(ImportNote, match="no lm_head.weight; vLLM shares the target's head"):
        d = read_any(sp, target=str(target.folder))
    assert torch.equal(d.lm_head.weight, target_head(target)[1].to(d.lm_head.weight.dtype))
    out = import_drafter(sp, tmp_path / "imp")  # untold: the verifier it records supplies it
    assert torch.equal(load_drafter(out).lm_head.weight, d.lm_head.weight)


def test_a_headless_folder_over_target_ids_0_to_n_takes_the_first_rows(target, tmp_path):
    """A draft vocabulary of target ids 0..N-1 (d2t all 0) is what vLLM's shared head, cut to
    its first N logits, serves right."""
    sp = _headless(target, tmp_path, "sp")
    _edit(sp, weights=lambda w: (w.update(d2t=torch.zeros(40, dtype=torch.long)),
                                 w.pop("t2d")))
    with pytest.warns(ImportNote, match=r"the first 40 rows of the target's lm_head"):
        d = read_any(sp, target=str(target.folder))
    want = target_head(target)[1][:40].to(d.lm_head.weight.dtype)
    assert torch.equal(d.lm_head.weight, want)


def test_a_headless_folder_whose_d2t_maps_elsewhere_is_one_error(target, tmp_path):
    sp = _headless(target, tmp_path, "sp")  # a draft vocab of 40 other tokens
    with pytest.raises(DraftsmithError, match=r"no lm_head.weight, and vLLM's shared target "
                       r"head .* d2t maps draft ids to other target tokens") as e:
        read_any(sp, target=str(target.folder))
    assert "\n" not in str(e.value)
    bare = _edit(shutil.copytree(sp, tmp_path / "bare"),
                 config=lambda c: (c.pop("draftsmith"), c["speculators_config"].pop("verifier")),
                 weights=lambda w: w.pop("embed_tokens.weight"))
    with pytest.raises(DraftsmithError, match="pass --target"):
        read_any(bare)


def test_an_untold_import_of_a_folder_holding_its_embedding_keeps_the_recorded_target(
        target, tmp_path):
    """An SGLang folder that stores its embedding (as SpecForge's do) reads without a target,
    and the import left target_source empty although config.json records it: the doctor then
    asked for --target."""
    sgl = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    embed = target.weights["model.embed_tokens.weight"]
    _edit(sgl, weights=lambda w: w.update({"embed_tokens.weight": embed.clone()}))
    d = load_drafter(import_drafter(sgl, tmp_path / "imp"))
    assert d.cfg.target_source == str(target.folder.resolve())
    assert d.cfg.target_fingerprint == target.fingerprint


@pytest.mark.parametrize("fmt,key", [("sglang", "draftsmith"), ("speculators", "draftsmith"),
                                     ("speculators", "speculators_config"),
                                     ("speculators", "transformer_layer_config")])
def test_a_null_config_section_is_one_error_naming_the_file_and_key(target, tmp_path, fmt,
                                                                    key):
    out = export_drafter(make(target, tmp_path / "d"), fmt, tmp_path / fmt)
    _edit(out, config=lambda c: c.update({key: None}))
    for given in (None, str(target.folder)):
        with pytest.raises(DraftsmithError, match=rf"{fmt}/config.json: {key} is null, not a "
                                                  "JSON object"):
            read_any(out, target=given)


def test_a_verifier_that_is_no_object_is_named(target, tmp_path):
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    _edit(out, config=lambda c: c["speculators_config"].update(verifier=["x"]))
    with pytest.raises(DraftsmithError, match=r"speculators_config.verifier is \[\"x\"\], not "
                                              "a JSON object"):
        read_any(out)


def test_a_null_eagle_config_reads_as_absent_as_the_engines_read_it(target, tmp_path):
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    _edit(out, config=lambda c: c.update(eagle_config=None))
    # the top-level vLLM ids, as vLLM reads them; SGLang falls back to its defaults
    assert read_any(out, target=str(target.folder)).cfg.aux_layer_ids == AUX


@pytest.mark.parametrize("aux,words", [([0, 2, 5], "6 .the last layer's output."),
                                       ([-1, 2, 4], "0 .the embedding output.")])
def test_vllm_edge_ids_are_warned_not_refused(target, tmp_path, aux, words):
    """vLLM id L (and 0) is captured only by newer vLLM model files; an older one fails on
    the drafter (too few states for fc, a None residual), so export warns, as the doctor."""
    src = make(target, tmp_path / "d", aux=aux)
    with pytest.warns(UserWarning, match=rf"vLLM aux layer id {words} is captured only by "
                                         "newer vLLM"):
        out = export_drafter(src, "speculators", tmp_path / "sp")
    c = json.loads((out / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]


def test_inner_ids_export_without_the_edge_warning(target, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter(make(target, tmp_path / "d", aux=[0, 2, 4]), "speculators",
                       tmp_path / "sp")


def test_compare_counts_a_headless_folder_over_ids_0_to_n_as_fitting(target, tmp_path):
    """compare named every headless folder with a smaller draft vocabulary a misfit, also one
    whose d2t is all 0, which vLLM's shared head (its first N logits) serves right."""
    from draftsmith.compare.describe import describe

    zero = _edit(_headless(target, tmp_path, "zero"),
                 weights=lambda w: w.update(d2t=torch.zeros(40, dtype=torch.long),
                                            t2d=torch.arange(128) < 40))
    assert describe(zero, "zero").params.lm_head_source == "shared"
    other = _headless(target, tmp_path, "other")
    assert describe(other, "other").params.lm_head_source == "shared_misfit"


def test_a_t2d_without_d2t_that_marks_other_tokens_is_named(target, tmp_path):
    """Without d2t both engines draft target ids 0..N-1 (they skip t2d); the import derived
    d2t from t2d without a word, so the folder served as it is drafts other tokens."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    _edit(out, weights=lambda w: w.pop("d2t"))
    with pytest.warns(ImportNote, match=r"no d2t, so SGLang and vLLM serving this folder draft "
                                        r"target ids 0..39 .they skip t2d., but t2d marks"):
        read_any(out, target=str(target.folder))
    first = _edit(out, weights=lambda w: w.update(t2d=torch.arange(128) < 40))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not read_any(first, target=str(target.folder)).d2t.any()


@pytest.mark.parametrize("edit,words", [
    (lambda c: c["draftsmith"].update(target_num_layers="six"),
     "draftsmith.target_num_layers is 'six', not a whole number"),
    (lambda c: c.update(target_hidden_size="wide"), "target_hidden_size is 'wide', not a whole")])
def test_a_malformed_size_is_named_not_a_traceback(target, tmp_path, edit, words):
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    # no target recorded anywhere: the size read from the config alone
    _edit(out, config=lambda c: (c.pop("speculators_config"), c["draftsmith"].pop("target"),
                                 edit(c)))
    with pytest.raises(DraftsmithError, match=words):
        read_any(out)
