"""An engine folder read alike by `import`, the doctor and compare: one reading of its aux ids,
one loader of its weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_export import make

from draftsmith.compare.describe import describe
from draftsmith.doctor import DoctorOptions, run_doctor
from draftsmith.doctor.artifacts import load_any, read_drafter
from draftsmith.export import export_drafter, read_any


def _relist(folder: Path, layout: str, ids: list[int]) -> None:
    c = json.loads((folder / "config.json").read_text())
    if layout == "sglang":
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        c.pop("eagle_aux_hidden_state_layer_ids")  # SGLang's key alone
    else:
        c["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("layout,listed,fed", [
    ("sglang", [3, 1, 2], [1, 2, 3]),  # outputs of 3, 1, 2, fed ascending
    ("sglang", [2, 1, 3], [1, 2, 3]),
    ("speculators", [5, 2, 3], [1, 2, 4]),  # vLLM: inputs of 5, 2, 3
])
def test_unsorted_ids_read_alike_by_import_doctor_and_compare(target, tmp_path, layout, listed,
                                                              fed):
    """The engines capture walking the layers, so they feed a list's layers ascending. Import,
    the doctor's import row and compare read one list three ways (sorted first, as written,
    as fed): the drafter was measured on other layers than the engine feeds."""
    out = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout,
                         target=str(target.folder))
    _relist(out, layout, listed)
    with pytest.warns(UserWarning, match="not ascending"):
        imported = read_any(out, target=str(target.folder)).cfg.aux_layer_ids
    rep = run_doctor(DoctorOptions(drafter=out, target=str(target.folder), run=False))
    feeds = {r["engine"]: r["feed"]["canonical"] for r in rep.engines}
    engine = "sglang" if layout == "sglang" else "vllm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = load_any(read_drafter(out), target, "cpu", torch.float32).cfg.aux_layer_ids
    assert imported == feeds["draftsmith"] == feeds[engine] == measured == fed
    assert describe(out, "x", target.cfg.num_layers).ids_canonical == fed


def test_doctor_and_compare_read_a_bin_folder_import_reads(target, tmp_path):
    """An SGLang folder holding pytorch_model.bin (older EAGLE-3 releases): import read it, the
    doctor and compare refused it ("no *.safetensors weight file")."""
    out = export_drafter(make(target, tmp_path / "d", max_position_embeddings=512), "sglang",
                         tmp_path / "sg")
    w = load_file(out / "model.safetensors")
    torch.save(w, out / "pytorch_model.bin")
    (out / "model.safetensors").unlink()
    assert torch.equal(read_any(out, target=str(target.folder)).fc.weight, w["fc.weight"])
    rep = run_doctor(DoctorOptions(drafter=out, target=str(target.folder), prompts=1,
                                   max_new=4, steps=1))
    assert not rep.errors(), [f.what for f in rep.errors()]
    assert list(rep.behaviour["runs"]) == ["as sglang feeds it"]
    d = describe(out, "bin", target.cfg.num_layers)
    assert d.arch["weights dtype"] == "F32" and not d.params.embedding_stored
    assert d.params.stored == sum(t.numel() for t in w.values())


def _edit(folder: Path, config=None, weights=None) -> Path:
    from safetensors.torch import save_file

    if config is not None:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))
    if weights is not None:
        w = load_file(folder / "model.safetensors")
        weights(w)
        save_file(w, folder / "model.safetensors")
    return folder


def test_a_d2t_mapping_past_the_vocab_is_one_error_not_a_traceback(target, tmp_path):
    """A d2t whose target ids lie past the vocab and no t2d: import, and the doctor's run after
    its own vocab finding, died with IndexError while deriving t2d."""
    from draftsmith.errors import DraftsmithError

    out = export_drafter(make(target, tmp_path / "d", max_position_embeddings=512), "sglang",
                         tmp_path / "sg")
    _edit(out, weights=lambda w: (w.__setitem__("d2t", w["d2t"] + 1000), w.pop("t2d")))
    with pytest.raises(DraftsmithError, match="draft ids map outside the target vocab"):
        read_any(out, target=str(target.folder))
    rep = run_doctor(DoctorOptions(drafter=out, target=str(target.folder), prompts=1,
                                   max_new=4, steps=1))
    assert any("does not load" in f.what and "outside the target vocab" in f.what
               for f in rep.errors())


def _full_vocab(target, folder: Path) -> Path:
    """An SGLang folder of a drafter over the target's whole vocab, d2t/t2d left out."""
    from test_drafter import random_drafter
    from test_train_helpers import AUX

    from draftsmith.models.eagle3 import Eagle3Config, save_drafter

    cfg = Eagle3Config.for_target(target.cfg, target.cfg.vocab_size, AUX,
                                  target_fingerprint=target.fingerprint,
                                  target_source=str(target.folder))
    src = save_drafter(random_drafter(cfg), folder / "d", training={"steps": 0})
    out = export_drafter(src, "sglang", folder / "sg")
    return _edit(out, weights=lambda w: (w.pop("d2t"), w.pop("t2d"), w.pop("lm_head.weight")))


