"""Tensor-parallel review: shapes a TP size cannot split are refused naming --tp, and the
launcher refuses a TP size that is no whole number before any rank starts."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from draftsmith.dist import launch_tp
from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.llama import Transformer
from draftsmith.models.parallel import TP


@pytest.mark.parametrize(("over", "size", "line"), [
    ({}, 3, "num_attention_heads = 4 is not divisible by tensor-parallel size 3: give a --tp "
            "that divides it (1, 2 or 4)"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2}, 4,
     "num_key_value_heads = 2 is not divisible by tensor-parallel size 4: give a --tp that "
     "divides it (1 or 2)"),
])
def test_a_tp_size_that_cannot_split_the_heads_names_the_tp_that_can(over, size, line):
    cfg = ModelConfig.from_hf(tiny_hf_model("llama", **over).config.to_dict())
    with pytest.raises(DraftsmithError) as err, torch.device("meta"):
        Transformer(cfg, TP(1, size))
    assert str(err.value) == line


def _never_run(tp: TP) -> None:
    raise AssertionError("a rank started")


@pytest.mark.parametrize("size", ["2", 2.0, None])
def test_launch_tp_refuses_a_tp_size_that_is_no_whole_number(size):
    with pytest.raises(DraftsmithError, match=f"^--tp must be >= 1, got {size!r}$"):
        launch_tp(_never_run, size, device="cpu")
