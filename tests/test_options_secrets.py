"""The records a run keeps (make.json's commands) never hold a server's key."""

from __future__ import annotations

import sys

import pytest

from draftsmith.options import command_line


@pytest.mark.parametrize("argv, want", [
    (["data", "make", "d", "--api-key", "sk-123", "--n", "4"],
     "draftsmith data make d --api-key '***' --n 4"),
    (["data", "make", "d", "--api-key=sk-123"], "draftsmith data make d '--api-key=***'"),
    (["data", "make", "d", "--n", "4"], "draftsmith data make d --n 4"),
])
def test_the_key_is_not_recorded(monkeypatch, argv: list[str], want: str) -> None:
    monkeypatch.setattr(sys, "argv", ["draftsmith", *argv])
    assert command_line() == want
    assert "sk-123" not in command_line()
