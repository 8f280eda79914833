"""A drafter folder's hand-edited or foreign config: every value that cannot build the drafter
is one DraftsmithError naming the file, never a torch TypeError traceback."""

from __future__ import annotations

import json

import pytest
from test_drafter import random_drafter, tiny_cfg

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import (
    CONFIG_FILE,
    Eagle3Config,
    load_drafter,
    read_drafter_config,
    save_drafter,
)


def _edited(tmp_path, **edit):
    folder = tmp_path / "d"
    save_drafter(random_drafter(tiny_cfg()), folder)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    meta["config"].update(edit)
    (folder / CONFIG_FILE).write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize(("edit", "said"), [
    ({"num_layers": 2.0}, r"num_layers 2\.0 is not a size"),
    ({"hidden_size": "32"}, r"hidden_size '32' is not a size"),
    ({"draft_vocab_size": 0}, r"draft_vocab_size 0 is not a size"),
    ({"aux_layer_ids": [1, "2", 4]}, r"aux_layer_ids \[1, '2', 4\] is not a list"),
    ({"rope_theta": "1e4"}, r"rope_theta '1e4' is not a finite number > 0"),
])
def test_a_malformed_size_is_one_error_naming_the_config(tmp_path, edit, said):
    """num_layers 2.0 and hidden_size "32" were TypeErrors from torch's module constructors;
    the string id loaded and broke later conversions."""
    folder = _edited(tmp_path, **edit)
    with pytest.raises(DraftsmithError, match=f"{CONFIG_FILE}: {said}"):
        load_drafter(folder)


@pytest.mark.parametrize(("edit", "said"), [
    ({"extra_key": 1}, r"unknown keys \['extra_key'\].*upgrade draftsmith"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope scaling 'yarn'"),
    ({"num_kv_heads": 3}, "not a multiple of num_key_value_heads 3"),
])
def test_a_refused_config_names_its_file(tmp_path, edit, said):
    """These were refused without saying which drafter's file (compare and --init-from read
    two drafters)."""
    folder = _edited(tmp_path, **edit)
    with pytest.raises(DraftsmithError, match=f"{folder / CONFIG_FILE}: .*{said}"):
        load_drafter(folder)


def test_a_wellformed_config_still_builds_and_loads(tmp_path):
    folder = _edited(tmp_path)
    assert load_drafter(folder).cfg == tiny_cfg() == read_drafter_config(str(folder))
    assert Eagle3Config(**{**tiny_cfg().to_dict(), "target_num_layers": 0}).target_num_layers == 0


def test_numpy_values_and_a_tuple_of_ids_are_taken_as_plain_numbers() -> None:
    """A config built in Python from numpy values (np.int64 sizes, np.float64 eps) or a tuple
    of aux ids was refused as "not a size"; an infinite rope_theta was taken."""
    import numpy as np

    cfg = tiny_cfg(hidden_size=np.int64(32), rms_norm_eps=np.float64(1e-6),
                   aux_layer_ids=(np.int64(1), 2, 4))
    assert type(cfg.hidden_size) is int and type(cfg.rms_norm_eps) is float
    assert cfg.aux_layer_ids == [1, 2, 4] and all(type(i) is int for i in cfg.aux_layer_ids)
    assert json.loads(json.dumps(cfg.to_dict()))["hidden_size"] == 32
    with pytest.raises(DraftsmithError, match="rope_theta inf is not a finite number > 0"):
        tiny_cfg(rope_theta=float("inf"))
    with pytest.raises(DraftsmithError, match="num_heads True is not a size"):
        tiny_cfg(num_heads=True)
