"""Targets, eleventh review: a Llama GGUF with attention biases (llama.cpp permutes q/k biases
as their weights), quantized GGUFs (Q8_0, Q4_K) against HF on the same dequantized weights,
the tokenizer's BOS as llama.cpp adds it, the conversion cache (a rewritten GGUF converted
again, two processes converting one file at once) and DRAFTSMITH_DEFAULT_GGUF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_hf_model
from test_targets import _gguf_from_hf, _logits_match_hf
from test_targets_review import _gguf

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_llama_gguf_with_attention_biases_matches_hf(tmp_path, cache, capsys):
    """llama.cpp reads a llama GGUF's optional bq/bk/bv/bo and its converter permutes the q/k
    biases as their weights: they were dropped (a warning) and would have stayed permuted."""
    hf = tiny_hf_model("llama", attention_bias=True)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    t = load_target(path)
    assert t.cfg.attention_bias
    _logits_match_hf(t, hf)
    assert "not read" not in capsys.readouterr().err


# --- quantized tensors ---------------------------------------------------------------------

def _q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K blocks (gguf cannot quantize to it): f16 d and dmin of a sane size, random
    6-bit scales and 4-bit values."""
    n = rows * cols // 256
    head = np.array([0.02, 0.01] * n, np.float16).view(np.uint8).reshape(n, 4)
    rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
    return np.concatenate([head, rest], axis=1).reshape(rows, cols // 256 * 144)


def _quantized_gguf(path: Path, hf, arch: str, qtype) -> None:
    """`_gguf_from_hf` with every 2-D tensor whose rows fit the type's blocks stored as `qtype`
    (Q8_0 quantized from the weights, Q4_K random blocks)."""
    import gguf
    from gguf.quants import quantize

    orig, rng = gguf.GGUFWriter.add_tensor, np.random.default_rng(0)
    block = gguf.GGML_QUANT_SIZES[qtype][0]

    def add_tensor(self, name, arr, **kw):
        if arr.ndim != 2 or arr.shape[1] % block:
            return orig(self, name, arr, **kw)
        raw = quantize(arr, qtype) if qtype == gguf.GGMLQuantizationType.Q8_0 \
            else _q4_k_blocks(*arr.shape, rng)
        return orig(self, name, raw, raw_dtype=qtype)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        _gguf_from_hf(path, hf, arch)
    finally:
        gguf.GGUFWriter.add_tensor = orig


def _as_stored(hf, path: Path, arch: str) -> None:
    """The HF model given the GGUF's weights as llama.cpp reads them (gguf's dequantize, q/k
    rows put back in HF's order), the reference a conversion must match."""
    import gguf
    from gguf.quants import dequantize

    from draftsmith.targets.gguf_file import hf_name

    c, state = hf.config, hf.state_dict()
    for t in gguf.GGUFReader(path).tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        w = torch.from_numpy(w.reshape([int(d) for d in reversed(t.shape)]).copy())
        name = hf_name(t.name)
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
        if arch == "llama" and (h := heads.get(t.name.split(".")[-2])):
            w = w.reshape(h, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        state[name].copy_(w)
    if c.tie_word_embeddings:
        hf.tie_weights()


@pytest.mark.parametrize(("arch", "qtype", "over"), [
    ("llama", "Q8_0", {}),
    ("qwen2", "Q8_0", {"tie_word_embeddings": True}),
    ("llama", "Q4_K", {"intermediate_size": 256}),  # ffn_down's rows of 256: Q4_K's block
])
def test_a_quantized_gguf_matches_hf_on_its_dequantized_weights(tmp_path, cache, arch, qtype,
                                                                over):
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    hf = tiny_hf_model(arch, **over)
    _quantized_gguf(path := tmp_path / "m.gguf", hf, arch, q)
    kinds = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert q in kinds
    _as_stored(hf, path, arch)
    t = load_target(path)
    assert t.weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    _logits_match_hf(t, hf)


# --- the tokenizer -------------------------------------------------------------------------

@pytest.mark.parametrize(("add_bos", "bos"), [(None, False), (True, True), (False, False)])
def test_a_bpe_ggufs_bos_is_added_as_llama_cpp_adds_it(tmp_path, cache, add_bos, bos):
    """tokenizer.ggml.add_bos_token read as llama.cpp reads it (a BPE vocabulary without the
    key adds none); the template and the special tokens come along."""
    extra = {} if add_bos is None else {"tokenizer.ggml.add_bos_token": ("add_bool", add_bos)}
    _gguf(path := tmp_path / "m.gguf", tiny_hf_model("llama"), "llama", **extra)
    for t in (load_target(path), load_target(path)):  # converted, then from the cache
        tok = t.tokenizer
        assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
        assert tok("ab")["input_ids"] == ([0] if bos else []) + [97]
        assert t.chat_ids([{"role": "user", "content": "ab"}]) == [97]  # the template's own


# --- the conversion cache ------------------------------------------------------------------

def test_a_rewritten_gguf_is_converted_again(tmp_path, cache):
    path = tmp_path / "m.gguf"
    _gguf_from_hf(path, tiny_hf_model("llama", seed=0), "llama")
    first = load_target(path)
    st = path.stat()
    _gguf_from_hf(path, (hf := tiny_hf_model("llama", seed=1)), "llama")  # the same size
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    again = load_target(path)
    assert again.folder != first.folder and again.fingerprint != first.fingerprint
    _logits_match_hf(again, hf)


_LOAD = ("import sys; from draftsmith.targets import load_target; "
         "print(load_target(sys.argv[1]).fingerprint)")


def test_two_processes_converting_one_gguf_at_once_leave_one_whole_entry(tmp_path, cache):
    _gguf_from_hf(path := tmp_path / "m.gguf", (hf := tiny_hf_model("llama")), "llama")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD, str(path)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    t = load_target(path)
    assert {o.strip() for o, _ in outs} == {t.fingerprint}
    assert [p.name for p in (cache / "targets").iterdir()] == [t.folder.name]  # no scratch
    _logits_match_hf(t, hf)


# --- the default ---------------------------------------------------------------------------

def test_default_gguf_names_the_variable_pointing_at_a_missing_file(tmp_path, cache,
                                                                    monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(DraftsmithError, match=r"absent.gguf: GGUF file not found "
                                              r"\(DRAFTSMITH_DEFAULT_GGUF names it"):
        load_target("default")


def test_default_gguf_reads_a_home_relative_path(tmp_path, cache, monkeypatch):
    """`DRAFTSMITH_DEFAULT_GGUF="~/m.gguf"` (quoted, so no shell expanded it)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _gguf_from_hf(tmp_path / "m.gguf", (hf := tiny_hf_model("llama")), "llama")
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_GGUF", "~/m.gguf")
    t = load_target("default")
    assert t.kind == "default"
    _logits_match_hf(t, hf)


def test_a_conversion_that_dropped_llama_attention_biases_is_converted_again(tmp_path, cache,
                                                                              capsys):
    """An entry converted (under the same CONVERTER) before the biases were read: config.json
    without attention_bias beside stored q/k biases."""
    import json

    hf = tiny_hf_model("llama", attention_bias=True)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    first = load_target(path)
    cfg = json.loads((first.folder / "config.json").read_text())
    del cfg["attention_bias"]
    (first.folder / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    again = load_target(path)
    assert "converting" in capsys.readouterr().err and again.cfg.attention_bias
    _logits_match_hf(again, hf)
    load_target(path)
    assert "converting" not in capsys.readouterr().err
