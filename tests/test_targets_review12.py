"""Targets, twelfth review: a llama GGUF biasing q/k/v alone (llama.cpp takes each of bq, bk,
bv, bo as optional; a Qwen2 written as arch llama), and a GGUF replaced in place by another of
its size and mtime (`cp -p`) not served from the first one's conversion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import tiny_hf_model
from test_targets import _gguf_from_hf, _logits_match_hf

from draftsmith.targets import load_target


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_llama_gguf_biasing_q_k_v_alone_matches_hf(tmp_path, cache):
    """A Qwen2 (q/k/v biases, no o bias) written as arch llama: its converted config biases
    attention as HF's Llama does, all four, so it was refused lacking o_proj.bias; llama.cpp
    reads it with bo left out, which a zero o_proj bias is exactly."""
    hf = tiny_hf_model("qwen2")
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    t = load_target(path)
    assert t.cfg.arch == "llama" and t.cfg.attention_bias
    _logits_match_hf(t, hf)
    o_bias = t.weights["model.layers.0.self_attn.o_proj.bias"]
    assert o_bias.shape == (hf.config.hidden_size,) and not o_bias.any()
    assert load_target(path).fingerprint == t.fingerprint  # from the cache


def _same_size_and_mtime(path: Path, seed: int, like: os.stat_result):
    """Another model written over `path`, given its first file's mtime (what `cp -p` of a
    same-sized GGUF, such as another fine-tune of one base in one quantization, leaves)."""
    _gguf_from_hf(path, (hf := tiny_hf_model("llama", seed=seed)), "llama")
    os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns))
    assert path.stat().st_size == like.st_size
    assert path.stat().st_mtime_ns == like.st_mtime_ns
    return hf


def test_a_gguf_replaced_by_one_of_its_size_and_mtime_is_converted_again(tmp_path, cache,
                                                                         capsys):
    path = tmp_path / "m.gguf"
    _gguf_from_hf(path, tiny_hf_model("llama", seed=0), "llama")
    first = load_target(path)
    hf = _same_size_and_mtime(path, 1, path.stat())
    again = load_target(path)
    assert again.fingerprint != first.fingerprint
    _logits_match_hf(again, hf)
    assert "another file" in capsys.readouterr().err
    load_target(path)  # the new conversion is current: not converted a third time
    assert "converting" not in capsys.readouterr().err


def test_a_conversion_recording_no_file_digest_is_converted_again(tmp_path, cache, capsys):
    """An entry of an earlier draftsmith cannot tell which file it was converted from."""
    _gguf_from_hf(path := tmp_path / "m.gguf", (hf := tiny_hf_model("llama")), "llama")
    t = load_target(path)
    record = t.folder / "draftsmith_target.json"
    record.write_text(json.dumps({"fingerprint": t.fingerprint}))
    capsys.readouterr()
    again = load_target(path)
    assert "converting" in capsys.readouterr().err and again.folder == t.folder
    _logits_match_hf(again, hf)
    assert "gguf_digest" in json.loads(record.read_text())


def test_the_digest_reads_past_the_head_without_reading_the_whole_file(tmp_path, monkeypatch):
    """A file larger than the head the digest reads whole: a block strided into the rest, and
    the file's end, change it; what it reads stays a few MiB."""
    import builtins

    from draftsmith import targets

    path = tmp_path / "big.gguf"
    size = targets.DIGEST_HEAD + 64 * targets.DIGEST_BLOCKS * targets.DIGEST_BLOCK
    path.write_bytes(bytes(size))
    first = targets.gguf_digest(path)
    for at in (targets.DIGEST_HEAD + (size - targets.DIGEST_HEAD) // 2, size - 1):
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b"\x01")
        assert targets.gguf_digest(path) != first
        first = targets.gguf_digest(path)
    read, real_open = [], builtins.open

    def counting_open(*args, **kw):
        f = real_open(*args, **kw)
        real_read = f.read
        f.read = lambda n=-1: read.append(len(b := real_read(n))) or b  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    targets.gguf_digest(path)
    assert 0 < sum(read) <= targets.DIGEST_HEAD + (targets.DIGEST_BLOCKS + 1) * targets.DIGEST_BLOCK


def _with_tensor_type(path: Path, name: str, type_id: int) -> None:
    """A one-tensor GGUF whose tensor `name` is marked as GGML type `type_id` (as a file of a
    quantization newer than the installed gguf package reads to it)."""
    import struct

    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, np.zeros((4, 256), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = bytearray(path.read_bytes())
    at = raw.index(name.encode()) + len(name)
    dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * dims, type_id)
    path.write_bytes(bytes(raw))


def test_a_gguf_of_a_tensor_type_the_gguf_package_does_not_know_is_no_damaged_file(tmp_path,
                                                                                  cache):
    """It was said to be cut short or damaged, to fetch again: a download that cannot help."""
    from importlib import metadata

    from draftsmith.errors import DraftsmithError

    _with_tensor_type(path := tmp_path / "new.gguf", "token_embd.weight", 250)
    with pytest.raises(DraftsmithError) as e:
        load_target(path)
    msg = str(e.value)
    assert "\n" not in msg and "fetch it again" not in msg
    assert "new.gguf: not a readable GGUF file (" in msg
    assert f"gguf package ({metadata.version('gguf')}) does not know" in msg
    assert "pip install -U gguf" in msg


def test_a_tensor_type_gguf_cannot_dequantize_says_what_to_do(tmp_path, cache):
    import gguf

    from draftsmith.errors import DraftsmithError
    from draftsmith.targets import gguf_file

    _with_tensor_type(path := tmp_path / "q.gguf", "token_embd.weight",
                      int(gguf.GGMLQuantizationType.Q8_K))
    rd = gguf_file.reader(path)
    with pytest.raises(DraftsmithError, match=r"q.gguf: tensor token_embd.weight uses "
                                              r"quantization type Q8_K, which the gguf package "
                                              r"cannot dequantize; .*another quantization"):
        gguf_file.read_tensors(path, "llama", 1, 1, rd)


def test_a_gguf_holding_no_tokenizer_is_said_to_hold_none(tmp_path, cache, monkeypatch):
    """transformers said "Cannot build a tokenizer from a GGUF file stating tokenizer None"."""
    import gguf

    from draftsmith.errors import DraftsmithError

    for name in ("add_tokenizer_model", "add_tokenizer_pre", "add_token_list",
                 "add_token_types", "add_token_merges", "add_bos_token_id", "add_eos_token_id"):
        monkeypatch.setattr(gguf.GGUFWriter, name, lambda self, *a, **k: None)
    _gguf_from_hf(path := tmp_path / "m.gguf", tiny_hf_model("llama"), "llama")
    with pytest.raises(DraftsmithError) as e:
        load_target(path)
    assert str(e.value) == (f"{path}: the GGUF holds no tokenizer (no tokenizer.ggml.model or "
                            "tokenizer.ggml.tokens), which draftsmith needs to prompt the "
                            "target; use a GGUF converted with its tokenizer, or the model's "
                            "HF folder")
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())