def test_sglang_heads_tied_or_taken_from_the_target_import_as_sglang_loads_them(target, tmp_path):
    """SGLang's LlamaForCausalLMEagle3 makes lm_head the embedding under tie_word_embeddings, and
    takes the target's lm_head where draft_vocab_size is missing (load_lm_head_from_target); import
    and so the doctor and compare refused both folders: "missing tensors ['lm_head.weight']"."""
    from draftsmith.train.sources import target_head

    embed, head = target_head(target)
    assert not torch.equal(embed, head)
    tied = _edit(_full_vocab(target, tmp_path / "tied"),
                 config=lambda c: c.update(tie_word_embeddings=True))
    assert torch.equal(read_any(tied, target=str(target.folder)).lm_head.weight, embed)
    untied = _edit(_full_vocab(target, tmp_path / "untied"),
                   config=lambda c: c.pop("draft_vocab_size"))
    back = read_any(untied, target=str(target.folder))
    assert torch.equal(back.lm_head.weight, head)
    assert describe(untied, "u", target.cfg.num_layers).arch["draft_vocab_size"] == 128
    rep = run_doctor(DoctorOptions(drafter=untied, target=str(target.folder), prompts=1,
                                   max_new=4, steps=1))
    assert "behaviour" not in {f.check for f in rep.errors()} and rep.behaviour


def test_a_speculators_folder_without_draft_vocab_size_reads_as_vllm_reads_it(target, tmp_path):
    """vLLM's Eagle3LlamaForCausalLM takes the vocab where draft_vocab_size is missing; import
    took speculators' library default 32000, the doctor the vocab: one folder, two sizes."""
    from draftsmith.errors import DraftsmithError

    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    _edit(out, config=lambda c: c.pop("draft_vocab_size"))
    assert read_drafter(out).draft_vocab_size == target.cfg.vocab_size
    with pytest.raises(DraftsmithError, match="d2t has 40 entries .* draft vocab 128"):
        read_any(out, target=str(target.folder))


def test_a_speculators_folder_without_norm_before_residual_reads_as_vllm_serves_it(target,
                                                                                  tmp_path):
    """vLLM's update_eagle3 reads a missing norm_before_residual as True; import (and so the
    doctor's and compare's runs) read it as False: another computation than the one served."""
    from draftsmith.models.eagle3 import load_drafter

    src = make(target, tmp_path / "d", norm_before_residual=True)
    out = export_drafter(src, "speculators", tmp_path / "sp")
    _edit(out, config=lambda c: c.pop("norm_before_residual"))
    back = read_any(out, target=str(target.folder))
    assert back.cfg.norm_before_residual
    d = load_drafter(src)
    x, h, pos = torch.randint(0, 128, (1, 5)), torch.randn(1, 5, 64), torch.arange(5)[None]
    with torch.no_grad():
        assert torch.allclose(back(x, h, pos)[0], d(x, h, pos)[0], atol=1e-6)
    assert describe(out, "sp", target.cfg.num_layers).arch["norm_before_residual"]
