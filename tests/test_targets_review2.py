"""Which weight files a target folder's load reads, and a tied config's stored head."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_folder
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target
from draftsmith.targets.hf import read_weights


def _split(folder, parts: int, prefix: str = "model") -> list[str]:
    """model.safetensors cut into `parts` shards named as save_pretrained names them."""
    w = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(w)
    files = [f"{prefix}-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    for i, f in enumerate(files):
        save_file({k: w[k] for k in names[i::parts]}, folder / f)
    return files


def test_a_tied_configs_stored_head_is_the_embedding_as_the_built_model_uses(tmp_path, capsys):
    """A fine-tune that saved a differing lm_head.weight beside tie_word_embeddings: the built
    model (as SGLang and vLLM) computes logits with the embedding, but training's targets and the
    drafter's head were taken from the stored head, another distribution."""
    from draftsmith.train.sources import target_head

    folder = write_tiny_folder(tmp_path / "t", "llama", tie_word_embeddings=True)
    w = load_file(folder / "model.safetensors")
    w["lm_head.weight"] = torch.randn_like(w["model.embed_tokens.weight"])
    save_file(w, folder / "model.safetensors")
    t = load_target(folder)
    assert "lm_head.weight" in capsys.readouterr().err
    embed, head = target_head(t)
    assert torch.equal(head, w["model.embed_tokens.weight"])
    model = t.build()
    hidden = torch.randn(3, embed.shape[1])
    assert torch.allclose(model.lm_head(hidden), hidden @ head.T, atol=1e-5)


def test_a_stored_head_equal_to_the_embedding_keeps_the_fingerprint(tmp_path, capsys):
    from draftsmith.targets import fingerprint

    folder = write_tiny_folder(tmp_path / "t", "llama", tie_word_embeddings=True)
    w = load_file(folder / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, folder / "model.safetensors")
    capsys.readouterr()
    t = load_target(folder)
    assert capsys.readouterr().err == ""  # nothing to warn of
    assert t.fingerprint == fingerprint(t.cfg, t.tokenizer, w)  # as the stored weights give it


def test_model_safetensors_alone_is_read_beside_other_unindexed_files(tmp_path):
    """HF's from_pretrained reads model.safetensors only; every *.safetensors was read, and one
    sorting after it (an old copy) overwrote its tensors."""
    folder = write_tiny_folder(tmp_path / "t", "llama")
    want = load_file(folder / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros_like(want["model.norm.weight"])},
              folder / "model_old.safetensors")
    got = read_weights(folder)
    assert sorted(got) == sorted(want)
    assert torch.equal(got["model.norm.weight"], want["model.norm.weight"])


def test_an_index_beside_a_model_safetensors_it_does_not_name_is_refused(tmp_path):
    """A folder re-saved unsharded keeps its old index (save_pretrained leaves it): HF reads
    model.safetensors, vLLM the index's shards; the index's files were read silently."""
    folder = write_tiny_folder(tmp_path / "t", "llama")
    whole = load_file(folder / "model.safetensors")
    save_file(whole, folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(whole, "model-00001-of-00001.safetensors")}))
    with pytest.raises(DraftsmithError, match="holds model.safetensors and model.safetensors"
                       r".index.json naming other files.*remove the one that is stale"):
        read_weights(folder)


def test_unindexed_files_load_only_as_one_whole_set_of_shards(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    want = load_file(folder / "model.safetensors")
    files = _split(folder, 2)
    assert sorted(read_weights(folder)) == sorted(want)  # the index alone left behind
    save_file({"x": torch.zeros(1)}, folder / "consolidated.safetensors")
    with pytest.raises(DraftsmithError, match=r"'consolidated.safetensors', 'model-00001.*and no "
                       "model.safetensors.index.json saying which hold the model"):
        read_weights(folder)
    (folder / "consolidated.safetensors").unlink()
    (folder / files[1]).unlink()  # one shard of two
    with pytest.raises(DraftsmithError, match="saying which hold the model"):
        read_weights(folder)


def test_an_index_of_other_than_file_names_is_one_error(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _split(folder, 2)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(DraftsmithError, match="no weight_map object of tensor names to file"):
        read_weights(folder)
