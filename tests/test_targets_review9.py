"""Review 9 of target loading, as a user pointing draftsmith at real checkpoints: configs written
as the hub's are (transformers 4's `rope_scaling` and top-level `rope_theta`, a Qwen2.5 window
present but off, Qwen3 without head_dim), sharded folders, generation_config.json's eos ids and a
template that needs `add_generation_prompt`, each against HF transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import CHARS

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _hub_style(folder, edit: dict, drop: tuple[str, ...] = ()) -> None:
    """config.json rewritten as transformers 4 wrote the hub's checkpoints: `rope_scaling` and a
    top-level `rope_theta`, `torch_dtype`, no `layer_types`; then `edit` over it."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg.pop("layer_types", None)
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg.update(edit)
    for key in drop:
        cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))


def _same_as_hf(folder, seq: int = 40) -> None:
    """Every layer's input, the final hidden state and the logits equal HF's to fp32 tolerance,
    over more tokens than any window below."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    ours = load_target(folder).build(torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (2, seq))
    layers = hf.config.num_hidden_layers
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, torch.arange(seq).expand(2, seq), aux_ids=tuple(range(-1, layers - 1)))
    for i in range(layers):
        assert torch.allclose(out.aux[:, :, i], ref.hidden_states[i], atol=1e-5), f"layer {i}"
    assert torch.allclose(out.hidden, ref.hidden_states[-1], atol=1e-5)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)


CASES = {  # name: (arch, model overrides, config.json edits, keys dropped, what draftsmith reads)
    "llama3_untied": ("llama", {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "head_dim": 32},
                      {}, (), {"head_dim": 32, "rope_theta": 5e5, "sliding_window": None}),
    "llama3_tied": ("llama", {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "head_dim": 8,
                              "tie_word_embeddings": True},
                    {}, (), {"head_dim": 8, "tie_word_embeddings": True}),
    "qwen25_window_off": ("qwen2", {"tie_word_embeddings": True},
                          {"sliding_window": 8, "use_sliding_window": False,
                           "max_window_layers": 2, "rope_theta": 1e6},
                          (), {"sliding_window": None, "attention_bias": True}),
    "qwen25_window_on": ("qwen2", {}, {"sliding_window": 8, "use_sliding_window": True,
                                       "max_window_layers": 2},
                         (), {"sliding_window": 8, "window_layers": [2, 3, 4, 5]}),
    "qwen3_default_head_dim": ("qwen3", {"head_dim": 128},
                               {"sliding_window": 8, "use_sliding_window": False},
                               ("head_dim",), {"head_dim": 128, "qk_norm": True,
                                               "sliding_window": None}),
    "mistral_no_window": ("mistral", {}, {"sliding_window": None}, (), {"sliding_window": None}),
    "mistral_window": ("mistral", {}, {"sliding_window": 8}, (), {"sliding_window": 8}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hub_style_configs_load_as_hf_reads_them(tmp_path, name):
    arch, over, edit, drop, want = CASES[name]
    folder = write_tiny_folder(tmp_path / name, arch, **over)
    _hub_style(folder, edit, drop)
    cfg = load_target(folder).cfg
    assert {k: getattr(cfg, k) for k in want} == want
    _same_as_hf(folder)


def test_a_bf16_checkpoint_sharded_over_an_index_loads_whole_and_fingerprints_stably(tmp_path):
    """A bf16 Qwen2.5-like checkpoint in 11 shards: the weights stay bf16, a float32 build equals
    HF's float32 load, and the fingerprint is that of the same model in one file."""
    model = tiny_hf_model("qwen2", tie_word_embeddings=True).to(torch.bfloat16)
    whole = write_tiny_folder(tmp_path / "whole", "qwen2", tie_word_embeddings=True)
    model.save_pretrained(whole)
    shutil.copytree(whole, sharded := tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    model.save_pretrained(sharded, max_shard_size="50KB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 3
    assert json.loads((sharded / "config.json").read_text())["dtype"] == "bfloat16"
    t = load_target(sharded)
    assert {w.dtype for w in t.weights.values()} == {torch.bfloat16}
    assert t.fingerprint == load_target(sharded).fingerprint == load_target(whole).fingerprint
    _same_as_hf(sharded)


def test_the_fingerprint_changes_with_a_weight(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    before = load_target(folder).fingerprint
    w = load_file(folder / "model.safetensors")
    w["model.layers.3.mlp.down_proj.weight"] = w["model.layers.3.mlp.down_proj.weight"] * 1.001
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    assert load_target(folder).fingerprint != before


def test_a_shard_its_index_names_missing_is_one_line_naming_it_and_the_fix(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    tiny_hf_model("llama").save_pretrained(folder, max_shard_size="50KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(DraftsmithError) as e:
        load_target(folder)
    assert "\n" not in str(e.value) and shard.name in str(e.value)
    assert "download" in str(e.value)


def test_an_unindexed_shard_set_lacking_one_names_the_missing_shard(tmp_path):
    """Without its index, a set of shards missing one was refused as files of unknown models
    (`keep its files only, or add its index`), not named as the shard that is missing."""
    folder = write_tiny_folder(tmp_path / "t", "llama")
    tiny_hf_model("llama").save_pretrained(folder, max_shard_size="50KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    (folder / "model.safetensors.index.json").unlink()
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[2].unlink()
    with pytest.raises(DraftsmithError, match="saying which hold the model") as e:
        load_target(folder)
    assert "\n" not in str(e.value) and shards[2].name in str(e.value)
    assert shards[0].name not in str(e.value) and "download" in str(e.value)


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<unk>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}")


def _llama3_folder(folder):
    """A Llama-3-like folder: <|begin_of_text|> written by the template, <|eot_id|> the
    tokenizer's eos, config.json's <|end_of_text|>, and generation_config.json's three ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tiny_hf_model("llama", vocab_size=len(vocab), bos_token_id=0, eos_token_id=1,
                  tie_word_embeddings=True).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token="<|eot_id|>", unk_token="<unk>",
                                   additional_special_tokens=SPECIALS[2:6])
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, 5, 4], "do_sample": True}))
    return folder


def test_a_llama3_tokenizer_renders_and_stops_as_hf(tmp_path):
    from transformers import AutoTokenizer

    folder = _llama3_folder(tmp_path / "l3")
    t, hf = load_target(folder), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi there"}]
    for prompt in (True, False):
        ref = hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert t.chat_ids(chat, prompt) == list(ref)
    assert t.chat_ids(chat)[-2:] == hf.encode("\n\n", add_special_tokens=False)
    assert t.chat_ids(chat).count(0) == 1  # one <|begin_of_text|>, the template's
    assert t.generation_eos == [1, 4, 5] and t.eos_ids == [1, 4, 5]
