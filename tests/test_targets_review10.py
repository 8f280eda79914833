"""Review 10 of target loading: the fingerprint of a tied-head checkpoint that also stores a copy
of lm_head, and which weights the fingerprint covers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder
from safetensors.torch import load_file, save_file
from test_targets import _gguf_from_hf

from draftsmith.targets import fingerprint, load_target


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _with_head(folder, head: torch.Tensor | None) -> None:
    w = load_file(folder / "model.safetensors")
    if head is None:
        w.pop("lm_head.weight", None)
    else:
        w["lm_head.weight"] = head
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_tied_checkpoint_fingerprints_alike_with_or_without_a_stored_head(tmp_path):
    """save_pretrained drops a tied head, other tools store a copy of the embedding: one model,
    whose logits come from the embedding either way, had two fingerprints, so its captures and
    drafters were refused as another target's after a re-save."""
    bare = write_tiny_folder(tmp_path / "bare", "llama", tie_word_embeddings=True)
    _with_head(bare, None)
    embed = load_file(bare / "model.safetensors")["model.embed_tokens.weight"]
    copy = write_tiny_folder(tmp_path / "copy", "llama", tie_word_embeddings=True)
    _with_head(copy, embed.clone())
    other = write_tiny_folder(tmp_path / "other", "llama", tie_word_embeddings=True)
    _with_head(other, torch.randn_like(embed))  # not read: the embedding is the head
    fps = {load_target(f).fingerprint for f in (bare, copy, other)}
    assert len(fps) == 1


def test_a_tied_fingerprint_is_what_the_loader_uses(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama", tie_word_embeddings=True)
    _with_head(folder, torch.randn(128, 64))
    t = load_target(folder)
    assert t.fingerprint == fingerprint(t.cfg, t.tokenizer, t.weights)
    w = load_file(folder / "model.safetensors")
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 1.001  # the head it uses
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_target(folder).fingerprint != t.fingerprint


def test_a_tied_gguf_records_the_fingerprint_its_folder_gives(tmp_path, cache):
    _gguf_from_hf(path := tmp_path / "t.gguf", tiny_hf_model("llama", tie_word_embeddings=True),
                  "llama")
    t = load_target(path)
    assert t.cfg.tie_word_embeddings and "lm_head.weight" not in t.weights
    assert t.fingerprint == fingerprint(t.cfg, t.tokenizer, t.weights)


@pytest.mark.parametrize("change", ["lm_head.", "model.layers.5.", "model.norm."])
def test_a_changed_head_or_last_layer_changes_the_fingerprint(tmp_path, change):
    """Every tensor is sampled (its first 16 values and 64 strided ones): a fine-tuned head or
    last layer, which moves nearly every value, is told apart."""
    folder = write_tiny_folder(tmp_path / "t", "llama")
    before = load_target(folder).fingerprint
    w = load_file(folder / "model.safetensors")
    for k in [k for k in w if k.startswith(change)]:
        w[k] = w[k] + 1e-3 * torch.randn_like(w[k])
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_target(folder).fingerprint != before


def test_a_gguf_storing_output_beside_its_embedding_reads_it_as_llama_cpp(tmp_path, cache):
    """A GGUF has no tie flag: llama.cpp reads output.weight where the file holds one (a copy of
    token_embd or not), and so does the conversion; its recorded fingerprint covers that head."""
    fps = []
    for i, head in enumerate(("copy", "other")):
        hf = tiny_hf_model("llama")
        with torch.no_grad():
            emb = hf.model.embed_tokens.weight
            hf.lm_head.weight.copy_(emb if head == "copy" else torch.randn_like(emb))
        _gguf_from_hf(path := tmp_path / f"{i}.gguf", hf, "llama")
        t = load_target(path)
        assert not t.cfg.tie_word_embeddings
        assert torch.equal(t.weights["lm_head.weight"], hf.lm_head.weight.detach())
        assert t.fingerprint == fingerprint(t.cfg, t.tokenizer, t.weights)
        fps.append(t.fingerprint)
    assert fps[0] != fps[1]
