"""bench review 21: an option given twice (click keeps the last of a scalar, silently)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from draftsmith import cli as cli_mod
from draftsmith.bench import run as run_mod
from draftsmith.errors import DraftsmithError
from draftsmith.models import eagle3


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any loading or timing fails the test: a refusal comes before all of it."""
    def ran(*_a, **_k):
        pytest.fail("bench ran")
    monkeypatch.setattr(run_mod, "run_bench", ran)
    monkeypatch.setattr(eagle3, "check_drafter", ran)
    cli_mod._register()


def _invoke(*args: str):
    return CliRunner().invoke(cli_mod.app, ["bench", *args])


def test_a_drafter_given_twice_is_refused_naming_compare(nothing_runs, tmp_path):
    """`bench --drafter A --drafter B` timed B alone, A dropped without a word."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    got = _invoke("--drafter", a, "--drafter", b, "--device", "cpu")
    assert isinstance(got.exception, DraftsmithError), got.output
    assert str(got.exception) == (
        f"--drafter given 2 times ({a}, {b}): bench times one drafter against the baseline; "
        f"give one, or set drafters side by side with `draftsmith compare {a} {b}`")


def test_the_user_sees_the_drafter_line_from_the_entry_point(nothing_runs, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["draftsmith", "bench", "--drafter", "random", "--drafter",
                                     "random", "--device", "cpu"])
    with pytest.raises(SystemExit) as stop:
        cli_mod.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("draftsmith: error: --drafter given 2 times (random, random): ")


def test_a_target_given_twice_is_refused_by_name(nothing_runs):
    got = _invoke("--drafter", "random", "--target", "tiny", "--target", "default")
    assert isinstance(got.exception, DraftsmithError), got.output
    assert str(got.exception) == ("--target given 2 times (tiny, default): bench times one "
                                  "target; give --target once")


@pytest.mark.parametrize(("flag", "field"), [
    ("--steps", "steps"), ("--topk", "topk"), ("--batch-size", "batch_sizes"),
    ("--batch-sizes", "batch_sizes"), ("--num-draft-tokens", "num_draft_tokens")])
def test_a_list_option_given_twice_means_both_lists(monkeypatch, flag, field):
    """`--steps 1 --steps 3` timed steps 3 alone: a comma-list option repeated adds its values,
    as --suite does."""
    seen = []

    def record(cfg, log):
        seen.append(cfg)
        raise RuntimeError("stop before loading")
    monkeypatch.setattr(run_mod, "run_bench", record)
    cli_mod._register()
    args = ["--drafter", "random", "--device", "cpu", "--target", "tiny", "-o", "/nonexistent/x"]
    args += ["--topk", "4", "--steps", "3"] if flag == "--num-draft-tokens" else []
    args += ["--num-draft-tokens", "8"] if flag == "--topk" else []
    assert isinstance(_invoke(*args, flag, "1,2", flag, "3").exception, RuntimeError)
    assert getattr(seen[0], field) == [1, 2, 3]


def test_the_help_is_unchanged_by_the_repeat_checks(nothing_runs):
    out = " ".join(CliRunner().invoke(cli_mod.app, ["bench", "--help"]).output.split())
    assert "--drafter <str>" in out and "--target <str>" in out and "--steps <str>" in out
    assert "list[str]" not in out and "[default: default]" in out and "[default: 1,3,5]" in out


def test_a_long_progress_line_is_printed_whole(monkeypatch):
    """The log went through rich at the terminal's width: a warning read "... measures the
    machinery \\nonly" in a redirected stderr, one line cut in two."""
    said = "warning: " + ("a long line of words " * 8).strip()

    def run(cfg, log):
        log(said)
        raise RuntimeError("stop before loading")
    monkeypatch.setattr(run_mod, "run_bench", run)
    monkeypatch.setenv("COLUMNS", "80")
    cli_mod._register()
    got = _invoke("--drafter", "random", "--device", "cpu", "-o", "/nonexistent/x")
    assert said in got.stderr.splitlines()
