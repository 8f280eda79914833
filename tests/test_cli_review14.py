"""Command line, fourteenth review: `--version`, and list flags given with spaces."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from test_cli_review import run_main
from test_cli_review2 import error_of

import draftsmith.bench.allreduce as allreduce
from draftsmith.errors import DraftsmithError
from draftsmith.options import int_list


def test_version_prints_the_installed_version_and_exits_0(monkeypatch, capsys):
    """`draftsmith --version` was "No such option: --version", exit 2."""
    code, out, err = run_main(monkeypatch, capsys, "--version")
    assert (code, out, err) == (0, f"draftsmith {version('draftsmith')}\n", "")


def test_top_level_help_names_the_version_flag(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "--help")
    assert code == 0 and "--version" in out


@pytest.mark.parametrize(("text", "fix"), [("1 4", "1,4"), ("1;4", "1,4"), (" 1, 4 8", "1,4,8"),
                                           ("2\t3", "2,3")])
def test_a_list_split_by_spaces_or_semicolons_says_to_use_commas(text, fix):
    """`--steps "1 4"` said "must be whole numbers >= 1, got '1 4'": both are whole numbers, and
    nothing said the list wants commas."""
    with pytest.raises(DraftsmithError) as e:
        int_list(text, "--steps")
    assert str(e.value).endswith(f": separate values with commas, as --steps {fix}")


def test_a_bad_list_item_alone_gets_no_comma_hint():
    with pytest.raises(DraftsmithError) as e:
        int_list("1.5", "--steps")
    assert "commas" not in str(e.value)


def test_a_spaced_list_flag_is_one_line_naming_it_before_any_rank(monkeypatch, capsys):
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("ranks started")))
    said = error_of(monkeypatch, capsys, "bench-allreduce", "--device", "cpu", "--tp", "1",
                    "--batch", "1 4")
    assert said.startswith("--batch must be whole numbers >= 1, got '1 4'")
    assert said.endswith("separate values with commas, as --batch 1,4")
