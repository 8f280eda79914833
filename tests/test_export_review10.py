"""Export, tenth review: the written folders against the newest upstream readers in the index.

The readers are restated here as rules (not copied), each with the file and commit read:
- vLLM `vllm/foundation/integrations/transformers_utils/configs/speculators/base.py`
  (vllm-project/vllm 055e47c28003): `validate_speculators_config` needs
  speculators_config.proposal_methods[0].speculative_tokens, speculators_config.verifier
  .name_or_path, speculators_model_type and a dict transformer_layer_config.
- vLLM `update_eagle3` (`.../speculators/algos.py`, vllm-project/vllm cfb173ab8e1b and later
  copies): norm_before_residual defaults to True when absent; the top-level
  eagle_aux_hidden_state_layer_ids is copied only when truthy; newer copies route the
  architecture by transformer_layer_config.model_type and refuse one outside {llama, qwen3}.
- SGLang `python/sglang/srt/models/llama_eagle3.py` (sgl-project/sglang 03d5a7771f60):
  draft_vocab_size None takes the target's head; tie_word_embeddings makes lm_head the
  embedding; `fc` bias from config `bias`; ids from nested eagle_config only.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from test_export import make

from draftsmith.export import export_drafter


def _export(target, tmp_path, fmt: str) -> tuple[dict, set[str]]:
    out = export_drafter(make(target, tmp_path / "d"), fmt, tmp_path / fmt)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return json.loads((out / "config.json").read_text()), names


def test_speculators_config_passes_vllms_structure_check(target, tmp_path):
    c, _ = _export(target, tmp_path, "speculators")
    spec = c["speculators_config"]
    assert isinstance(spec["proposal_methods"][0]["speculative_tokens"], int)
    assert spec["verifier"]["name_or_path"]
    assert c["speculators_model_type"] == "eagle3"
    assert isinstance(c["transformer_layer_config"], dict)
    # update_eagle3's reads: explicit flag (its default is True), truthy ids, routable type
    assert c["norm_before_residual"] is False
    assert c["eagle_aux_hidden_state_layer_ids"]
    assert c["transformer_layer_config"]["model_type"] in ("llama", "qwen3")


def test_speculators_tensor_names_are_eagle3_draft_model_names(target, tmp_path):
    """speculators' Eagle3DraftModel (vllm-project/speculators c05b95b303f7,
    src/speculators/models/eagle3/core.py): layers.{i}.*, fc, norm, lm_head, embed_tokens,
    d2t, t2d; vLLM prepends `model.` to every name but lm_head, so none may carry it."""
    _, names = _export(target, tmp_path, "speculators")
    assert not any(n.startswith("model.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t",
            "t2d"} <= names
    assert all(n.startswith(("layers.0.", "fc.", "norm.", "lm_head.", "embed_tokens.")) or
               n in ("d2t", "t2d") for n in names)


@pytest.mark.parametrize("key,want", [("tie_word_embeddings", False),
                                      ("norm_before_residual", False)])
def test_sglang_config_flags_read_as_upstream(target, tmp_path, key, want):
    c, _ = _export(target, tmp_path, "sglang")
    assert c[key] is want
    assert c["draft_vocab_size"] is not None  # None would serve the target's full head
    assert not c.get("bias")  # fc bias: draftsmith's fc has none
    assert len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    assert c["eagle_config"]["use_aux_hidden_state"] is True
