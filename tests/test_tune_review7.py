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
