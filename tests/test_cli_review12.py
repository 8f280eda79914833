"""Command line, twelfth review: a new user's view of `draftsmith demo` and `generate --help`."""

from __future__ import annotations

from test_cli_review import run_main
from test_cli_review2 import error_of

import draftsmith.demo as demo_mod


def test_demo_refuses_a_mistyped_target_by_flag_before_any_stage(monkeypatch, capsys,
                                                                 tmp_path):
    """`demo --target nope` started the data stage and made --out, then said only
    "nope: no such file or folder", naming no flag."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: (_ for _ in ()).throw(
        AssertionError("a stage ran")))
    assert error_of(monkeypatch, capsys, "demo", "--target", "nope", "--out", "o",
                    "--device", "cpu") == (
        "--target nope: no such file or folder; give an HF folder, a .gguf file or 'default'")
    assert not (tmp_path / "o").exists()


def test_demo_slowdown_note_counts_one_epoch_and_one_conversation(monkeypatch):
    """The CPU demo's note read "(2 conversations, 1 epochs)" after `--epochs 1`, and "guesses
    1 tokens" after `--steps 1`."""
    report = {"target": "default", "config": {"conversations": "1", "epochs": "1"},
              "bench": {"device": "cpu", "steps": 3, "baseline_tok_s": 16.7, "speedup": 0.7,
                        "accept_length": 1.1, "phases_ms": {"verify": 118.2}}}
    note = demo_mod.slowdown_note(report)
    assert note is not None and "(1 conversation, 1 epoch)" in note
    report["bench"]["steps"] = 1  # `--steps 1` read "guesses 1 tokens"
    assert "the drafter guesses 1 token and the target checks 2" in (
        demo_mod.slowdown_note(report) or "")
    report["config"] = {"conversations": "48", "epochs": "3"}
    assert "(48 conversations, 3 epochs)" in (demo_mod.slowdown_note(report) or "")


def test_generate_help_names_a_prompts_value_as_text(monkeypatch, capsys):
    """`generate --help` showed `-p, --prompt <list[str]>`, a Python type, for one message."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_main(monkeypatch, capsys, "generate", "--help")
    assert code == 0 and "-p, --prompt <text>" in out and "list[str]" not in out
