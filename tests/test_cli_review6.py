"""Command-line review, sixth pass: generate's --drafter help says what it does; a --seed
torch cannot take is refused by flag."""

from __future__ import annotations

import inspect

import pytest
from test_cli_review import run_main

from draftsmith.options import SEEDS, check_seed


def test_generate_drafter_help_does_not_call_speculative_decoding_greedy_only():
    """It read "speculative decoding (greedy, the same text as without it)", but --temperature
    samples through the drafter too (a user took --temperature to be ignored with it)."""
    from draftsmith.cli import generate

    words = inspect.signature(generate).parameters["drafter"].default.help
    assert "greedy: the same text as without it" in words and "--temperature" in words


@pytest.mark.parametrize("seed", [str(1 << 64), str(-(1 << 63) - 1)])
def test_generate_refuses_a_seed_torch_cannot_take_before_loading(monkeypatch, capsys, seed):
    """torch.manual_seed's overflow was a traceback after the target had loaded."""
    code, _, err = run_main(monkeypatch, capsys, "generate", "-p", "hi", "--target", "/nowhere",
                            "--device", "cpu", "--temperature", "1", "--seed", seed)
    assert (code, err.strip()) == (2, "draftsmith: error: --seed must be from -2**63 to "
                                      f"2**64 - 1, got {seed}")


def test_the_seeds_torch_takes_pass():
    import torch

    for seed in SEEDS:
        check_seed(seed)
        torch.manual_seed(seed)
    check_seed(None)
