"""Import of engine folders read as the engines serve them: SGLang's shared embedding and head,
the engines' default ids on small targets, and speculators layers of another model type."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_export import make
from test_import_review import _edit

from draftsmith.doctor import DoctorOptions, run_doctor
from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, read_any
from draftsmith.train.sources import target_head


def _read(folder: Path, target=None) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = read_any(folder, target=None if target is None else str(target.folder))
    return d, [str(w.message) for w in caught]


def _sglang(target, tmp_path: Path, name: str) -> Path:
    return export_drafter(make(target, tmp_path / f"{name}-d"), "sglang", tmp_path / name)


def _full_vocab(target, folder: Path) -> Path:
    """A drafter over the target's whole vocab, with a head of its own."""
    from test_drafter import random_drafter
    from test_train_helpers import AUX

    from draftsmith.models.eagle3 import Eagle3Config, save_drafter

    cfg = Eagle3Config.for_target(target.cfg, target.cfg.vocab_size, AUX,
                                  target_fingerprint=target.fingerprint,
                                  target_source=str(target.folder))
    return save_drafter(random_drafter(cfg), folder, training={"steps": 0})


def test_a_stored_sglang_embedding_imports_as_the_target_one_sglang_serves(target, tmp_path):
    """SGLang's EAGLE worker replaces the draft's embedding with the target's (set_embed, when
    target_hidden_size equals hidden_size); import kept a stored one, so draftsmith ran, tuned and
    doctored another drafter than SGLang serves, without a word."""
    own = torch.randn(128, 64)
    out = _edit(_sglang(target, tmp_path, "sg"),
                weights=lambda w: w.__setitem__("embed_tokens.weight", own))
    embed, _ = target_head(target)
    d, said = _read(out, target)
    assert torch.equal(d.embed_tokens.weight, embed)
    assert len(said) == 1 and "embed_tokens.weight differs from the target's" in said[0]
    d, said = _read(out)  # no target: the stored one stands in, nothing new said
    assert torch.equal(d.embed_tokens.weight, own) and said == []
    same = _edit(_sglang(target, tmp_path, "same"),
                 weights=lambda w: w.__setitem__("embed_tokens.weight", embed.clone()))
    d, said = _read(same, target)
    assert torch.equal(d.embed_tokens.weight, embed) and said == []


def test_sglang_heads_the_target_replaces_import_as_sglang_serves_them(target, tmp_path):
    """Untied without draft_vocab_size, SGLang loads the target's lm_head whether or not one is
    stored (load_lm_head_from_target -> set_embed_and_head); tied, lm_head is the embedding module
    set_embed replaces. Import kept the stored head and the stored embedding as the tied head."""
    embed, head = target_head(target)
    full = _full_vocab(target, tmp_path / "full-d")
    untied = _edit(export_drafter(full, "sglang", tmp_path / "untied"),
                   config=lambda c: c.pop("draft_vocab_size"),
                   weights=lambda w: w.__setitem__("embed_tokens.weight", embed.clone()))
    d, said = _read(untied, target)
    assert torch.equal(d.lm_head.weight, head)
    assert len(said) == 1 and "lm_head.weight differs" in said[0] and "vLLM" not in said[0]
    assert not torch.equal(_read(untied)[0].lm_head.weight, head)
    tied = _edit(export_drafter(full, "sglang", tmp_path / "tied"),
                 config=lambda c: c.update(tie_word_embeddings=True),
                 weights=lambda w: w.__setitem__("embed_tokens.weight", torch.randn(128, 64)))
    d, said = _read(tied, target)
    assert torch.equal(d.embed_tokens.weight, embed) and torch.equal(d.lm_head.weight, embed)
    assert len(said) == 1


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_default_ids_that_repeat_a_layer_are_named_once(target, tmp_path, layout):
    """A 6-layer target's engine defaults are inputs of [2, 3, 3]: SGLang and vLLM capture layer
    3 once (`if i in layers_to_capture`) and feed two states to an fc of three. Import read them
    as [1, 2, 2] silently, and the doctor's engine rows only said the key was missing."""
    out = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout)
    _edit(out, config=lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"),
                                 (c.get("eagle_config") or {}).pop(
                                     "eagle_aux_hidden_state_layer_ids", None)))
    d, said = _read(out, target)
    assert d.cfg.aux_layer_ids == [1, 2, 2]
    repeats = [m for m in said if "6-layer target" in m]
    assert len(repeats) == 1 and "repeat a layer" in repeats[0], said
    rep = run_doctor(DoctorOptions(drafter=out, target=str(target.folder), run=False))
    from draftsmith.export.layout import default_repeat

    notes = {r["engine"]: r["feed"]["note"] for r in rep.engines}
    if layout == "speculators":  # SGLang loads no speculators folder (doctor review 23)
        assert "does not load the speculators layout" in notes.pop("sglang")
    assert all("6-layer target" in n for n in notes.values()), notes
    assert default_repeat(8) == "" and "4-layer" in default_repeat(4)


def test_explicit_ids_on_a_small_target_say_nothing_of_defaults(target, tmp_path):
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    assert not [m for m in _read(out, target)[1] if "layer target" in m]


def test_a_qwen3_speculators_layer_is_refused_naming_its_model_type(target, tmp_path):
    """vLLM builds a qwen3-typed transformer_layer_config as Eagle3Qwen3ForCausalLM (q/k norms);
    import forced llama and said only "unexpected tensors", not why."""
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    norms = {f"layers.0.self_attn.{n}.weight": torch.ones(16) for n in ("q_norm", "k_norm")}
    _edit(out, weights=lambda w: w.update(norms))
    with pytest.raises(DraftsmithError, match="unexpected tensors") as plain:
        read_any(out, target=str(target.folder))
    assert "model_type" not in str(plain.value)  # a llama layer: the loader's words alone
    _edit(out, config=lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    with pytest.raises(DraftsmithError, match=r"model_type is 'qwen3', and draftsmith reads "
                       r"only llama-type drafter layers.*q_norm"):
        read_any(out, target=str(target.folder))


@pytest.mark.parametrize("layout", ["sglang", "speculators", "draftsmith"])
def test_import_refuses_a_target_of_the_same_shape_but_another_fingerprint(target, tmp_path,
                                                                           layout):
    """Export refuses a --target whose fingerprint differs from the one the drafter records;
    import took it (a base model for its instruct twin: same shapes), so an SGLang folder got the
    wrong target's embedding and the drafter recorded one target and named another."""
    from conftest import write_tiny_folder

    from draftsmith.export import import_drafter

    src = make(target, tmp_path / "d")
    folder = src if layout == "draftsmith" else export_drafter(src, layout, tmp_path / layout)
    twin = write_tiny_folder(tmp_path / "twin", "llama", seed=7)
    with pytest.raises(DraftsmithError, match=r"--target .*twin has fingerprint .* records its "
                       r"target as"):
        import_drafter(folder, tmp_path / "imp", target=str(twin))
    assert not (tmp_path / "imp").exists()
    assert import_drafter(folder, tmp_path / "ok", target=str(target.folder)).is_dir()
