"""Export, ninth review: an export that cannot write is one error, a flag written as text is
named (not read as true), and an SGLang export that would swap the drafter's own embedding for
the target's says so."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, read_any
from draftsmith.models.eagle3 import load_drafter, save_drafter


def test_an_export_that_cannot_write_is_one_error_and_keeps_the_earlier(target, tmp_path,
                                                                         monkeypatch):
    """A full disk or read-only --out was a Python traceback (import already said it in one
    line); the earlier export stays and no tmp folder is left."""
    import safetensors.torch

    src = make(target, tmp_path / "d")
    out = export_drafter(src, "sglang", tmp_path / "sg")
    before = (out / "config.json").read_text()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(DraftsmithError, match=r"^--out .*sg: cannot write the export \(No space "
                                              r"left on device\); what was there is kept"):
        export_drafter(src, "sglang", out, overwrite=True)
    assert (out / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "sg"]


@pytest.mark.parametrize("fmt,key", [("speculators", "norm_before_residual"),
                                     ("speculators", "fc_norm"),
                                     ("sglang", "norm_before_residual"),
                                     ("sglang", "tie_word_embeddings")])
def test_a_flag_written_as_text_is_named_not_read_as_true(target, tmp_path, fmt, key):
    """"false" (text) was read as true by bool(): the drafter imported with the other
    residual (vLLM's `if config.norm_before_residual` does so too, speculators' pydantic reads
    the word), or a tied head refused by a shape."""
    out = export_drafter(make(target, tmp_path / "d"), fmt, tmp_path / "o")
    c = json.loads((out / "config.json").read_text())
    c[key] = "false"
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(DraftsmithError, match=rf"config.json: {key} is \"false\" \(text\), not "
                                              "true or false"):
        read_any(out, target=str(target.folder))


def test_a_null_flag_still_reads_as_false(target, tmp_path):
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "o")
    c = json.loads((out / "config.json").read_text())
    c["norm_before_residual"] = None  # vLLM: config_dict.get(key, True) is None, falsy
    (out / "config.json").write_text(json.dumps(c))
    assert read_any(out).cfg.norm_before_residual is False


def _own_embedding(target, tmp_path):
    src = make(target, tmp_path / "d")
    d = load_drafter(src)
    with torch.no_grad():
        d.embed_tokens.weight.add_(0.5)
    return save_drafter(d, src)


def test_sglang_export_names_an_embedding_sglang_replaces(target, tmp_path):
    """SGLang's EAGLE worker puts the target's embedding into the draft (set_embed) and the
    export drops the drafter's: a drafter with its own (an imported vLLM drafter) was served
    with other vectors by SGLang, without a word."""
    src = _own_embedding(target, tmp_path)
    with pytest.warns(UserWarning, match="embed_tokens.weight differs from the target's; SGLang "
                                         "serves the target's"):
        export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))


def test_no_embedding_warning_where_sglang_serves_the_drafters_own(target, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg",
                       target=str(target.folder))
        # vLLM keeps a differing embedding: the speculators export says nothing
        export_drafter(_own_embedding(target, tmp_path / "x"), "speculators", tmp_path / "sp",
                       target=str(target.folder))
