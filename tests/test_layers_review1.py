"""Layers review 1: what was left of the DeepSeek-V2 family's SGLang id rule (PR #25454) after
SGLang's Llama/Qwen/Mistral classes were found to read every explicit id as that layer's output
on every version."""

from __future__ import annotations

from pathlib import Path

from draftsmith.doctor.artifacts import DrafterInfo
from draftsmith.doctor.verdict import conventions, drafter_findings

IDS = "eagle_aux_hidden_state_layer_ids"


def test_vllms_eagle_config_fallback_is_fixed_for_vllm_not_by_an_sglang_rule():
    """Without --data, vLLM reading eagle_config's ids (no top-level key) is the one version
    dependent reading left; its fix said "export ids that start at 1, or pin the SGLang
    version", the old SGLang rule, for a vLLM finding."""
    info = DrafterInfo(Path("sg"), "sglang", {"eagle_config": {IDS: [2, 4, 6]}})
    (f,) = [f for f in drafter_findings(None, info, ["vllm"], 8) if "version dependent" in f.what]
    assert f.severity == "warning"
    assert "start at 1" not in f.fix and "SGLang" not in f.fix
    assert f.fix.startswith(f"write the top-level {IDS} (vLLM's key, input of layer j)")


def test_each_convention_names_sglang_once():
    """'as each convention writes them' listed sglang and sglang-legacy, the same ids under two
    names, as if SGLang versions read them differently."""
    out = conventions([0, 2, 4], 6)
    assert "sglang-legacy" not in out
    assert out["sglang"] == [0, 2, 4] and out["vllm"] == [1, 3, 5]
