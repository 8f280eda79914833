"""Targets, review 8: the tokenization hash beside the fingerprint, HF's weight file order,
a copied conversion's record, and conversions racing or killed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder
from safetensors.torch import save_file
from test_targets import _gguf_from_hf, _logits_match_hf
from test_targets_review7 import _byte_gguf

import draftsmith.targets as targets
from draftsmith.errors import DraftsmithError
from draftsmith.targets import check_tokenization, load_target
from draftsmith.targets.tokenizer import tokenization_hash, tokenizer_hash


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_one_vocabulary_split_two_ways_shares_a_fingerprint_not_a_tokenization(tmp_path, cache):
    """The default's conversion before and after its digit split (CONVERTER ":6") kept one
    fingerprint, so data tokenized the old way passed as the new target's; the tokenization hash
    tells them apart, and the data's record of it is refused for the other."""
    _byte_gguf(old := tmp_path / "old.gguf", pre="default")
    _byte_gguf(new := tmp_path / "new.gguf", pre="smollm")
    a, b = load_target(old), load_target(new)
    assert a.fingerprint == b.fingerprint  # existing fingerprints unchanged
    assert tokenizer_hash(a.tokenizer) == tokenizer_hash(b.tokenizer)
    assert a.describe()["tokenization_hash"] != b.describe()["tokenization_hash"]
    record = {"fingerprint": a.fingerprint, "tokenization_hash": tokenization_hash(a.tokenizer)}
    check_tokenization(record, a, "data/manifest.json")
    check_tokenization({"fingerprint": a.fingerprint}, b, "data/manifest.json")  # older data
    with pytest.raises(DraftsmithError, match=r"^data/manifest.json: tokenized with "
                                              r"tokenization \w+, but target .* splits text "
                                              r"otherwise"):
        check_tokenization(record, b, "data/manifest.json")


def test_the_tokenization_hash_is_hfs_tokenizers(tmp_path):
    from transformers import AutoTokenizer

    folder = write_tiny_folder(tmp_path / "m")
    t = load_target(folder)
    assert tokenization_hash(t.tokenizer) == tokenization_hash(AutoTokenizer.from_pretrained(
        folder))


def test_a_stray_safetensors_beside_hfs_bin_files_is_not_read(tmp_path):
    """HF reads pytorch_model.bin before any safetensors file but model.safetensors; draftsmith
    read a lone consolidated.safetensors (Mistral's own names) and failed on its tensor names."""
    import transformers as tf
    from safetensors.torch import load_file

    folder = write_tiny_folder(tmp_path / "m", num_hidden_layers=2)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},
              folder / "consolidated.safetensors")
    assert (folder / "pytorch_model.bin").is_file()
    t = load_target(folder)
    _logits_match_hf(t, tf.AutoModelForCausalLM.from_pretrained(folder).float().eval())


def test_a_copied_conversion_is_fingerprinted_by_its_files(tmp_path, cache):
    """A conversion's cache folder copied and used as an HF folder: a damaged
    draftsmith_target.json was a JSONDecodeError traceback, and new weights kept the old
    fingerprint the copied record named."""
    hf = tiny_hf_model("llama", num_hidden_layers=2)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    t = load_target(path)
    copy = shutil.copytree(t.folder, tmp_path / "copy")
    assert load_target(copy).fingerprint == t.fingerprint
    (copy / "draftsmith_target.json").write_text("{")
    assert load_target(copy).fingerprint == t.fingerprint
    weights = dict(targets.hf.read_weights(copy))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file({k: v.contiguous() for k, v in weights.items()}, copy / "model.safetensors")
    assert load_target(copy).fingerprint != t.fingerprint


def test_a_whole_entry_another_process_moved_in_stays(tmp_path):
    """Two ranks converting at once: the second moved the first's folder aside and removed it
    while the first was loading from it (a FileNotFoundError mid-load)."""
    folder = tmp_path / "targets" / "k"
    folder.mkdir(parents=True)
    (folder / "draftsmith_target.json").write_text('{"fingerprint": "first"}')
    (folder / "config.json").write_text("{}")
    inode = (folder / "config.json").stat().st_ino
    (tmp := tmp_path / "targets" / "k.x.tmp").mkdir()
    (tmp / "draftsmith_target.json").write_text('{"fingerprint": "second"}')
    damaged = targets._record_stamp(folder)
    targets._move_in(tmp, folder)
    assert (folder / "config.json").stat().st_ino == inode
    # found damaged by another process, which then moved its whole conversion in: kept
    (folder / "draftsmith_target.json").unlink()
    (folder / "draftsmith_target.json").write_text('{"fingerprint": "third"}')
    targets._move_in(tmp, folder, replace=damaged)
    assert json.loads((folder / "draftsmith_target.json").read_text())["fingerprint"] == "third"
    targets._move_in(tmp, folder, replace=targets._record_stamp(folder))  # the damaged one goes
    assert json.loads((folder / "draftsmith_target.json").read_text())["fingerprint"] == "second"


def test_a_damaged_entry_with_its_record_is_converted_again(tmp_path, cache, capsys):
    hf = tiny_hf_model("llama", num_hidden_layers=2)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    t = load_target(path)
    (t.folder / "config.json").write_text("[")
    again = load_target(path)
    assert "converting" in capsys.readouterr().err
    _logits_match_hf(again, hf)


def test_scratch_folders_a_killed_conversion_left_are_removed(tmp_path, cache):
    """A conversion killed mid-write left its temporary folder (a whole model's weights) in the
    cache for good; a later conversion removes this host's whose process is gone."""
    hf = tiny_hf_model("llama", num_hidden_layers=2)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    key = targets._cache_key(path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    names = {"dead": f"{key}.{host}-{dead.pid}.ab_1.tmp", "aside": f"{key}.{host}-{dead.pid}.c.old",
             "live": f"{key}.{host}-{os.getpid()}.d.tmp", "other": f"{key}.elsewhere-1.e.tmp"}
    names["fresh"] = f"{key}.{host}-{dead.pid}.f.tmp"  # another container's pid, written now
    hours_ago = time.time() - 2 * 3600
    for what, name in names.items():
        (cache / "targets" / name).mkdir(parents=True)
        (cache / "targets" / name / "model.safetensors").write_bytes(b"x")
        if what != "fresh":
            for q in (cache / "targets" / name / "model.safetensors", cache / "targets" / name):
                os.utime(q, (hours_ago, hours_ago))
    load_target(path)
    left = {p.name for p in (cache / "targets").iterdir()}
    assert left == {key, names["live"], names["other"], names["fresh"]}
