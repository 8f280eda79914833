"""Review of small mends: a damaged training-log line names what to do, and `bench --help`
names the --suite value in words, not as a Python type."""

from __future__ import annotations

import json

import pytest
from test_cli_review import run_main

from draftsmith.errors import DraftsmithError
from draftsmith.train import report


def test_a_damaged_log_line_says_how_to_go_on(tmp_path):
    """It said only "line 2 is not a JSON row": not which file to mend, how, or what is lost."""
    rows = [json.dumps({"step": 1, "loss": 1.0}), "{not json", json.dumps({"step": 2})]
    (tmp_path / report.LOG).write_text("\n".join(rows) + "\n")
    with pytest.raises(DraftsmithError) as e:
        report.read_log(tmp_path)
    said = str(e.value)
    assert "\n" not in said
    assert said.startswith(f"{tmp_path / report.LOG}: line 2 is not a JSON row; ")
    assert "delete or repair line 2" in said and "checkpoints" in said


def test_a_log_cut_short_in_its_last_line_still_reads(tmp_path):
    """The mend names the damaged line only: a last line cut short (a run killed) is left out."""
    (tmp_path / report.LOG).write_text(json.dumps({"step": 1}) + "\n{\"step\": 2, \"lo")
    assert report.read_log(tmp_path) == [{"step": 1}]


def test_bench_help_names_a_suites_value_in_words(monkeypatch, capsys):
    """`bench --help` showed `--suite <list[str]>`, a Python type, for one suite name or file."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_main(monkeypatch, capsys, "bench", "--help")
    assert code == 0 and "--suite <name|file>" in out and "list[str]" not in out


def test_the_damaged_line_is_numbered_as_an_editor_numbers_it(tmp_path):
    """Blank lines were not counted, so "line 2" sent the user to delete a good row."""
    rows = [json.dumps({"step": 1}), "", "{not json", json.dumps({"step": 2}), ""]
    (tmp_path / report.LOG).write_text("\n".join(rows) + "\n")
    with pytest.raises(DraftsmithError, match=r": line 3 is not a JSON row; delete or repair "
                       r"line 3 "):
        report.read_log(tmp_path)
def test_a_dataset_with_no_shards_says_what_to_do(tmp_path):
    """It said only "the dataset has no finished shards": not how to get some."""
    from draftsmith.train.sources import check_whole
    with pytest.raises(DraftsmithError) as e:
        check_whole(tmp_path, {"shards": [], "complete": True}, None)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"{tmp_path}: the dataset has no finished shards; ")
    assert f"draftsmith data capture CONVERSATIONS.jsonl --out {tmp_path}" in said


@pytest.mark.parametrize("command,shown", [("bench-allreduce", "--nccl <NAME=VALUE>"),
                                           ("compare", "--claimed <NAME=COUNT>")])
def test_repeatable_options_show_their_value_in_words(command, shown):
    from typer.testing import CliRunner

    from draftsmith.cli import _register, app

    _register()  # as main() does: alone in a worker, no earlier test has registered the commands
    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    line = next(ln for ln in out.splitlines() if shown.split()[0] + " " in ln)
    assert shown in line and "list[str]" not in line
