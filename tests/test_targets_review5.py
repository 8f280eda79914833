"""A converted GGUF's config.json had `architectures: null` (transformers' GGUF reader sets
none): the cached folder could not be loaded by an engine, and a speculators export named its
verifier with no architecture."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_hf_model
from test_targets import _gguf_from_hf

from draftsmith.targets import load_target


@pytest.mark.parametrize(("arch", "gguf_arch", "want"), [("llama", "llama", "LlamaForCausalLM"),
                                                         ("qwen2", "qwen2", "Qwen2ForCausalLM")])
def test_a_converted_gguf_names_its_architecture(tmp_path, monkeypatch, arch, gguf_arch, want):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    _gguf_from_hf(path := tmp_path / "m.gguf", tiny_hf_model(arch), gguf_arch)
    t = load_target(path)
    assert json.loads((t.folder / "config.json").read_text())["architectures"] == [want]
    assert t.hf_config["architectures"] == [want]
