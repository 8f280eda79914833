"""Layers review 5: SGLang's reading of eagle_config's ids, checked against its model files.

Its Llama (and Mistral, a subclass), Qwen2 and Qwen3 classes add 1 to every explicit id, however
the list starts (PR #25454's "add 1 only when ids[0] == 1" is in deepseek_v2.py alone), and
capture the residual stream *before* loop index id + 1. Only the Qwen2 model's loop (Qwen3's
model subclasses it) guards the residual that layer 0 lacks, so only those two families can hand
over the embedding output (canonical -1); no family reaches past its last layer."""

from __future__ import annotations

import pytest

from draftsmith.layers import engine_limits, from_convention, to_convention


def sglang_captures(written: list[int]) -> list[int]:
    """Canonical layers SGLang's Llama/Qwen classes capture for eagle_config ids `written`:
    loop index id + 1, whose input is the output of decoder layer id."""
    return [(i + 1) - 1 for i in written]


@pytest.mark.parametrize("ids", [
    [1, 15, 28],   # SpecForge's defaults: a list starting at 1
    [0, 15, 28],   # a list starting at 0 (the 4-7-layer defaults start there)
    [2, 16, 29],   # a list starting at 2: still output of layer j on Llama/Qwen
])
def test_sglang_ids_are_the_canonical_ones_whatever_the_first_id(ids: list[int]) -> None:
    written = to_convention(ids, "sglang", 32)
    assert written == ids
    assert sglang_captures(written) == ids
    assert from_convention(written, "sglang", 32) == ids


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "Qwen2"])
def test_qwen_targets_can_give_sglang_the_embedding(family: str) -> None:
    """SGLang's Qwen2Model appends the embedding where residual is None; the message claimed
    no SGLang class could, for every family."""
    assert engine_limits([-1, 0, 1], 3, family=family) == []
    assert engine_limits([-1, 14, 26], 30, family=family) == []


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_llama_family_targets_cannot_and_the_note_names_the_family(family: str) -> None:
    (note,) = engine_limits([-1, 14, 26], 30, family=family)
    assert note.startswith("id -1 (embedding output): SGLang's capture hook")
    assert f"a {family} target" in note and "\n" not in note


def test_without_a_family_the_note_names_the_families_not_one_rule_for_all() -> None:
    (note,) = engine_limits([-1, 14, 26], 30)
    assert note.startswith("id -1 (embedding output): SGLang's capture hook")
    assert "Llama" in note and "Mistral" in note and "Qwen2/Qwen3" in note


@pytest.mark.parametrize("family", [None, "llama", "mistral", "qwen2", "qwen3"])
def test_no_family_captures_the_last_layers_output(family: str | None) -> None:
    """id L-1 is SGLang id L -> loop index L + 1, past every layer's loop."""
    assert engine_limits([0, 1, 2], 3, family=family) == [
        "id 2 (last layer output): SGLang cannot capture it through its hook"]
    assert engine_limits([1, 14, 26], 30, family=family) == []
