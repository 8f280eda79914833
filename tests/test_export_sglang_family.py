"""SGLang's Qwen2/Qwen3 classes capture the embedding's output (canonical -1), its Llama and
Mistral classes cannot (layers review 5): the SGLang export refuses -1 by the target's family."""

from __future__ import annotations

import dataclasses

import pytest
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.export.layout import TargetInfo
from draftsmith.export.sglang import served_family, sglang_config
from draftsmith.models.eagle3 import load_drafter


@pytest.mark.parametrize(("archs", "family"), [
    (["Qwen2ForCausalLM"], "qwen2"), (["LlamaForCausalLM"], "llama"), ([], None), ([""], None),
])
def test_the_family_is_read_from_the_architectures(archs, family):
    assert served_family(archs) == family


def embedding_drafter(target, tmp_path):
    d = load_drafter(make(target, tmp_path / "d"))
    return dataclasses.replace(d.cfg, aux_layer_ids=[-1, 2, 4])


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_a_qwen_target_exports_an_embedding_id_to_sglang(target, tmp_path, arch):
    cfg = embedding_drafter(target, tmp_path)
    info = dataclasses.replace(TargetInfo.of_drafter(cfg), architectures=[arch])
    got = sglang_config(cfg, info, "float32")
    assert got["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 2, 4]


@pytest.mark.parametrize(("archs", "whose"), [
    (["LlamaForCausalLM"], "for a llama target"), ([], "for Llama or Mistral targets"),
])
def test_a_llama_or_unnamed_target_is_refused_naming_the_family(target, tmp_path, archs, whose):
    cfg = embedding_drafter(target, tmp_path)
    info = dataclasses.replace(TargetInfo.of_drafter(cfg), architectures=archs)
    with pytest.raises(DraftsmithError, match=f"id -1 \\(embedding output\\).*{whose}"):
        sglang_config(cfg, info, "float32")
