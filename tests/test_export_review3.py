"""Export/import, third review: a d2t of absolute ids, a t2d that is no mask, and the training
log an import --overwrite left beside the drafter it replaced."""

from __future__ import annotations

import json

import pytest
import torch
from test_export import make
from test_import_review import _edit

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter, read_any


def _absolute(w: dict[str, torch.Tensor]) -> None:
    w["d2t"] = w["d2t"] + torch.arange(w["d2t"].numel())


def test_a_d2t_of_absolute_ids_is_refused_naming_offsets(target, tmp_path):
    """A d2t holding target ids (not offsets) that still lies inside the vocabulary read as
    offsets was imported without a word: the drafter then drafted other tokens, as SGLang and
    vLLM would."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg")
    low = torch.arange(40) * 2  # ids 0..78: as offsets 3i <= 117, inside the 128-token vocab
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[low] = True
    _edit(out, weights=lambda w: w.update(d2t=low, t2d=t2d))
    with pytest.raises(DraftsmithError, match=r"d2t holds absolute target ids.*d2t - arange"):
        read_any(out, target=str(target.folder))
    _edit(out, weights=lambda w: w.update(d2t=low - torch.arange(40)))
    assert torch.equal(read_any(out, target=str(target.folder)).to_target(torch.arange(40)), low)


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_absolute_ids_past_the_vocab_are_named_as_absolute(target, tmp_path, layout):
    out = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / "out")
    _edit(out, weights=_absolute)
    with pytest.raises(DraftsmithError, match="d2t holds absolute target ids"):
        read_any(out, target=str(target.folder))
    _edit(out, weights=lambda w: w.pop("t2d"))  # no t2d: past the vocab as offsets, a map as ids
    with pytest.raises(DraftsmithError, match="d2t holds absolute target ids"):
        read_any(out, target=str(target.folder))


def test_a_t2d_of_ids_is_named_as_no_mask(target, tmp_path):
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg")
    _edit(out, weights=lambda w: w.update(t2d=torch.nonzero(w["t2d"]).flatten()))
    with pytest.raises(DraftsmithError, match=r"t2d has 40 entries, not one per target token "
                       r"\(128\); t2d is a boolean mask"):
        read_any(out, target=str(target.folder))


def test_import_overwrite_drops_the_replaced_drafters_training_log(target, tmp_path):
    """A trained drafter's folder without checkpoints/ (a run shorter than --save-every) kept
    its train_log.jsonl through `import --overwrite`; the doctor then promised the imported
    drafter the replaced one's acceptance."""
    from draftsmith.doctor.behaviour import promised
    from draftsmith.train.report import LOG, PLOT

    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    old = make(target, tmp_path / "old")
    (old / LOG).write_text(json.dumps({"step": 10, "cond_acc": [0.9, 0.8],
                                       "accept_length": 2.5}) + "\n")
    (old / PLOT).write_bytes(b"png")
    assert promised(old) is not None
    import_drafter(sp, old, overwrite=True)
    assert promised(old) is None
    assert not (old / PLOT).exists() and sorted(p.name for p in old.iterdir()) == [
        "draftsmith.json", "model.safetensors"]


def _eagle_reference(target, tmp_path) -> tuple:
    """The EAGLE reference code's folder: its traineagle3/config.json (architectures
    LlamaForCausalLM, a draft_vocab_size, no ids) beside deepspeed's pytorch_model.bin of the
    trained tensors (the frozen embedding left out)."""
    from safetensors.torch import load_file

    sg = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg")
    c = json.loads((sg / "config.json").read_text())
    ref = tmp_path / "eagle"
    ref.mkdir()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "rms_norm_eps", "vocab_size", "draft_vocab_size", "head_dim",
            "max_position_embeddings", "tie_word_embeddings", "model_type")
    (ref / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 **{k: c[k] for k in keep}}))
    torch.save(load_file(sg / "model.safetensors"), ref / "pytorch_model.bin")
    return sg, ref


def test_an_eagle_reference_folder_imports(target, tmp_path):
    """EAGLE's own training writes config.json with architectures LlamaForCausalLM (vLLM's
    eagle3 method maps it to Eagle3LlamaForCausalLM); import refused it as 'neither speculators
    nor SGLang'."""
    import warnings

    from draftsmith.export import detect_format
    from draftsmith.export.layout import ImportNote

    sg, ref = _eagle_reference(target, tmp_path)
    assert detect_format(ref) == "sglang"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = read_any(ref, target=str(target.folder))
    notes = [str(w.message) for w in caught if isinstance(w.message, ImportNote)]
    assert any("EAGLE reference" in m and "SGLang builds a plain model" in m for m in notes)
    want = read_any(sg, target=str(target.folder))
    for (k, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert got.cfg.aux_layer_ids == [1, 2, 2]  # the engines' defaults on this 6-layer target


def test_a_targets_folder_is_still_no_drafter(target, tmp_path):
    from draftsmith.export import detect_format

    with pytest.raises(DraftsmithError, match="not a target's"):
        detect_format(target.folder)


def test_engine_refusals_name_the_layout_that_serves_the_drafter(target, tmp_path):
    """A drafter narrower than its target, or deeper than one layer, was refused with no word
    of the other layout, which serves it."""
    from test_export_review import narrow_drafter

    _, narrow = narrow_drafter(target, tmp_path / "n")
    with pytest.raises(DraftsmithError, match="differs from its hidden size 32; export --format "
                       "sglang instead"):
        export_drafter(narrow, "speculators", tmp_path / "sp", target=str(target.folder))
    deep = make(target, tmp_path / "deep", num_layers=2)
    with pytest.raises(DraftsmithError, match="export --format speculators for vLLM"):
        export_drafter(deep, "sglang", tmp_path / "sg", target=str(target.folder))
