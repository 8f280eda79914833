"""Engine API checks, second review: prompts and eos ids that are not whole-number token ids,
an empty list of per-prompt settings, refill rows past the runtime's, and `draftsmith generate`
past the target's positions or with a seed that draws nothing."""

from __future__ import annotations

import pytest
import torch
from test_speculative import make_drafter, tiny_target
from typer.testing import CliRunner

from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import generate, run_generation
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, make_drafter(target, 96)


def _decoder(pair, rows: int = 2) -> SpecDecoder:
    target, drafter = pair
    return SpecDecoder(Runtime(target, rows, 64, graphs=False), drafter, 2, 1, None)


def _engines(pair):
    """Each decoding entry point as f(prompts, eos)."""
    target, _ = pair
    rt = Runtime(target, 2, 64, graphs=False)
    dec = _decoder(pair)
    return [lambda p, e: generate(target, p, 3, eos_ids=e),
            lambda p, e: generate(rt, p, 3, eos_ids=e),
            lambda p, e: refill.generate_refill(rt, p, 3, eos_ids=e),
            lambda p, e: dec.generate(p, 3, e),
            lambda p, e: spec_refill.generate_refill(dec, p, 3, e)]


@pytest.mark.parametrize(("prompts", "what"), [
    ([[1.5, 2]], "prompt 0 is not a list of whole-number token ids"),
    ([[1, 2], [3, 4.0]], "prompt 1 is not a list of whole-number token ids"),
    ([[[1, 2]]], "prompt 0 is not a list of whole-number token ids"),
    ([["a"]], "prompt 0 is not a list of whole-number token ids"),
    ([torch.tensor([1.0, 2.0])], "prompt 0 is not a list of whole-number token ids"),
    ([[1, 2**70]], r"prompt 0 holds token id 1180591620717411303424, outside .* \[0, 128\)"),
    (torch.tensor([[1, 2], [3, 4]]), "prompts must be a list of token-id lists, not a Tensor"),
])
def test_prompts_that_are_not_token_ids_are_refused(pair, prompts, what):
    """[[1.5, 2]] decoded as [[1, 2]]; a 2-D tensor of prompts was "Boolean value of Tensor
    ... is ambiguous"; an id past int64 a raw overflow error."""
    for run in _engines(pair):
        with pytest.raises(DraftsmithError, match=what) as e:
            run(prompts, [])
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("eos", [[2**70], [1.5], [[2]]])
def test_eos_ids_that_are_not_whole_numbers_are_refused(pair, eos):
    for run in _engines(pair):
        with pytest.raises(DraftsmithError, match="eos ids must be whole numbers within int64"):
            run([[1, 2]], eos)


@pytest.mark.parametrize("new", [2.5, 3.0, "3", True])
def test_a_max_new_that_is_not_a_whole_number_is_refused(pair, new):
    """A float max_new_tokens failed deep in a buffer's allocation or a slice."""
    target, _ = pair
    rt = Runtime(target, 2, 64, graphs=False)
    dec = _decoder(pair)
    for run in (lambda: generate(target, [[1, 2]], new), lambda: generate(rt, [[1, 2]], new),
                lambda: refill.generate_refill(rt, [[1, 2]], new),
                lambda: dec.generate([[1, 2]], new)):
        with pytest.raises(DraftsmithError, match="max_new_tokens must be a whole number, got"):
            run()


def test_token_ids_of_numpy_tensor_and_tuple_types_decode(pair):
    import numpy as np

    target, _ = pair
    want = generate(target, [[1, 2, 3]], 3)
    assert generate(target, [np.array([1, 2, 3])], 3) == want
    assert generate(target, [torch.tensor([1, 2, 3])], 3) == want
    assert generate(target, [(1, np.int64(2), 3)], 3, eos_ids=(np.int64(500),)) == want


def test_an_empty_list_of_settings_is_refused_not_read_as_the_default(pair):
    """params=[] sampled every prompt with the decoder's own setting."""
    dec = _decoder(pair)
    with pytest.raises(DraftsmithError, match="0 sampling settings for 1 prompts"):
        dec.generate([[1, 2]], 3, [], params=[])
    with pytest.raises(DraftsmithError, match="0 sampling settings for 1 prompts"):
        dec.start([[1, 2]], 3, [], params=[])
    with pytest.raises(DraftsmithError, match="2 sampling settings for 1 prompts"):
        dec.generate([[1, 2]], 3, [], params=[SamplingParams()] * 2)
    rt = Runtime(pair[0], 2, 64, graphs=False)
    state, _ = refill.prepare(rt, 2, 3, [], SamplingParams())
    with pytest.raises(DraftsmithError, match="0 sampling settings for 1 rows"):
        state.start([0], [[1, 2]], [])
    assert dec.generate([[1, 2]], 3, []).tokens == run_generation(rt, [[1, 2]], 3).tokens


def test_refill_rows_past_the_runtime_are_refused_by_both_engines(pair):
    """Plain refill quietly lowered rows 4 on a runtime of 2 to 2 while speculative refill
    refused them: both refuse now, naming max_batch, and each still runs rows within it."""
    rt, dec = Runtime(pair[0], 2, 64, graphs=False), _decoder(pair)
    prompts = [[1, 2], [3]]
    calls = [lambda rows: refill.generate_refill(rt, prompts, 3, rows=rows),
             lambda rows: refill.prepare(rt, rows, 3, [], SamplingParams()),
             lambda rows: spec_refill.generate_refill(dec, prompts, 3, rows=rows),
             lambda rows: spec_refill.warm_refill(dec, prompts, rows)]
    for call in calls:
        with pytest.raises(DraftsmithError, match="rows 4 exceed max_batch 2"):
            call(4)
        call(2)
    want = generate(pair[0], prompts, 3)
    assert refill.generate_refill(rt, prompts, 3, rows=2) == want
    assert spec_refill.generate_refill(dec, prompts, 3, rows=2).tokens == want


def _cli(*args: str):
    from draftsmith.cli import app

    return CliRunner().invoke(app, ["generate", *args], catch_exceptions=True)


def test_generate_refuses_to_decode_past_the_targets_positions(tiny_llama_dir, monkeypatch):
    """-n 600 on a 512-position target decoded past its positions without a word (serve refuses
    the same); refused before the weights load."""
    from draftsmith.targets import Target

    def build(*_a, **_k):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(Target, "build", build)
    res = _cli("-p", "hi", "--target", str(tiny_llama_dir), "--device", "cpu", "-n", "600")
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--max-new-tokens = " in str(res.exception)
    assert str(res.exception).endswith("exceeds the target's max_position_embeddings 512")


def test_generate_refuses_a_seed_at_temperature_zero(tmp_path):
    """--seed at temperature 0 drew nothing: refused as --top-k/--top-p are."""
    res = _cli("-p", "hi", "--target", str(tmp_path / "never-loaded"), "--seed", "3")
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--seed applies to sampling" in str(res.exception)
    res = _cli("-p", "hi", "--target", str(tmp_path / "never-loaded"), "--seed", "3",
               "--temperature", "0.7", "--device", "cpu")
    assert "--seed" not in str(res.exception)  # accepted: fails on the missing target instead
    assert "never-loaded" in str(res.exception)
