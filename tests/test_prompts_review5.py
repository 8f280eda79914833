"""Prompt sources, review 5: a .txt file of CR-only line ends (an old Mac export) was read as
one prompt, and self-made prompts' --min-chars counted the opening the target was given, so a
question the target wrote a word of passed."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from draftsmith.data.prompts import load_prompts
from draftsmith.data.selfmade import MagpieConfig, _one


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("name", ["p.txt", "p.txt.gz"])
def test_text_prompts_are_one_a_line_whatever_the_line_end(tmp_path: Path, end: bytes,
                                                           name: str) -> None:
    body = end.join([b"first prompt", b"", b"  second  ", b"third"]) + end
    path = tmp_path / name
    path.write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["first prompt", "second", "third"]
    assert ps.problems == []


def test_a_cr_only_text_file_names_a_bad_line_by_its_number(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfone\r\xff bad\rthree\r\nfour\nfive")
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["one", "three", "four", "five"]
    assert ps.problems == [f"{path}:2: not UTF-8 text (byte 0)"]


def _made(target, opening: str, more: str, cfg: MagpieConfig) -> tuple[str | None, dict]:
    tok = target.tokenizer
    start = tok(opening, add_special_tokens=False)["input_ids"]
    toks = tok(opening + more, add_special_tokens=False)["input_ids"][len(start):]
    stats = {"bare_openings": 0, "duplicates": 0, "length_filtered": 0, "unfinished": 0}
    return _one(target, toks, cfg, set(), stats, opening, start), stats


def test_min_chars_counts_what_the_target_wrote_not_its_opening(target) -> None:
    cfg = MagpieConfig(min_chars=12)
    got, stats = _made(target, "Write a Python function that", " sorts", cfg)
    assert got is None and stats["length_filtered"] == 1
    got, stats = _made(target, "Write a Python function that", " sorts a list of ints", cfg)
    assert got == "Write a Python function that sorts a list of ints"
    got, _ = _made(target, "", "sorts a list", cfg)  # no opening: the whole question
    assert got == "sorts a list"


def test_max_chars_still_counts_the_whole_prompt(target) -> None:
    cfg = MagpieConfig(min_chars=3, max_chars=30)
    got, stats = _made(target, "Write a Python function that", " sorts", cfg)
    assert got is None and stats["length_filtered"] == 1


@pytest.mark.parametrize("name", ["p.jsonl", "p.json"])
def test_cr_only_json_lines_are_refused_in_one_line_not_skipped_as_one(tmp_path: Path,
                                                                       name: str) -> None:
    """Read as one line, the file was one malformed record skipped: no prompt, and a warning
    of "Extra data" that did not say why."""
    from draftsmith.errors import DraftsmithError

    path = tmp_path / name
    path.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r')
    with pytest.raises(DraftsmithError, match=rf"^{path}:1: its lines end in CR alone \(an old "
                       r"Mac export\): save it with LF or CRLF line ends$"):
        load_prompts(path)


def test_a_cr_inside_a_json_line_is_whitespace_still(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt":\r "a"}\n{"prompt": "b"}\r\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["a", "b"] and ps.problems == []
