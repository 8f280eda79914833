"""A config.json transformers' typed configs refuse is one error naming the field."""

import json

import pytest
from conftest import write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target


def test_a_config_field_transformers_refuses_is_one_error(tmp_path):
    """A Qwen3 config with "head_dim": null was a StrictDataclassFieldValidationError
    traceback (a plain Exception, past the tokenizer's except)."""
    folder = write_tiny_folder(tmp_path / "q3", "qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "head_dim": None}))
    with pytest.raises(DraftsmithError, match=r"config\.json: transformers refuses it \(.*"
                                              r"head_dim.*\); fix that field"):
        load_target(str(folder))
