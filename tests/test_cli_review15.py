"""Command line, fifteenth review: a single-value option given twice (click kept the last)."""

from __future__ import annotations

import pytest
from test_cli_review import run_main
from test_cli_review2 import NEVER, error_of


@pytest.mark.parametrize(("args", "said"), [
    (["generate", "-p", "hi", "--target", "a", "--target", "b"],
     "--target given 2 times (a, b): give it once"),
    (["tune", "--drafter", "A", "--drafter", "B"], "--drafter given 2 times (A, B): give it once"),
    (["serve", "--target", NEVER, "--port", "1", "--port", "2"],
     "--port given 2 times (1, 2): give it once"),
    (["bench", "--drafter", "random", "--target", NEVER, "--num-prompts", "4", "--num-prompts",
      "8"],
     "--num-prompts given 2 times (4, 8): give it once"),
    (["generate", "-p", "hi", "-n", "4", "--max-new-tokens=8", "-n5"],
     "--max-new-tokens given 3 times (4, 8, 5): give it once"),
    (["data", "capture", "P", "-o", "a", "-o", "b"], "--out given 2 times (a, b): give it once"),
])
def test_a_single_value_option_given_twice_is_refused_before_the_command(
        monkeypatch, capsys, tmp_path, args, said):
    """`serve --port 1 --port 2` served on 2 without a word: click keeps the last value."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, *args, "--device", "cpu") == said
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_a_flag_given_both_ways_is_refused_naming_both(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "serve", "--target", NEVER, "--warmup", "--no-warmup")
    assert said == "--warmup and --no-warmup both given: give one of them"


def test_a_flag_given_twice_the_same_way_means_once(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "generate", "-p", "hi", "--json", "--json", "--target",
                    NEVER, "--device", "cpu", "--temperature", "0", "--top-k", "3")
    assert said.startswith("--top-k")  # the command's own check ran: no repeat refused


def test_list_options_still_add_their_repeats(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "generate", "-p", "a", "-p", "b", "--target", NEVER,
                    "--device", "cpu", "--temperature", "0", "--top-k", "3")
    assert said.startswith("--top-k")


def test_bench_keeps_its_own_drafter_line(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "bench", "--drafter", "random", "--drafter", "random",
                    "--target", NEVER)
    assert said.startswith("--drafter given 2 times (random, random): bench times one drafter")


def test_a_secret_given_twice_is_not_echoed(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "data", "regenerate", "P", "-o", "a.jsonl",
                    "--api-key", "sk-one", "--api-key=sk-two", "--base-url",
                    "http://u:pw@h/v1", "--base-url", "http://h/v1")
    assert said == "--api-key given 2 times (***, ***): give it once"
    assert "sk-" not in said


def test_a_url_given_twice_is_shown_without_its_password(monkeypatch, capsys):
    said = error_of(monkeypatch, capsys, "data", "regenerate", "P", "-o", "a.jsonl",
                    "--base-url", "http://u:pw@h/v1", "--base-url", "http://h/v1")
    assert said == "--base-url given 2 times (http://u:***@h/v1, http://h/v1): give it once"


def test_help_still_shows_with_a_repeat(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "serve", "--target", NEVER, "--port", "1",
                            "--port", "2", "--help")
    assert code == 0 and "--port" in out
