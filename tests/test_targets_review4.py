"""Targets and runtime, review 4: Runtime's kept positions checked, llama.cpp's end-of-generation
tokens by text, GGUF conversion tensor by tensor in each tensor's own dtype."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder
from test_speculative import tiny_target
from test_targets import gguf_writer

from draftsmith.engine.runtime import Runtime
from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target


@pytest.mark.parametrize("kept", [0, -3, 65, 2.5, True, "8"])
def test_runtime_kept_outside_one_to_max_seq_is_one_error(kept):
    """kept 0 or -3 passed silently (a windowed target's check then saw no position), "8" was a
    TypeError from min(), 65 was cut to max_seq without a word."""
    with pytest.raises(DraftsmithError, match=r"^Runtime: kept must be a whole number from 1 to "
                                              r"max_seq 64, got "):
        Runtime(tiny_target(), 1, 64, kept=kept)
    assert Runtime(tiny_target(), 1, 64, kept=np.int64(64)).kept == 64


# a gpt2-style vocabulary: specials, then printable characters
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_turn>", "<reponame>",
            "<|file_sep|>", "<tool>"]
NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj":
         "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "model.embed_tokens":
         "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf(path, hf, meta: dict | None = None, kinds: dict | None = None) -> dict[str, np.ndarray]:
    """A tiny Qwen2 as llama.cpp writes one (no q/k permutation for qwen2), with ChatML-style
    specials; `kinds`: GGUF tensor name -> "f16", "bf16" or "q8_0" (others F32). Returns the values
    each tensor holds, as float32."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c, "qwen2")
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    chars = [chr(x) for x in range(32, 127)]
    merges = [f"a {b}" for b in "abcdefghijklmnopqrstuvwxyz"][: c.vocab_size - 102]
    tokens = SPECIALS + chars + [m.replace(" ", "") for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for key, (adder, value) in (meta or {}).items():
        getattr(w, adder)(key, value)
    values = {}
    for name, t in hf.state_dict().items():
        base, kind = name.rsplit(".", 1)
        m = re.match(r"model\.layers\.(\d+)\.(.+)", base)
        gg = f"blk.{m[1]}.{NAMES[m[2]]}.{kind}" if m else f"{NAMES[base]}.{kind}"
        arr = np.ascontiguousarray(t.detach().float().numpy())
        how = (kinds or {}).get(gg)
        if how == "f16":
            arr = arr.astype(np.float16)
            w.add_tensor(gg, arr)
        elif how in ("q8_0", "bf16"):
            kind = getattr(gguf.GGMLQuantizationType, how.upper())
            q = gguf.quants.quantize(arr, kind)
            w.add_tensor(gg, q, raw_dtype=kind)
            arr = gguf.quants.dequantize(q, kind)
        else:
            w.add_tensor(gg, arr)
        values[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_end_of_turn_tokens_by_their_text_are_stop_ids(tmp_path, cache):
    """llama.cpp ends generation at <|im_end|>, <end_of_turn>, <|endoftext|> by their text, and at
    the FIM repo/file-separator tokens, where the metadata names no eot id: draftsmith stopped at
    the EOS alone and ran past the end of every turn."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=2)
    _gguf(path := tmp_path / "m.gguf", hf)
    first, again = load_target(path), load_target(path)  # converted, then from the cache
    assert first.eos_ids == again.eos_ids == [0, 2, 3, 4, 5]  # not <|im_start|> nor <tool>
    assert first.fingerprint == again.fingerprint


def test_a_named_fim_token_replaces_the_one_found_by_text(tmp_path, cache):
    hf = tiny_hf_model("qwen2", num_hidden_layers=2)
    _gguf(path := tmp_path / "m.gguf", hf,
          {"tokenizer.ggml.fim_rep_token_id": ("add_uint32", 6),
           "tokenizer.ggml.eot_token_id": ("add_uint32", 2)})
    assert load_target(path).eos_ids == [0, 2, 3, 5, 6]


def test_an_hf_folders_special_end_of_turn_token_is_a_stop_id(tmp_path):
    """A chat fine-tune whose config.json names <|endoftext|> and whose generation_config.json is
    missing: its special <|eot_id|> ends generation, as llama.cpp's reading of it would."""
    from transformers import AutoTokenizer

    folder = write_tiny_folder(tmp_path / "t", "llama")
    assert load_target(folder).eos_ids == [2, 4]  # config.json's </s>, the tokenizer's <|im_end|>
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|im_start|>"]})
    tok.add_tokens(["<|end|>"])  # not special: ordinary text to this tokenizer
    tok.save_pretrained(folder)
    assert load_target(folder).eos_ids == [2, 4, tok.convert_tokens_to_ids("<|eot_id|>")]


def test_gguf_tensors_keep_their_dtype_and_values(tmp_path, cache):
    """An F16 GGUF was converted to float32 whole in memory (an 8B one: 32 GB, and as much on
    disk); each tensor now keeps the file's float type, a quantized one dequantized exactly."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=2)
    kinds = {"blk.0.attn_q.weight": "f16", "blk.1.ffn_up.weight": "f16",
             "token_embd.weight": "f16", "blk.0.ffn_down.weight": "q8_0",
             "blk.1.attn_v.weight": "bf16"}
    values = _gguf(path := tmp_path / "m.gguf", hf, kinds=kinds)
    t = load_target(path)
    w = t.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16
    assert w["model.embed_tokens.weight"].dtype == torch.float16
    assert w["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert w["model.layers.1.self_attn.v_proj.weight"].dtype == torch.bfloat16
    assert w["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32
    for name, want in values.items():
        assert torch.equal(w[name].float(), torch.from_numpy(np.asarray(want, np.float32))), name
    with torch.no_grad():  # the mixed dtypes build as one dtype
        model = t.build(torch.float32)
        ids = torch.randint(0, 128, (1, 12))
        assert torch.isfinite(model(ids, torch.arange(12)[None]).logits).all()


def test_gguf_conversion_writes_shards_one_at_a_time(tmp_path, cache, monkeypatch):
    """The conversion held every dequantized tensor, then safetensors' copy of them all: twice
    the fp32 model in memory. Past SHARD_BYTES it writes HF's shards and their index, holding
    one shard's tensors at a time; the target is the same."""
    import safetensors.torch as st

    import draftsmith.targets as targets

    hf = tiny_hf_model("qwen2", num_hidden_layers=2)
    _gguf(path := tmp_path / "m.gguf", hf)
    whole = load_target(path)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(targets, "SHARD_BYTES", 40_000)
    real, held = st.save_file, []

    def save_file(tensors, *a, **kw):
        held.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return real(tensors, *a, **kw)

    monkeypatch.setattr(st, "save_file", save_file)
    parts = load_target(path)
    largest = max(v.numel() * v.element_size() for v in whole.weights.values())
    assert len(held) > 3 and max(held) < 40_000 + largest
    files = sorted(p.name for p in parts.folder.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{len(held):05d}.safetensors"
                     for i in range(1, len(held) + 1)]
    assert parts.fingerprint == whole.fingerprint
    assert parts.weights.keys() == whole.weights.keys()
    assert all(torch.equal(parts.weights[k], whole.weights[k]) for k in whole.weights)


def test_a_converted_gguf_is_readable_by_other_users(tmp_path, cache):
    """The cache folder is made 0755 for other users, but safetensors wrote the weights 0600:
    another user's load found the entry, could not read it, and failed converting it again."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=2)
    _gguf(path := tmp_path / "m.gguf", hf)
    folder = load_target(path).folder
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes and all(m == 0o644 for m in modes.values()), modes


def _windowed_qwen2(tmp_path, **over):
    """A tiny Qwen2 windowing layers 3-5 of 6 over 8 tokens (max_window_layers 3), as a folder."""
    fields = dict(use_sliding_window=True, sliding_window=8, max_window_layers=3) | over
    return write_tiny_folder(tmp_path / "q", "qwen2", **fields)


@pytest.mark.parametrize("over", [{}, {"layer_types": ["sliding_attention", "full_attention"] * 3}])
def test_a_qwen2_windowing_some_layers_matches_hf(tmp_path, over):
    """A window on some layers only (max_window_layers, layer_types) was refused at load. Each
    layer now attends under its own mask: HF's logits, uncached and through the KV cache, past
    the window."""
    import transformers as tf

    from draftsmith.models.llama import KVCache

    folder = _windowed_qwen2(tmp_path, **over)
    t = load_target(folder)
    assert t.cfg.sliding_window == 8
    assert t.cfg.window_layers == ([3, 4, 5] if not over else [0, 2, 4])
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    seq = 30
    torch.manual_seed(3)
    ids = torch.randint(5, 100, (1, seq))
    model = t.build(torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits
        plain = model(ids, torch.arange(seq)[None]).logits
        shape = (1, t.cfg.num_kv_heads, 40, t.cfg.head_dim)
        caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(6)]
        pos = torch.arange(seq)[None]
        first = model(ids[:, :20], pos[:, :20], caches).logits
        rest = [model(ids[:, i:i + 1], pos[:, i:i + 1], caches).logits for i in range(20, seq)]
        cached = torch.cat([first, *rest], dim=1)
    assert (plain - ref).abs().max() < 1e-4
    assert (cached - ref).abs().max() < 1e-4
    everywhere = dict(t.hf_config, max_window_layers=0)
    everywhere.pop("layer_types", None)
    from draftsmith.models.config import ModelConfig

    assert ModelConfig.from_hf(everywhere).window_layers is None  # all windowed: as before
    assert "window_layers" not in ModelConfig.from_hf(everywhere).to_dict()


def test_a_masked_forward_past_a_partial_window_is_refused(tmp_path):
    """A caller's own mask (online training's) serves every layer: past the window it would
    window the full-attention layers too, so it is refused; within the window it is exact."""
    from draftsmith.train.ttt import doc_causal_mask

    t = load_target(_windowed_qwen2(tmp_path))
    model = t.build(torch.float32)
    ids = torch.randint(5, 100, (1, 12))
    with pytest.raises(DraftsmithError, match="windows 3 of its 6 layers over 8 tokens"):
        model(ids, torch.arange(12)[None], mask=doc_causal_mask(torch.zeros(1, 12), 8))
    short = ids[:, :8]
    with torch.no_grad():
        masked = model(short, torch.arange(8)[None], mask=doc_causal_mask(torch.zeros(1, 8), 8))
        assert torch.allclose(masked.logits, model(short, torch.arange(8)[None]).logits,
                              atol=1e-5)


def test_a_prompt_longer_than_the_runtime_is_one_error():
    """It wrote K/V past the cache: an IndexError on the CPU, a device-side assert on a GPU."""
    rt = Runtime(tiny_target(), 1, 16)
    with pytest.raises(DraftsmithError, match="a prompt of 20 tokens exceeds the runtime's "
                                              "max_seq 16"):
        rt.prompt(torch.randint(0, 100, (1, 20)), torch.tensor([20]))
    assert rt.prompt(torch.randint(0, 100, (1, 16)), torch.tensor([16])).logits.shape == (1, 1, 128)
