"""Export to SGLang and speculators, import back, and the real `speculators` package's verdict."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from safetensors.torch import load_file, save_file
from test_drafter import random_drafter
from test_train_helpers import AUX

from draftsmith.errors import DraftsmithError
from draftsmith.export import detect_format, export_drafter, import_drafter, read_any
from draftsmith.layers import Convention, from_convention, to_convention
from draftsmith.models.eagle3 import Eagle3Config, load_drafter, save_drafter
from draftsmith.targets import cache_dir
from draftsmith.train.ttt import shift_left, unroll

L = 6  # layers of the tiny target


def make(target, folder: Path, **over) -> Path:
    """A random drafter for the tiny target, saved in the draftsmith layout."""
    aux = over.pop("aux", AUX)
    base = dict(target_fingerprint=target.fingerprint, target_source=str(target.folder),
                target_architectures=["LlamaForCausalLM"], max_position_embeddings=64)
    base.update(over)
    cfg = Eagle3Config.for_target(target.cfg, 40, aux, **base)
    d = random_drafter(cfg)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.weights["model.embed_tokens.weight"])
    return save_drafter(d, folder, training={"steps": 0})


# SGLang's LlamaForCausalLMEagle3 parameters and its load_weights name rules
# (python/sglang/srt/models/llama_eagle3.py).
SGLANG_PARAMS = {
    "model.embed_tokens.weight", "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight", "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight", "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight", "model.midlayer.post_attention_layernorm.weight",
    "model.norm.weight", "lm_head.weight",
}
STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
           (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def sglang_loaded(names: list[str]) -> set[str]:
    loaded = set()
    for name in names:
        if "d2t" in name or "t2d" in name:
            continue
        for param, shard in STACKED:
            if shard in name:
                name = name.replace(shard, param)
                break
        key = name if name in SGLANG_PARAMS else f"model.{name}"
        assert key in SGLANG_PARAMS, f"SGLang would silently drop {name}"
        loaded.add(key)
    return loaded


def test_sglang_export_layout_ids_and_round_trip(target, tmp_path):
    src = make(target, tmp_path / "d")
    out = export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["vocab_size"] == 128 and c["draft_vocab_size"] == 40
    assert c["target_hidden_size"] == 64 and c["tie_word_embeddings"] is False
    assert c["max_position_embeddings"] == 512  # the target's, not the drafter's 64
    assert c["eagle_config"]["use_aux_hidden_state"] is True
    nested = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert nested == to_convention(AUX, "sglang", L)
    assert from_convention(nested, Convention.SGLANG, L) == AUX
    assert from_convention(c["eagle_aux_hidden_state_layer_ids"], Convention.VLLM, L) == AUX
    w = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in w and w["d2t"].dtype == torch.int64
    assert w["t2d"].dtype == torch.bool
    assert sglang_loaded(list(w)) == SGLANG_PARAMS - {"model.embed_tokens.weight"}

    assert detect_format(out) == "sglang"
    back = read_any(out, target=str(target.folder))
    orig = load_drafter(src)
    assert back.cfg.aux_layer_ids == AUX and back.cfg.draft_vocab_size == 40
    for k, v in orig.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    imported = import_drafter(out, tmp_path / "imp", target=str(target.folder))
    assert torch.equal(load_drafter(imported).fc.weight, orig.fc.weight)


def test_speculators_export_round_trip_and_ids(target, tmp_path):
    ids = [0, 3, 4]
    src = make(target, tmp_path / "d", aux=ids, norm_before_residual=True, num_layers=2)
    out = export_drafter(src, "speculators", tmp_path / "sp", target=str(target.folder),
                         speculative_tokens=5)
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["eagle_aux_hidden_state_layer_ids"] == to_convention(ids, "vllm", L) == [1, 4, 5]
    assert from_convention(c["eagle_aux_hidden_state_layer_ids"], "speculators", L) == ids
    assert c["norm_before_residual"] is True and c["draft_vocab_size"] == 40
    layer = c["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 2 and layer["max_position_embeddings"] == 512
    sc = c["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["default_proposal_method"] == "greedy"
    assert sc["verifier"] == {"name_or_path": str(target.folder),
                              "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(out / "model.safetensors"))
    assert {"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "d2t", "t2d",
            "layers.0.hidden_norm.weight", "layers.1.input_layernorm.weight"} <= names
    assert not [n for n in names if n.startswith("midlayer.")]
    back = read_any(out)  # layer count from the verifier folder, embedding from the file
    orig = load_drafter(src)
    assert back.cfg.aux_layer_ids == ids and back.cfg.num_layers == 2
    assert back.cfg.norm_before_residual
    for k, v in orig.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    bf16 = export_drafter(src, "speculators", tmp_path / "bf", dtype=torch.bfloat16)
    assert load_file(bf16 / "model.safetensors")["fc.weight"].dtype == torch.bfloat16


def engine_values(d, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """The tensors each engine's loader expects, cut from the drafter's fused ones by hand:
    q/k/v the qkv rows in that order, gate/up the gate_up rows in that order."""
    c = d.cfg
    nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"fc.weight": d.fc.weight, "norm.weight": d.norm.weight,
            "lm_head.weight": d.lm_head.weight}
    for pre, layer in zip(prefixes, d.layers, strict=True):
        qkv, gate_up = layer.self_attn.qkv.weight, layer.mlp.gate_up.weight
        inter = c.intermediate_size
        want |= {f"{pre}self_attn.q_proj.weight": qkv[:nq],
                 f"{pre}self_attn.k_proj.weight": qkv[nq:nq + nk],
                 f"{pre}self_attn.v_proj.weight": qkv[nq + nk:],
                 f"{pre}self_attn.o_proj.weight": layer.self_attn.o.weight,
                 f"{pre}mlp.gate_proj.weight": gate_up[:inter],
                 f"{pre}mlp.up_proj.weight": gate_up[inter:],
                 f"{pre}mlp.down_proj.weight": layer.mlp.down.weight,
                 f"{pre}input_layernorm.weight": layer.input_layernorm.weight,
                 f"{pre}post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    want[f"{prefixes[0]}hidden_norm.weight"] = d.midlayer.hidden_norm.weight
    return want


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_exported_values_are_what_the_engines_read(target, tmp_path, fmt):
    """A round trip cannot see a name swapped both ways (k for v, up for gate): the exported
    tensors are checked against the drafter's own, and d2t by SGLang's hot-token rule."""
    layers = 1 if fmt == "sglang" else 2
    src = make(target, tmp_path / "d", num_layers=layers)
    d = load_drafter(src)
    out = export_drafter(src, fmt, tmp_path / fmt, target=str(target.folder))
    w = load_file(out / "model.safetensors")
    prefixes = ["midlayer."] if fmt == "sglang" else ["layers.0.", "layers.1."]
    for name, v in engine_values(d, prefixes).items():
        assert torch.equal(w[name], v), name
    hot = w["d2t"] + torch.arange(w["d2t"].numel())  # SGLang's hot_token_id
    used = torch.nonzero(d.t2d).flatten()
    assert used.numel() == 40 and torch.equal(hot, used)
    assert torch.equal(hot, d.to_target(torch.arange(40)))
    assert torch.equal(w["t2d"], d.t2d)


def test_export_refusals(target, tmp_path):
    with pytest.raises(DraftsmithError, match="norm_before_residual"):
        export_drafter(make(target, tmp_path / "b", norm_before_residual=True), "sglang",
                       tmp_path / "x")
    src = make(target, tmp_path / "c")
    with pytest.raises(DraftsmithError, match="unknown export format"):
        export_drafter(src, "onnx", tmp_path / "x")
    export_drafter(src, "sglang", tmp_path / "y")
    with pytest.raises(DraftsmithError, match="--overwrite"):
        export_drafter(src, "sglang", tmp_path / "y")


@pytest.mark.parametrize("aux", [[0, 2, 4], [2, 3, 4], [1, 2, 4]])
def test_sglang_gets_the_canonical_ids_whatever_the_first(target, tmp_path, aux):
    """SGLang's Llama/Qwen classes add 1 to every explicit id on every version, so the outputs
    of layers `aux` are written as `aux`: [2, 3, 4] went out as [3, 4, 5] (read one layer
    late) under a warning, and [0, 2, 4] was refused."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_drafter(make(target, tmp_path / "e", aux=aux), "sglang", tmp_path / "z")
    assert not [w for w in caught if "aux" in str(w.message)]
    c = json.loads((out / "config.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]  # vLLM's: inputs


def test_export_refuses_ids_the_engines_would_feed_otherwise(target, tmp_path):
    """SGLang cannot capture the last layer's output (or the embedding's); both engines feed
    captured states in ascending layer order, which an fc trained on [3, 1, 4] does not read."""
    last = make(target, tmp_path / "last", aux=[1, 3, L - 1])
    with pytest.raises(DraftsmithError, match="last layer output"):
        export_drafter(last, "sglang", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    export_drafter(last, "speculators", tmp_path / "ok")  # vLLM captures it
    shuffled = make(target, tmp_path / "shuffled", aux=[3, 1, 4])
    for fmt in ("sglang", "speculators"):
        with pytest.raises(DraftsmithError, match=r"\[3, 1, 4\] are not ascending"):
            export_drafter(shuffled, fmt, tmp_path / f"y_{fmt}")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_refuses_an_out_that_is_or_nests_its_drafter(target, tmp_path):
    """--overwrite replaces --out whole: never when --out is the drafter (with its run's
    checkpoints and log), lies in it or holds it, nor when it is the --target."""
    src = make(target, tmp_path / "run")
    make(target, src / "checkpoints" / "step-00000001")
    (src / "train_log.jsonl").write_text('{"step": 1}\n')
    before = snapshot(src)
    for out, said in ((src, "is the drafter folder itself"), (src / "x", "lies inside"),
                      (tmp_path, "holds the drafter folder")):
        with pytest.raises(DraftsmithError, match=said):
            export_drafter(src, "speculators", out, overwrite=True)
    with pytest.raises(DraftsmithError, match="holds the drafter folder"):
        export_drafter(src / "checkpoints" / "step-00000001", "sglang", src, overwrite=True)
    assert snapshot(src) == before
    folder = shutil.copytree(target.folder, tmp_path / "t")
    with pytest.raises(DraftsmithError, match="is the --target itself"):
        export_drafter(src, "sglang", folder, target=str(folder), overwrite=True)
    assert snapshot(folder) == snapshot(Path(target.folder))


def test_export_and_import_refuse_a_file_as_out(target, tmp_path):
    src = make(target, tmp_path / "d")
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
            export_drafter(src, "speculators", keep, overwrite=overwrite)
    sp = export_drafter(src, "speculators", tmp_path / "sp")
    with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
        import_drafter(sp, keep)
    with pytest.raises(DraftsmithError, match="lies under the file"):
        import_drafter(sp, keep / "sub")
    assert keep.read_text() == "mine"


def test_import_refuses_a_non_empty_out_or_its_own_source(target, tmp_path):
    """A target's folder (or any non-empty one) is not overwritten with drafter weights, and
    an engine folder is not rewritten in place."""
    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    folder = shutil.copytree(target.folder, tmp_path / "t")
    for out in (folder, sp):
        before = snapshot(out)
        with pytest.raises(DraftsmithError, match="not empty; pass --overwrite to replace a "
                           "drafter there, or choose another --out"):
            import_drafter(sp, out)
        with pytest.raises(DraftsmithError, match="not a draftsmith drafter folder"):
            import_drafter(sp, out, overwrite=True)
        assert snapshot(out) == before
    with pytest.raises(DraftsmithError, match="lies inside the source folder"):
        import_drafter(sp, sp / "sub")
    assert not (sp / "sub").exists()
    (tmp_path / "empty").mkdir()
    assert load_drafter(import_drafter(sp, tmp_path / "empty")).cfg.aux_layer_ids == AUX


def test_import_overwrite_replaces_a_drafter(target, tmp_path):
    """--overwrite replaces the drafter an earlier import (or training) left in --out."""
    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    stale = load_drafter(make(target, tmp_path / "old"))
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(1.0)
    save_drafter(stale, tmp_path / "imp")
    import_drafter(sp, tmp_path / "imp", overwrite=True)
    got, want = load_drafter(tmp_path / "imp"), read_any(sp)
    for (k, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    (tmp_path / "imp" / "checkpoints").mkdir()  # a training run's folder: resume would undo it
    with pytest.raises(DraftsmithError, match="a training run's folder"):
        import_drafter(sp, tmp_path / "imp", overwrite=True)


def test_import_refuses_a_target_of_another_shape(target, tmp_path):
    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    other = write_tiny_folder(tmp_path / "t2", "llama", hidden_size=32, vocab_size=256)
    with pytest.raises(DraftsmithError, match=r"--target .*t2 does not fit .*vocab 128 / hidden "
                       r"64, the target has vocab 256 / hidden 32"):
        import_drafter(sp, tmp_path / "imp", target=str(other))
    assert not (tmp_path / "imp").exists()


@pytest.mark.parametrize("k", [0, -5])
def test_export_refuses_fewer_than_one_speculative_token(target, tmp_path, k):
    src = make(target, tmp_path / "d")
    with pytest.raises(DraftsmithError, match=f"--speculative-tokens must be >= 1, got {k}"):
        export_drafter(src, "speculators", tmp_path / "sp", speculative_tokens=k)
    assert not (tmp_path / "sp").exists()


def test_export_overwrite_replaces_only_an_earlier_export(target, tmp_path, monkeypatch):
    """--overwrite wiped any non-empty --out, e.g. a models folder holding the (recorded, not
    passed) target; `--out .` was a ValueError; an export into an existing folder keeps it."""
    src = make(target, tmp_path / "d")
    models = tmp_path / "models"
    shutil.copytree(target.folder, models / "target")
    (models / "notes.txt").write_text("mine")
    before = snapshot(models)
    with pytest.raises(DraftsmithError, match="not an exported drafter folder"):
        export_drafter(src, "sglang", models, overwrite=True)
    assert snapshot(models) == before
    sp = export_drafter(src, "speculators", tmp_path / "sp")
    (sp / "stale.bin").write_text("old")
    export_drafter(src, "sglang", sp, overwrite=True)  # an earlier export is replaced whole
    assert sorted(p.name for p in sp.iterdir()) == ["config.json", "model.safetensors"]
    assert detect_format(sp) == "sglang"
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    export_drafter(src, "speculators", ".")
    assert here.stat().st_ino == inode and detect_format(here) == "speculators"
    export_drafter(src, "sglang", ".", overwrite=True)
    assert here.stat().st_ino == inode and detect_format(here) == "sglang"


def test_export_that_fails_leaves_the_old_export_and_no_tmp(target, tmp_path, monkeypatch):
    import safetensors.torch

    src = make(target, tmp_path / "d")
    sp = export_drafter(src, "speculators", tmp_path / "sp")
    before = snapshot(sp)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(src, "sglang", sp, overwrite=True)
    assert snapshot(sp) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "sp"]  # no .sp.tmp-PID


def test_export_names_a_relative_target_by_its_absolute_path(target, tmp_path, monkeypatch):
    """A target given (or recorded at training) as a relative path was written as such for
    speculators' verifier, which vLLM and speculators resolve from their own directory."""
    src = make(target, tmp_path / "d")
    shutil.copytree(target.folder, tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    for given in ("t", None):
        if given is None:  # as recorded: train wrote the path it was given
            c = json.loads((src / "draftsmith.json").read_text())
            c["config"]["target_source"] = "t"
            (src / "draftsmith.json").write_text(json.dumps(c))
        out = export_drafter(src, "speculators", f"sp-{given}", target=given)
        verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
        assert verifier["name_or_path"] == str(tmp_path.resolve() / "t"), given


def test_export_writes_a_legacy_rope_type_that_reads_back(tmp_path):
    """A target whose rope_scaling names its kind as `type` (older configs): rope_parameters
    said rope_type "default" beside it, and the export read back unscaled."""
    from draftsmith.targets import load_target

    folder = write_tiny_folder(tmp_path / "t")
    c = json.loads((folder / "config.json").read_text())
    c.pop("rope_parameters", None)
    c.update(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=10000.0)
    (folder / "config.json").write_text(json.dumps(c))
    t = load_target(folder)
    src = make(t, tmp_path / "d")
    want = load_drafter(src).lc.inv_freq()
    for fmt in ("sglang", "speculators"):
        out = export_drafter(src, fmt, tmp_path / fmt, target=str(folder))
        c = json.loads((out / "config.json").read_text())
        layer = c.get("transformer_layer_config", c)
        assert layer["rope_parameters"]["rope_type"] == "linear", fmt
        assert read_any(out, target=str(folder)).lc.inv_freq() == want, fmt


def test_import_names_weights_it_cannot_read(target, tmp_path):
    """A Git LFS pointer in place of the weights is a clear error, not a SafetensorError."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg")
    (out / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"
                                           "oid sha256:0\nsize 1\n")
    with pytest.raises(DraftsmithError, match="model.safetensors: cannot read its weights"):
        read_any(out, target=str(target.folder))


def test_import_reads_a_speculators_target_hidden_size(target, tmp_path):
    """vLLM's fc takes 3 x target_hidden_size where the config gives it; the import took the
    layer's hidden size and refused such a folder (fc.weight shape)."""
    import dataclasses

    from draftsmith.export.layout import TargetInfo, write_folder
    from draftsmith.export.speculators import speculators_config, speculators_names
    from draftsmith.models.eagle3 import hf_state_dict

    d = random_drafter(Eagle3Config.for_target(
        target.cfg, 40, AUX, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
        head_dim=16, target_source=str(target.folder)))
    c = speculators_config(dataclasses.replace(d.cfg, target_hidden_size=32),
                           TargetInfo.of_drafter(d.cfg), "float32", 3)
    c["target_hidden_size"] = 64
    out = write_folder(tmp_path / "sp", c, speculators_names(hf_state_dict(d)))
    back = read_any(out, target=str(target.folder))
    assert back.cfg.target_hidden_size == 64 and torch.equal(back.fc.weight, d.fc.weight)


@pytest.mark.parametrize("kept", ["d2t", "t2d"])
def test_import_derives_the_missing_vocab_map_from_the_other(target, tmp_path, kept):
    """A checkpoint holding one of d2t/t2d: the other is derived, the same ids as before."""
    src = make(target, tmp_path / "d")
    out = export_drafter(src, "sglang", tmp_path / "sg")
    w = load_file(out / "model.safetensors")
    w.pop("t2d" if kept == "d2t" else "d2t")
    save_file(w, out / "model.safetensors")
    back, orig = read_any(out, target=str(target.folder)), load_drafter(src)
    assert torch.equal(back.d2t, orig.d2t) and torch.equal(back.t2d, orig.t2d)
    ids = torch.arange(40)
    assert torch.equal(back.to_target(ids), torch.nonzero(orig.t2d).flatten())


def test_speculators_checkpoint_without_ids_takes_vllms_default(target, tmp_path):
    """vLLM's default aux layers without ids: the inputs of layers [2, L//2, L-3]."""
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp",
                         target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    c.pop("eagle_aux_hidden_state_layer_ids")
    (out / "config.json").write_text(json.dumps(c))
    assert read_any(out).cfg.aux_layer_ids == [1, 2, 2]  # canonical: outputs of 1, 2, 2


def test_sglang_checkpoint_without_ids_or_embedding(target, tmp_path):
    """An EAGLE-reference style folder: no eagle_config, no embedding, `model.` prefixes."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg")
    c = json.loads((out / "config.json").read_text())
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "draftsmith"):
        c.pop(key)
    (out / "config.json").write_text(json.dumps(c))
    w = load_file(out / "model.safetensors")
    save_file({f"model.{k}" if k.startswith("midlayer") else k: v for k, v in w.items()},
              out / "model.safetensors")
    with pytest.raises(DraftsmithError, match="pass --target"):
        read_any(out)
    d = read_any(out, target=str(target.folder))
    # SGLang's default without ids: the inputs of layers [2, L//2, L-3]
    assert d.cfg.aux_layer_ids == from_convention([2, 3, 3], Convention.EAGLE, L)
    assert torch.equal(d.embed_tokens.weight, target.weights["model.embed_tokens.weight"])


# --- the real speculators package -------------------------------------------------------------

SPEC_SCRIPT = r"""
import sys, torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.convert.eagle.eagle3_converter import Eagle3Converter

spec_dir, sglang_dir, conv_dir, verifier, io_dir, steps, ids = sys.argv[1:8]
inp = load_file(f"{io_dir}/inputs.safetensors")
out = {}

def run(model, tag):
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
    t = inp["next_ids"].shape[1]
    with torch.no_grad():
        model(hidden_states=inp["aux"], input_ids=inp["next_ids"],
              document_ids=torch.zeros(1, t, dtype=torch.long),
              position_ids=torch.arange(t)[None], ttt_steps=int(steps))
    hook.remove()
    for j, x in enumerate(logits):
        out[f"{tag}.{j}"] = x.contiguous()

run(Eagle3DraftModel.from_pretrained(spec_dir).eval(), "spec")
Eagle3Converter().convert(sglang_dir, conv_dir, base_model=verifier, norm_before_residual=False,
                          eagle_aux_hidden_state_layer_ids=[int(i) for i in ids.split(",")])
conv = Eagle3DraftModel.from_pretrained(conv_dir).eval()
conv.embed_tokens.weight.data.copy_(load_file(f"{io_dir}/inputs.safetensors")["embed"])
run(conv, "converted")
save_file(out, f"{io_dir}/outputs.safetensors")
"""

RECIPE = [
    ["{py}", "-m", "venv", "{venv}"],
    ["{pip}", "install", "torch==" + torch.__version__.split("+")[0]],
    ["{pip}", "install", "-c", "{cons}", "--no-deps", "speculators==0.9.0"],
    ["{pip}", "install", "-c", "{cons}", "aiohttp", "click", "datasets>=4.0.0,<=5.1.0", "httpx",
     "huggingface-hub", "loguru>=0.7.2,<=0.7.3", "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0",
     "protobuf", "psutil", "pydantic>=2.0.0", "pydantic-settings>=2.0.0", "rich", "safetensors",
     "tqdm>=4.66.3,<=4.70.1", "transformers>=5.0.0,<=5.19.0", "typer>=0.12.0",
     "hs-connectors==0.9.0"],
]


def speculators_python() -> Path | None:
    """The python of a venv with speculators 0.9.0 (see docs/engine-formats.md), if one exists."""
    candidates = [os.environ.get("DRAFTSMITH_SPECULATORS_VENV"),
                  cache_dir() / "venvs" / "speculators", "/work/venvs/speculators"]
    for c in candidates:
        if c and (Path(c) / "bin" / "python").is_file():
            return Path(c) / "bin" / "python"
    return None


def check_against_speculators(python: Path, target, tmp: Path) -> None:
    steps = 3
    src = make(target, tmp / "d")
    spec = export_drafter(src, "speculators", tmp / "spec", speculative_tokens=steps)
    sg = export_drafter(src, "sglang", tmp / "sg")
    d = load_drafter(src)
    torch.manual_seed(7)
    t = 128  # speculators' flex-attention block mask grows in blocks of 128 per TTT step
    x, aux = torch.randint(0, 128, (1, t)), torch.randn(1, t, 3, 64)
    save_file({"next_ids": shift_left(x, 1), "aux": aux.flatten(-2),
               "embed": target.weights["model.embed_tokens.weight"]},
              tmp / "inputs.safetensors")
    ids = ",".join(map(str, to_convention(AUX, "vllm", L)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run([str(python), "-c", SPEC_SCRIPT, str(spec), str(sg), str(tmp / "conv"),
                    str(target.folder), str(tmp), str(steps), ids], check=True, env=env,
                   timeout=600)
    got = load_file(tmp / "outputs.safetensors")
    with torch.no_grad():
        ours = list(unroll(d, x, d.fuse(aux), torch.arange(t)[None],
                           torch.zeros(1, t, dtype=torch.long), steps))
        first, _ = d(shift_left(x, 1), d.fuse(aux), torch.arange(t)[None])
    assert torch.allclose(first, got["spec.0"], atol=1e-5)
    for j in range(steps):  # every TTT step: same mask, positions and fed-back hidden
        n = t - j - 1  # beyond this the step reads padding, which each side fills its own way
        for tag in ("spec", "converted"):
            assert torch.allclose(ours[j][:, :n], got[f"{tag}.{j}"][:, :n], atol=1e-5), (tag, j)


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_speculators_package_loads_export_with_identical_logits(target, tmp_path):
    python = speculators_python()
    if python is None:
        pytest.skip("no speculators venv (set DRAFTSMITH_SPECULATORS_VENV, or run -m slow)")
    check_against_speculators(python, target, tmp_path)


@pytest.mark.slow
def test_speculators_in_a_fresh_venv(target, tmp_path):
    """CI: builds the venv with the recipe of docs/engine-formats.md (network), then checks."""
    python = speculators_python()
    if python is None:
        venv = cache_dir() / "venvs" / "speculators"
        cons = tmp_path / "constraints.txt"
        cons.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        fill = {"py": sys.executable, "venv": str(venv), "pip": str(venv / "bin" / "pip"),
                "cons": str(cons)}
        for cmd in RECIPE:
            subprocess.run([c.format(**fill) for c in cmd], check=True, timeout=1800)
        python = venv / "bin" / "python"
    check_against_speculators(python, target, tmp_path)


def test_aux_layer_text_that_names_no_id_is_refused_not_the_defaults():
    """' ' and ',' were an empty list: capture took the defaults, train a confusing message."""
    from draftsmith.layers import parse_ids

    assert parse_ids("1, 14,26") == [1, 14, 26] and parse_ids("") is None
    for text in (" ", ",", "1,x"):
        with pytest.raises(DraftsmithError, match="expected comma-separated integers"):
            parse_ids(text, "--aux-layers")


def test_a_drafter_config_that_is_not_an_object_is_named(tmp_path):
    from draftsmith.export.layout import read_config

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(DraftsmithError, match=r"config.json holds a list, not an object"):
        read_config(tmp_path)


def test_the_vllm_hint_warns_where_vllm_cannot_load_the_aux_count(target, tmp_path):
    """vLLM's Eagle-3 model sizes fc for 3 aux states: a 2-state speculators export is named."""
    from draftsmith.export.cli import _serve_hint

    two = export_drafter(make(target, tmp_path / "d2", aux=[1, 3]), "speculators",
                         tmp_path / "sp2", target=str(target.folder))
    three = export_drafter(make(target, tmp_path / "d3", aux=AUX), "speculators",
                           tmp_path / "sp3", target=str(target.folder))
    hints = [_serve_hint("speculators", p, json.loads((p / "config.json").read_text()), 3)
             for p in (two, three)]
    assert "warning: 2 aux layers" in hints[0] and "exactly 3" in hints[0]
    assert "warning" not in hints[1] and "vLLM: --speculative-config" in hints[1]
    cfg = json.loads((three / "config.json").read_text())
    for flag in ("norm_output", "fc_norm"):  # speculators reads them; vLLM's model does not
        hint = _serve_hint("speculators", three, {**cfg, flag: True}, 3)
        assert f"warning: {flag} set" in hint and "vLLM's Eagle-3 model does not" in hint
    assert "warning" not in _serve_hint("speculators", three,
                                        {**cfg, "norm_before_residual": True}, 3)


def test_the_export_command_prints_an_absolute_path_for_the_engines(target, tmp_path,
                                                                    monkeypatch):
    import typer
    from typer.testing import CliRunner

    from draftsmith.export.cli import export

    app = typer.Typer()
    app.command()(export)
    app.command("other")(lambda: None)
    src = make(target, tmp_path / "d")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["export", str(src), "-f", "sglang", "-o", "rel"])
    assert res.exit_code == 0, res.output
    assert f"--speculative-draft-model-path {tmp_path / 'rel'}" in res.stdout
