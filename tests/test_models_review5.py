"""Review 5 of the drafter's config and weights and the target's loader: every value or tensor
that cannot be the drafter (or target) it claims is one DraftsmithError naming the file and
the field or tensor as the file names it, never a torch traceback or a silently other model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_hf_model
from safetensors.torch import load_file, save_file
from test_drafter import random_drafter, tiny_cfg

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Eagle3Drafter,
    check_drafter,
    load_drafter,
    save_drafter,
)
from draftsmith.models.loading import build_model


def _folder(tmp_path, config=None, weights=None, drafter: Eagle3Drafter | None = None):
    folder = tmp_path / "d"
    save_drafter(drafter or random_drafter(tiny_cfg()), folder)
    if config:
        meta = json.loads((folder / CONFIG_FILE).read_text())
        meta["config"].update(config)
        (folder / CONFIG_FILE).write_text(json.dumps(meta))
    if weights:
        sd = load_file(folder / WEIGHTS_FILE)
        weights(sd)
        save_file(sd, folder / WEIGHTS_FILE)
    return folder


@pytest.mark.parametrize(("edit", "said"), [
    ({"norm_before_residual": "false"}, r"norm_before_residual 'false' is not true or false"),
    ({"norm_output": 1}, r"norm_output 1 is not true or false"),
    ({"fc_norm": None}, r"fc_norm None is not true or false"),
    ({"aux_layer_ids": [-3, 1, 4]}, r"aux layer ids \[-3\] out of range.*-1 or more"),
    ({"target_num_layers": -2}, r"target_num_layers -2 is not a layer count"),
    ({"target_num_layers": "6"}, r"target_num_layers '6' is not a layer count"),
    ({"target_num_layers": True}, r"target_num_layers True is not a layer count"),
    ({"aux_convention": "input of decoder layer j"}, r"aux_convention 'input of decoder layer "
                                                     r"j' is not draftsmith's"),
    ({"rope_scaling": "linear"}, r"rope_scaling 'linear' is not an object"),
    ({"target_fingerprint": 5}, r"target_fingerprint 5 is not a text"),
    ({"target_architectures": "LlamaForCausalLM"}, r"target_architectures 'LlamaForCausalLM' "
                                                   r"is not a list of texts"),
    ({"extra": []}, r"extra \[\] is not an object"),
])
def test_a_config_value_of_the_wrong_kind_is_one_error_naming_the_file(tmp_path, edit, said):
    """A flag "false" (truthy) built a drafter of other numerics without a word; ids past the
    any target (below -1), another convention's ids and a malformed layer count loaded; a string
    rope_scaling was an AttributeError traceback."""
    folder = _folder(tmp_path, config=edit)
    with pytest.raises(DraftsmithError, match=f"{CONFIG_FILE}: {said}"):
        check_drafter(folder)


def _cut(name: str, rows: slice = slice(None), cols: slice = slice(None)):
    def edit(sd):
        sd[name] = sd[name][rows, cols].contiguous()
    return edit


@pytest.mark.parametrize(("name", "rows", "cols", "shape"), [
    ("midlayer.self_attn.q_proj.weight", slice(None), slice(0, 40), r"\(32, 40\)"),
    ("midlayer.self_attn.k_proj.weight", slice(0, 8), slice(None), r"\(8, 64\)"),
    ("midlayer.mlp.up_proj.weight", slice(0, 40), slice(None), r"\(40, 32\)"),
])
def test_a_fused_piece_of_the_wrong_shape_is_named_as_the_file_names_it(tmp_path, name, rows,
                                                                         cols, shape):
    """A q_proj of another input width was a torch.cat RuntimeError; other rows were named as
    draftsmith's fused `qkv` / `gate_up` of a summed shape, a name no file holds."""
    folder = _folder(tmp_path, weights=_cut(name, rows, cols))
    with pytest.raises(DraftsmithError, match=f"{folder / WEIGHTS_FILE}: {name} has shape "
                                              f"{shape}, the config implies"):
        load_drafter(folder)


def test_a_missing_or_unknown_tensor_names_the_file(tmp_path):
    """A missing k_proj was "drafter weights: midlayer.* lacks [...]", naming no file."""
    def edit(sd):
        del sd["midlayer.self_attn.k_proj.weight"]
        sd["midlayer.self_attn.extra.weight"] = torch.zeros(2)
    folder = _folder(tmp_path, weights=edit)
    said = (rf"{folder / WEIGHTS_FILE}: missing tensors \['midlayer.self_attn.k_proj.weight'\], "
            r"unexpected tensors \['midlayer.self_attn.extra.weight'\]")
    with pytest.raises(DraftsmithError, match=said):
        load_drafter(folder)


