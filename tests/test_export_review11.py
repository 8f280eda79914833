"""Export review 11: the dtype keys of the speculators (vLLM) config.json."""

from __future__ import annotations

import json

from test_export import make
from test_export_review2 import bf16_target

from draftsmith.export import export_drafter


def test_speculators_config_names_its_dtype_under_both_keys(tiny_llama_dir, tmp_path):
    """speculators' SpeculatorModelConfig hands config.json to transformers' PretrainedConfig,
    which before 4.56 reads only `torch_dtype` (a lone `dtype` is then an unread attribute and
    the config's dtype None), and from 4.56 reads `dtype`: both are written, as one value."""
    t = bf16_target(tiny_llama_dir, tmp_path)
    src = make(t, tmp_path / "d")
    out = export_drafter(src, "speculators", tmp_path / "spec", target=str(t.folder))
    c = json.loads((out / "config.json").read_text())
    assert (c.get("torch_dtype"), c.get("dtype")) == ("bfloat16", "bfloat16")
