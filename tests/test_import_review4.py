"""Import, fourth review: a qwen3 speculators layer without q/k norms, the stored embedding vLLM
keeps, the doctor's advice on targets whose default ids collide, and export to a target the
drafter does not fit."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import write_tiny_folder
from test_export import make
from test_import_review import _edit
from test_import_review3 import IDS
from test_import_review3 import _read as _notes

from draftsmith.doctor.engines import what_to_write
from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, read_any
from draftsmith.targets import load_target


def test_a_qwen3_layer_without_qk_norms_is_refused_not_read_as_llama(target, tmp_path):
    """speculators builds a qwen3 transformer_layer_config as a Qwen3 layer (q/k normed per
    head), vLLM's Eagle3Qwen3ForCausalLM too; without q_norm/k_norm tensors import read it as a
    plain llama drafter without a word."""
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    _edit(out, config=lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    with pytest.raises(DraftsmithError, match=r"model_type is 'qwen3'.*no q_norm/k_norm "
                       r"weights.*set transformer_layer_config.model_type to \"llama\""):
        read_any(out, target=str(target.folder))
    _edit(out, config=lambda c: c["transformer_layer_config"].update(model_type="llama"))
    assert read_any(out, target=str(target.folder)).cfg.aux_layer_ids == [1, 2, 4]


def test_a_stored_speculators_embedding_vllm_keeps_is_named(target, tmp_path):
    """vLLM's proposer shares the target's embedding only where the draft's is absent or
    identical; import kept a differing one silently, and the doctor said nothing of it."""
    from draftsmith.doctor import DoctorOptions, run_doctor

    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    assert not [m for m in _notes(out, target)[1] if "embed" in m]  # the target's own: silent
    other = torch.randn(128, 64)
    _edit(out, weights=lambda w: w.update({"embed_tokens.weight": other}))
    d, said = _notes(out, target)
    assert torch.equal(d.embed_tokens.weight, other)  # as vLLM serves it
    assert len(said) == 1 and "vLLM keeps a draft's own embedding" in said[0]
    rep = run_doctor(DoctorOptions(drafter=out, target=str(target.folder), max_new=2,
                                   prompts=1, steps=1))
    loads = [f for f in rep.findings if f.check == "loads"]
    assert len(loads) == 1 and "stored embed_tokens.weight differs" in loads[0].what
    assert "remove embed_tokens.weight" in loads[0].fix


def test_advice_never_names_a_layer_twice_on_small_targets():
    """The fix for ids SGLang cannot capture suggested the engines' defaults, which repeat a
    layer on 4-6-layer targets (`--aux-layers 0,1,1`, `1,1,1`) or hold the embedding it cannot
    capture on 3 (`-1,0,1`)."""
    assert "--aux-layers 0,1,3`" in what_to_write([-1, 1, 4], "sglang", 5)[1]
    written, words = what_to_write([-1, 1, 3], "sglang", 4)
    assert written is None and "--aux-layers 0,1,2`" in words
    written, words = what_to_write([-1, 0, 1], "sglang", 3)
    assert written is None and "cannot be given 3 distinct layers" in words
    written, words = what_to_write([0, 1, 1], "vllm", 4)
    assert written is None and "repeat a layer" in words and "--aux-layers 0,1,2" in words
    from draftsmith.doctor.engines import capturable_ids

    for layers in range(3, 12):
        for engine in ("sglang", "vllm", "draftsmith"):
            ids = capturable_ids(engine, layers, 3)
            if ids is None:
                assert engine.startswith("sglang") and layers <= 4
                continue
            assert ids == sorted(set(ids)) and len(ids) == 3, (layers, engine, ids)
            assert what_to_write(ids, engine, layers)[0] is not None


def test_doctor_does_not_advise_writing_default_ids_that_repeat_a_layer(tmp_path):
    """A 4-layer target's folder without ids: vLLM feeds its defaults, canonical [0, 1, 1];
    the doctor's fix was `write eagle_aux_hidden_state_layer_ids (top level): [1, 2, 2]`."""
    from draftsmith.doctor import DoctorOptions, run_doctor

    t4 = load_target(write_tiny_folder(tmp_path / "t4", "llama", num_hidden_layers=4))
    out = _edit(export_drafter(make(t4, tmp_path / "d", aux=[0, 1, 2]), "speculators",
                               tmp_path / "sp"), config=lambda c: (c.pop(IDS), c.pop("draftsmith")))
    rep = run_doctor(DoctorOptions(drafter=out, target=str(t4.folder), run=False))
    wiring = [f for f in rep.findings if f.check == "wiring"]
    assert wiring and "4-layer target" in wiring[0].what
    assert all("[1, 2, 2]" not in f.fix for f in wiring)
    assert "--data" in wiring[0].fix


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_refuses_a_target_the_unrecorded_drafter_does_not_fit(target, tmp_path, fmt):
    """A drafter without a fingerprint (imported without --target) exported with a --target of
    another hidden size or depth was written, recording that target's fingerprint as its own."""
    src = make(target, tmp_path / "d", target_fingerprint="")
    narrow = write_tiny_folder(tmp_path / "narrow", "llama", hidden_size=32,
                               num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(DraftsmithError, match="does not fit the drafter.*hidden 64.*hidden 32"):
        export_drafter(src, fmt, tmp_path / "a", target=str(narrow))
    deep = write_tiny_folder(tmp_path / "deep", "llama", num_hidden_layers=8)
    with pytest.raises(DraftsmithError, match="has 8 layers.*target of 6"):
        export_drafter(src, fmt, tmp_path / "b", target=str(deep))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    out = export_drafter(src, fmt, tmp_path / "c", target=str(target.folder))
    recorded = json.loads((out / "config.json").read_text())["draftsmith"]
    assert recorded["target_fingerprint"] == target.fingerprint


def test_a_target_of_another_fingerprint_is_refused_before_any_note(target, tmp_path):
    """The twin's embedding differs from the stored one: import warned of it, then refused the
    twin by fingerprint, one warning for a target it was never going to take."""
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    twin = load_target(write_tiny_folder(tmp_path / "twin", "llama", seed=7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DraftsmithError, match="records its target as"):
            read_any(out, target=str(twin.folder))
