"""Loading targets as users point --target at them: HF folders' and GGUF files' corners, and our
decoder's parity with transformers on configs the family tests leave out."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.targets import load_target


def _edit(path, **fields) -> None:
    d = json.loads(path.read_text()) if path.is_file() else {}
    d.update(fields)
    path.write_text(json.dumps(d))


def _max_diff(folder, seq: int = 40, dtype: torch.dtype = torch.float32) -> float:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                 dtype=dtype).eval()
    ours = load_target(folder).build(dtype)
    torch.manual_seed(3)
    ids = torch.randint(5, 100, (1, seq))
    with torch.no_grad():
        return (ours(ids, torch.arange(seq)[None]).logits.float()
                - hf(ids).logits.float()).abs().max().item()


def _gguf(path, hf, gguf_arch: str, name: str = "tiny", **extra) -> None:
    """test_targets' llama.cpp-style writer, with extra metadata (key: (adder, value))."""
    import gguf
    from test_targets import _gguf_from_hf

    orig = gguf.GGUFWriter.add_chat_template

    def add_chat_template(self, template):
        orig(self, template)
        for key, (adder, value) in extra.items():
            getattr(self, adder)(key, value)

    gguf.GGUFWriter.add_chat_template = add_chat_template
    try:
        _gguf_from_hf(path, hf, gguf_arch, name)
    finally:
        gguf.GGUFWriter.add_chat_template = orig


def test_generation_config_eos_ids_end_generation_as_hf_generate_does(tmp_path):
    """Llama 3 Instruct lists <|eot_id|> in generation_config.json only: HF's generate stops at
    it, draftsmith's engines ran past the end of the turn."""
    from transformers import GenerationConfig

    folder = write_tiny_folder(tmp_path / "t", "llama")
    _edit(folder / "generation_config.json", eos_token_id=[2, 5])
    t = load_target(folder)
    assert set(GenerationConfig.from_pretrained(folder).eos_token_id) <= set(t.eos_ids)
    assert t.eos_ids == [2, 4, 5]  # config.json's, the tokenizer's <|im_end|>, the listed
    _edit(folder / "generation_config.json", eos_token_id="</s>")
    with pytest.raises(DraftsmithError, match="generation_config.json: eos_token_id is '</s>'"):
        load_target(folder)


def test_gguf_end_of_turn_ids_are_eos_also_from_the_cache(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    _gguf(path := tmp_path / "m.gguf", tiny_hf_model("llama"), "llama",
          **{"tokenizer.ggml.eot_token_id": ("add_uint32", 7),
             "tokenizer.ggml.eom_token_id": ("add_uint32", 9)})
    assert gguf.GGUFReader(path).get_field("tokenizer.ggml.eot_token_id") is not None
    first, again = load_target(path), load_target(path)
    assert {7, 9} <= set(first.eos_ids) and first.eos_ids == again.eos_ids
    assert again.fingerprint == first.fingerprint


def test_a_mistral_gguf_is_not_windowed_at_transformers_default(tmp_path, monkeypatch):
    """llama.cpp runs a Mistral GGUF (architecture llama) without a sliding window; transformers'
    GGUF reader gave it MistralConfig's default of 4096, so the engine refused caches past it."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("mistral")
    _gguf(path := tmp_path / "m.gguf", hf, "llama", "mistral")
    assert load_target(path).cfg.sliding_window is None
    _gguf(path := tmp_path / "w.gguf", hf, "llama", "mistral",
          **{"llama.attention.sliding_window": ("add_uint32", 8)})
    t = load_target(path)
    assert t.cfg.arch == "mistral" and t.cfg.sliding_window == 8


def test_one_file_of_a_split_gguf_is_refused_naming_the_merge(tmp_path, monkeypatch):
    """It held a few layers: the load went through and the first build failed on a missing
    layer, a partial model left in the cache."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    _gguf(path := tmp_path / "m-00001-of-00002.gguf", tiny_hf_model("llama"), "llama",
          **{"split.count": ("add_uint16", 2), "split.no": ("add_uint16", 0)})
    with pytest.raises(DraftsmithError, match="one file of a GGUF split in 2; merge them"):
        load_target(path)
    assert not list((tmp_path / "cache").glob("targets/*"))


def test_a_gguf_without_a_chat_template_is_named_when_prompted(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, t: None)
    from test_targets import _gguf_from_hf

    _gguf_from_hf(path := tmp_path / "base.gguf", tiny_hf_model("llama"), "llama")
    t = load_target(path)
    with pytest.raises(DraftsmithError, match="base.gguf: the tokenizer has no chat template"):
        t.chat_ids([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
     "rope_theta": 10000.0},
])
def test_rope_scaling_draftsmith_does_not_apply_is_refused_at_load(tmp_path, rope):
    """`targets show` passed and the first build (after data work) failed."""
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _edit(folder / "config.json", rope_parameters=rope)
    with pytest.raises(DraftsmithError, match=f"unsupported rope scaling '{rope['rope_type']}'"):
        load_target(folder)


@pytest.mark.parametrize(("arch", "drop", "field"), [
    ("qwen3", "head_dim", "head_dim"),  # Qwen3Config: 128, not hidden / heads
    ("mistral", "sliding_window", "sliding_window"),  # MistralConfig: 4096
])
def test_a_field_config_json_leaves_out_takes_hfs_default(tmp_path, arch, drop, field):
    from transformers import AutoConfig

    folder = write_tiny_folder(tmp_path / arch, arch)
    d = json.loads((folder / "config.json").read_text())
    d.pop(drop)
    (folder / "config.json").write_text(json.dumps(d))
    hf = AutoConfig.from_pretrained(folder)
    ours = ModelConfig.from_hf(d)
    assert getattr(ours, field) == getattr(hf, field) is not None


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {"head_dim": 32}),  # head_dim * heads != hidden
    ("mistral", {"head_dim": 32}),
    ("qwen2", {"head_dim": 8}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_head_dims_and_ties_the_family_tests_leave_out_match_hf(tmp_path, arch, over):
    assert _max_diff(write_tiny_folder(tmp_path / arch, arch, **over)) < 1e-4


@pytest.mark.parametrize("rope", [
    {"type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_a_transformers_4_rope_scaling_config_matches_hf(tmp_path, rope):
    """config.json as most hub checkpoints hold it: rope_scaling beside a top-level rope_theta."""
    folder = write_tiny_folder(tmp_path / "t", "llama", max_position_embeddings=4096)
    d = json.loads((folder / "config.json").read_text())
    d.pop("rope_parameters")
    d.update(rope_scaling=rope, rope_theta=500000.0)
    (folder / "config.json").write_text(json.dumps(d))
    assert load_target(folder).cfg.rope_theta == 500000.0
    assert _max_diff(folder, seq=200) < 1e-4


def test_a_bf16_checkpoint_builds_as_fp32_and_as_bf16_like_hf(tmp_path):
    from draftsmith.targets.tokenizer import write_byte_tokenizer

    tiny_hf_model("qwen2").to(torch.bfloat16).save_pretrained(folder := tmp_path / "bf16")
    write_byte_tokenizer(folder, 128)
    assert load_target(folder).weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert _max_diff(folder) < 1e-4
    assert _max_diff(folder, dtype=torch.bfloat16) < 0.05
