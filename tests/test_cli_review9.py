"""Fifth CLI review: values parsed loosely at the command line and in the environment, and a
ctrl-C before a command starts."""

from __future__ import annotations

import sys

import pytest

from draftsmith.errors import DraftsmithError


@pytest.fixture
def two_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("device", ["cuda:01", "cuda:00", "cuda:²", "cuda:١"])
def test_a_device_index_torch_refuses_is_refused_up_front(two_gpus, device):
    """torch refuses `cuda:01` ("Invalid device string") after loading; `cuda:²` passed
    isdigit and was a ValueError traceback from int()."""
    from draftsmith.cli import pick_device

    with pytest.raises(DraftsmithError, match="use cpu, cuda, cuda:N or auto"):
        pick_device(device)
    assert pick_device("cuda:1") == "cuda:1" and pick_device("cuda:0") == "cuda:0"


@pytest.mark.parametrize("read", ["env_count", "env_pow2"])
def test_a_count_switch_of_non_ascii_digits_is_refused_by_name(monkeypatch, read):
    """`²` passed isdigit, then int() raised a ValueError traceback at import."""
    from draftsmith import switches

    monkeypatch.setenv("DRAFTSMITH_TEST_SWITCH", "²")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_TEST_SWITCH="):
        getattr(switches, read)("DRAFTSMITH_TEST_SWITCH", "1")


def test_assignment_switch_takes_none_in_any_case(monkeypatch):
    """env_choice ignores case; `NONE` here was refused as a key=value."""
    from draftsmith.switches import env_assignments

    monkeypatch.setenv("DRAFTSMITH_TEST_SWITCH", " None ")
    assert env_assignments("DRAFTSMITH_TEST_SWITCH", "a=1") == {}


def test_a_list_item_with_an_underscore_is_refused():
    """int() reads `1_2` as 12: `--batch-sizes 1_2` ran batch 12 (as `1 2` once did)."""
    from draftsmith.options import int_list

    with pytest.raises(DraftsmithError, match="got '1_2'"):
        int_list("1_2", "--batch-sizes")
    assert int_list("+3, 4", "--steps") == [3, 4]


def test_ctrl_c_before_the_command_starts_exits_130_in_one_line(monkeypatch, capsys):
    """A ctrl-C while the engine imports (seconds) was a traceback; inside a command typer
    already exits 130."""
    from draftsmith import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_register", interrupted)
    monkeypatch.setattr(sys, "argv", ["draftsmith", "generate"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == "draftsmith: interrupted\n"


def test_a_bad_pair_split_at_semicolons_says_semicolons(monkeypatch):
    """The refusal said "pairs split by commas" where the value split at `;`."""
    from draftsmith.switches import env_assignments

    monkeypatch.setenv("DRAFTSMITH_TEST_SWITCH", "a=1,2;b")
    with pytest.raises(DraftsmithError, match="pairs split by semicolons"):
        env_assignments("DRAFTSMITH_TEST_SWITCH", "none")
