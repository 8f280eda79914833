"""Targets, thirteenth review: a GGUF read beside an HF folder's tokenizer files (llama.cpp's
converter writes its GGUF into the model's folder) takes its own tokenizer, and `targets show`
counts a tied head stored beside its embedding once."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_hf_model, write_tiny_folder
from safetensors.torch import load_file, save_file
from test_targets import _gguf_from_hf

from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import write_byte_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_beside_tokenizer_files_reads_its_own_tokenizer(tmp_path, cache):
    """transformers reads tokenizer.json and tokenizer_config.json from the GGUF's folder before
    the GGUF's own vocabulary: a GGUF beside another tokenizer was converted with that one's ids
    and no chat template, and fingerprinted as another target."""
    hf = tiny_hf_model("llama")
    _gguf_from_hf(alone := tmp_path / "m.gguf", hf, "llama")
    (beside := tmp_path / "beside").mkdir()
    write_byte_tokenizer(beside, vocab_size=hf.config.vocab_size)
    _gguf_from_hf(beside / "m.gguf", hf, "llama")
    a, b = load_target(alone), load_target(beside / "m.gguf")
    assert b.tokenizer.get_vocab() == a.tokenizer.get_vocab()
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    assert b.fingerprint == a.fingerprint
    assert b.chat_ids([{"role": "user", "content": "hi"}]) == \
        a.chat_ids([{"role": "user", "content": "hi"}])


def test_a_stored_tied_head_is_not_counted_twice(tmp_path):
    """A tied config's stored lm_head.weight is read as the embedding: one tensor, which the
    parameter count took twice (SmolLM2-135M said as 163M)."""
    folder = write_tiny_folder(tmp_path / "t", "llama", tie_word_embeddings=True)
    bare = load_target(folder).describe()["parameters"]
    w = load_file(folder / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_target(folder).describe()["parameters"] == bare


def test_a_gguf_without_its_suffix_is_named_as_a_gguf(tmp_path, cache):
    """ollama keeps GGUFs as `blobs/sha256-...`: such a file was refused as no GGUF at all."""
    from draftsmith.errors import DraftsmithError

    _gguf_from_hf(blob := tmp_path / "sha256-0a1b", tiny_hf_model("llama"), "llama")
    with pytest.raises(DraftsmithError) as e:
        load_target(blob)
    msg = str(e.value)
    assert "GGUF file without the .gguf suffix" in msg and "\n" not in msg
    (tmp_path / "model.gguf").symlink_to(blob)  # the fix the message names loads it
    assert load_target(tmp_path / "model.gguf").cfg.num_layers == 6


def test_a_weight_file_of_a_checkpoint_folder_names_the_folder(tmp_path):
    from draftsmith.errors import DraftsmithError

    folder = write_tiny_folder(tmp_path / "t", "llama")
    with pytest.raises(DraftsmithError, match="pass the folder"):
        load_target(folder / "model.safetensors")


def test_a_conversion_that_read_the_tokenizer_beside_its_gguf_is_converted_again(tmp_path, cache,
                                                                              capsys):
    """An entry converted before a GGUF was read alone (its record says nothing of its tokenizer)
    holds the tokenizer beside the GGUF, under this CONVERTER: converted again."""
    import json

    hf = tiny_hf_model("llama")
    _gguf_from_hf(alone := tmp_path / "m.gguf", hf, "llama")
    own = load_target(alone).tokenizer.get_vocab()
    (beside := tmp_path / "b").mkdir()
    _gguf_from_hf(gguf := beside / "m.gguf", hf, "llama")
    t = load_target(gguf)
    record = t.folder / "draftsmith_target.json"
    stale = {k: v for k, v in json.loads(record.read_text()).items() if k != "tokenizer"}
    record.write_text(json.dumps(stale))
    write_byte_tokenizer(t.folder, vocab_size=hf.config.vocab_size)  # what it read then
    write_byte_tokenizer(beside, vocab_size=hf.config.vocab_size)
    capsys.readouterr()
    assert load_target(gguf).tokenizer.get_vocab() == own
    assert "converting" in capsys.readouterr().err
    assert load_target(gguf).tokenizer.get_vocab() == own  # and kept: no third conversion
    assert "converting" not in capsys.readouterr().err
