"""Layers review 4: every conversion checked against the engines' own readings (SGLang's
Llama/Qwen classes add 1 to every explicit id; vLLM and speculators read the input of layer j,
newer model files 0 = embedding and L = the last layer's output; SpecForge and ModelOpt hook
layer outputs) on targets of 1 to 80 layers, and no default ids for a target with no layer."""

from __future__ import annotations

from itertools import combinations

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.layers import Convention, default_aux_layers, from_convention, to_convention

DEPTHS = (1, 2, 3, 4, 30, 32, 80)
OUTPUT_OF = ("draftsmith", "sglang", "sglang-legacy", "specforge", "modelopt")
INPUT_OF = ("eagle", "vllm", "speculators")


@pytest.mark.parametrize("layers", [0, -1])
def test_a_target_with_no_layer_is_not_told_to_use_two_it_lacks(layers):
    """It said "give --aux-layers -1,0 to use the two it has": a 0-layer target has only the
    embedding, and id 0 names no layer of it (validate refuses what the advice gives)."""
    with pytest.raises(DraftsmithError) as e:
        default_aux_layers(layers)
    msg = str(e.value)
    assert "-1,0" not in msg and "the two it has" not in msg and "\n" not in msg
    assert f"{layers}-layer target has no decoder layer" in msg


def test_a_one_layer_target_still_names_its_two_states():
    with pytest.raises(DraftsmithError, match="give --aux-layers -1,0 to use the two it has"):
        default_aux_layers(1)


@pytest.mark.parametrize(("layers", "ids"), [
    (2, [-1, 0, 1]), (3, [-1, 0, 1]), (4, [0, 1, 2]),
    (30, [1, 14, 26]), (32, [1, 15, 28]), (80, [1, 39, 76]),
])
def test_defaults_are_specforges_and_the_engines_own_layers(layers, ids):
    """SpecForge's [1, L//2-1, L-4] (outputs) = vLLM/SGLang/EAGLE's [2, L//2, L-3] (inputs)."""
    assert default_aux_layers(layers) == ids
    if layers >= 7:
        assert ids == [1, layers // 2 - 1, layers - 4]
        assert to_convention(ids, "vllm", layers) == [2, layers // 2, layers - 3]
        assert to_convention(ids, "sglang", layers) == ids


@pytest.mark.parametrize("layers", DEPTHS)
def test_edges_in_every_convention(layers):
    """The embedding is -1 in output-of conventions and 0 in input-of ones; the last layer's
    output L-1 and L; one past either end is refused in the convention's own numbers."""
    last = layers - 1
    for conv in OUTPUT_OF:
        assert to_convention([-1, last], conv, layers) == [-1, last]
    for conv in INPUT_OF:
        assert to_convention([-1, last], conv, layers) == [0, layers]
    for conv, lo, hi in [(c, -1, last) for c in OUTPUT_OF] + [(c, 0, layers) for c in INPUT_OF]:
        for bad in (lo - 1, hi + 1):
            with pytest.raises(DraftsmithError) as e:
                from_convention([bad], conv, layers)
            msg = str(e.value)
            assert f"[{bad}] out of range" in msg and f"lie in [{lo}, {hi}]" in msg
            assert "\n" not in msg


@pytest.mark.parametrize("layers", DEPTHS)
@pytest.mark.parametrize("conv", list(Convention))
def test_every_list_round_trips_on_every_depth(layers, conv):
    span = range(-1, layers) if layers < 10 else (-1, 0, 1, layers // 2, layers - 2, layers - 1)
    for n in (1, 3):
        for ids in map(list, combinations(span, n)):
            assert from_convention(to_convention(ids, conv, layers), conv, layers) == ids
