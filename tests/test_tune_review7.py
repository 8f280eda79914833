"""tune --prompts takes the suite names bench takes."""

from pathlib import Path

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cli import suite


def test_tune_prompts_chat_is_the_built_in_suite(tmp_path, monkeypatch):
    """`tune --prompts chat` read a file named chat (missing: an error), where bench's and
    compare's `chat` is the built-in suite."""
    monkeypatch.chdir(tmp_path)
    assert suite(Path("chat")) == suite(None) and len(suite(None)) > 4
    (tmp_path / "chat").write_text('{"prompt": "hi"}\n')
    with pytest.raises(DraftsmithError, match="'chat' names both the built-in chat suite"):
        suite(Path("chat"))


def test_tune_num_prompts_takes_the_first_n(tmp_path):
    """tune had no --num-prompts (bench and compare have one): the whole 22-prompt chat suite
    ran every time, minutes on a CPU."""
    import torch
    from test_tune_cli import _tiny_pair

    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 3, 1, "cpu", torch.float32,
                      False, tmp_path / "tune", max_topk=1, max_draft=2, num_prompts=2)
    assert len(report["prompt_acceptance"]) == 2


def test_tune_refuses_a_negative_num_prompts(tmp_path):
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune.cli import tune

    app = typer.Typer()
    app.command()(tune)
    res = CliRunner().invoke(app, ["--drafter", str(tmp_path), "--num-prompts", "-1"])
    assert isinstance(res.exception, DraftsmithError)
    assert str(res.exception).startswith("--num-prompts must be >= 0")
