"""Review 10 of the models: a drafter whose aux layer ids repeat a layer (an import of the
engines' defaults on a short target keeps them) decodes, and a config.json of no attention
heads is one error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig


def test_repeated_aux_ids_give_that_layers_state_in_each_place():
    """Each id its own slot: a repeated one was left None and stacking it a TypeError."""
    model = tiny_target()
    ids, pos = torch.randint(0, 128, (2, 6)), torch.arange(6).expand(2, 6)
    with torch.no_grad():
        once = model(ids, pos, aux_ids=(-1, 0, 1)).aux
        twice = model(ids, pos, aux_ids=(-1, 0, 0, 1, -1)).aux
    assert torch.equal(twice, once[:, :, [0, 1, 1, 2, 0]])


def test_a_drafter_whose_aux_ids_repeat_a_layer_decodes_as_greedy_decoding():
    """`draftsmith import` keeps the engines' repeated defaults on a short target (export
    refuses them); generate, bench and doctor with such a drafter failed in the target's
    forward with a TypeError."""
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime

    target = tiny_target()
    drafter = make_drafter(target, 64)
    drafter.cfg = dataclasses.replace(drafter.cfg, aux_layer_ids=[0, 0, 1])
    prompt = [[1, 2, 3, 4]]
    with torch.no_grad():
        out = SpecDecoder(target, drafter, steps=3, max_seq=64, profile=False).generate(
            prompt, 12, [])
        plain = generate(Runtime(target, max_batch=1, max_seq=64), prompt, 12, eos_ids=[])
    assert out.tokens == plain


def test_a_config_of_no_attention_heads_is_one_error():
    """num_attention_heads 0 was a ZeroDivisionError traceback (hidden_size // heads)."""
    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 0}
    with pytest.raises(DraftsmithError, match="num_attention_heads 0 is not a size"):
        ModelConfig.from_hf(hf)