def test_draftsmiths_own_fused_names_still_load(tmp_path):
    """A module's state dict saved as it is (qkv, gate_up: an older keep of a drafter) loads."""
    d = random_drafter(tiny_cfg())
    folder = _folder(tmp_path)
    save_file({k: v.contiguous() for k, v in d.state_dict().items()},
              str(folder / WEIGHTS_FILE))
    assert torch.equal(load_drafter(folder).midlayer.self_attn.qkv.weight,
                       d.midlayer.self_attn.qkv.weight)


def test_weights_stored_in_several_dtypes_load_as_the_rest_with_a_warning(tmp_path):
    """A file of fp16 fc and fp32 rest loaded, then failed its first forward in a matmul (and a
    refusal would leave an imported engine folder of such weights no way to export)."""
    folder = _folder(tmp_path, weights=lambda sd: sd.update(
        {"fc.weight": sd["fc.weight"].half()}))
    with pytest.warns(UserWarning, match=rf"{folder / WEIGHTS_FILE}: float tensors in several "
                                         r"dtypes \(fc.weight float16\); loaded as the rest, "
                                         "float32"):
        d = load_drafter(folder)
    assert {p.dtype for p in d.parameters()} == {torch.float32}
    assert load_drafter(folder, dtype=torch.float16).fc.weight.dtype == torch.float16


def test_a_float_d2t_keeps_its_ids_under_a_bf16_load(tmp_path):
    """d2t (and t2d) were cast to the load's dtype with the weights: offsets past 256 rounded in
    bf16, drafting other target tokens."""
    cfg = tiny_cfg(vocab_size=1000)
    d = random_drafter(cfg)
    used = torch.arange(979, 999)  # offset 979: 10 significant bits, bf16 keeps 8
    d.set_vocab(used - torch.arange(20), torch.isin(torch.arange(1000), used))
    folder = _folder(tmp_path, drafter=d,
                     weights=lambda sd: sd.update({"d2t": sd["d2t"].float()}))
    assert torch.equal(load_drafter(folder, dtype=torch.bfloat16).d2t, d.d2t)


def test_another_targets_embedding_is_named_as_the_targets(tmp_path):
    """The target's embedding of another vocab was blamed on the drafter's file
    ("model.safetensors: embed_tokens.weight has shape ...")."""
    folder = _folder(tmp_path, weights=lambda sd: sd.pop("embed_tokens.weight"))
    with pytest.raises(DraftsmithError, match=rf"{folder / CONFIG_FILE}: made for a target of "
                                              r"vocab 50 and hidden size 32.*\(60, 32\)"):
        load_drafter(folder, embed=torch.zeros(60, 32))


@pytest.mark.parametrize("over", [{}, {"num_layers": 2, "fc_norm": True},
                                  {"norm_before_fc": True, "norm_before_residual": True}])
def test_a_saved_drafter_loads_equal(tmp_path, over):
    d = random_drafter(tiny_cfg(**over)).to(torch.bfloat16)
    e = load_drafter(_folder(tmp_path, drafter=d))
    assert e.cfg == d.cfg
    a, b = d.state_dict(), e.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                                      for k in a)


@pytest.mark.parametrize(("name", "cut", "said"), [
    ("model.layers.0.self_attn.q_proj.weight", (slice(None), slice(0, 32)),
     r"model.layers.0.self_attn.q_proj.weight: the checkpoint holds a tensor of shape "
     r"\(64, 32\), where the model that config.json describes takes \(64, 64\)"),
    ("model.layers.1.mlp.up_proj.weight", (slice(0, 8), slice(None)),
     r"model.layers.1.mlp.up_proj.weight: the checkpoint holds a tensor of shape \(8, 64\)"),
    ("model.layers.0.self_attn.o_proj.weight", (slice(0, 8), slice(None)),
     r"model.layers.0.self_attn.o_proj.weight: the checkpoint holds"),
])
def test_a_target_tensor_of_the_wrong_shape_is_named_as_the_checkpoint_names_it(name, cut,
                                                                                 said):
    """A q_proj of another input width was a torch.cat RuntimeError; other shapes were named
    as `layers.0.attn.qkv.weight`, draftsmith's fused name, of the summed shape."""
    m = tiny_hf_model("llama")
    cfg = ModelConfig.from_hf(m.config.to_dict())
    sd = dict(m.state_dict())
    sd[name] = sd[name][cut].contiguous()
    with pytest.raises(DraftsmithError, match=said):
        build_model(cfg, sd)
