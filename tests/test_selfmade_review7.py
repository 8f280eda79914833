"""Self-made prompts and prompt files, review 7: a CSV or TSV prompt file (awesome-chatgpt-prompts'
`act,prompt`, an Alpaca export) was read as JSON Lines, every row refused as "not valid JSON";
a text file's line of only Unicode whitespace (a no-break or ideographic space) was warned
about as a malformed record instead of skipped as blank."""

from __future__ import annotations

import codecs
import csv
import gzip
from pathlib import Path

import pytest

from draftsmith.data.prompts import load_prompts
from draftsmith.errors import DraftsmithError


def _texts(path: Path) -> list[str]:
    return [c.messages[-1]["content"] for c in load_prompts(path, strict=True).conversations]


def test_a_csv_is_read_by_its_header_quoted_newlines_and_commas_kept(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_bytes(codecs.BOM_UTF8 + b'act,prompt\r\nLinux Terminal,"Act as a terminal, '
                     b'please"\r\nPoet,"Write\r\na poem"\r\n')
    assert _texts(path) == ["Act as a terminal, please", "Write\r\na poem"]
    (tmp_path / "paragraphs.csv").write_text('prompt\n"one\n\n\ntwo"\n\nthree\n')
    assert _texts(tmp_path / "paragraphs.csv") == ["one\n\n\ntwo", "three"]


def test_an_alpaca_csv_and_a_gzipped_tsv(tmp_path: Path) -> None:
    alpaca = tmp_path / "alpaca.csv"
    alpaca.write_text("instruction,input,output\ndo x,with y,done\ndo z,,ok\n")
    assert _texts(alpaca) == ["do x\n\nwith y", "do z"]
    tsv = tmp_path / "p.tsv.gz"
    tsv.write_bytes(gzip.compress(b"prompt\nuno\n\ndos, tres\n"))
    assert _texts(tsv) == ["uno", "dos, tres"]


def test_a_bad_csv_row_is_named_by_its_row(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text("act,prompt\nA,first\nB,\nC,third,extra\nD,first\n")
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["first"]
    assert ps.duplicates == 1
    assert ps.problems[0] == f"{path} row 2: 'prompt' is not a non-empty string"
    assert ps.problems[1] == (f"{path} row 3: 3 cells, the header names 2 columns: quote a "
                              "cell that holds the delimiter")


def test_a_huge_csv_field_is_read_whole(tmp_path: Path) -> None:
    big = "x" * (csv.field_size_limit() + 10)
    path = tmp_path / "p.csv"
    path.write_text(f"prompt\n{big}\nsmall\n")
    assert _texts(path) == [big, "small"]
    assert csv.field_size_limit() < len(big)  # the module's limit left as it was


@pytest.mark.parametrize("data, said", [
    ("prompt\ncafé\n".encode("cp1252"), ":2: not UTF-8 text (byte 3): save it as UTF-8"),
    (codecs.BOM_UTF16_LE + "prompt\nhi\n".encode("utf-16-le"), ": UTF-16 or UTF-32 text"),
])
def test_a_csv_not_in_utf8_is_refused_in_one_line(tmp_path: Path, data: bytes,
                                                  said: str) -> None:
    path = tmp_path / "excel.csv"
    path.write_bytes(data)
    with pytest.raises(DraftsmithError) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}{said}") and "\n" not in str(e.value)


def test_a_text_line_of_unicode_whitespace_is_blank(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("\u00a0\nhi\n\u3000 \n")
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["hi"] and ps.problems == []


@pytest.mark.parametrize("text, line, why", [
    ('prompt\n"open quote\nsecond\nthird\n', 4, "unexpected end of data"),
    ('prompt\n"a"b\nc\n', 2, "',' expected after '\"'"),
])
def test_a_quote_left_open_is_refused_not_read_to_the_end(tmp_path: Path, text: str, line: int,
                                                          why: str) -> None:
    path = tmp_path / "q.csv"
    path.write_text(text)
    with pytest.raises(DraftsmithError) as e:
        load_prompts(path)
    assert str(e.value) == f"{path}:{line}: not valid CSV ({why}): mend the quotes up to this line"


def test_quotes_inside_a_field_are_text(tmp_path: Path) -> None:
    path = tmp_path / "q.csv"
    path.write_text('prompt\nsay "hi" now\n"a ""quoted"" word"\n')
    assert _texts(path) == ['say "hi" now', 'a "quoted" word']


def test_greedy_self_made_prompts_past_one_per_opening_are_refused_up_front() -> None:
    """At --temperature 0 every row of a start decodes alike: a run of --self-made 4 spun its 20
    rounds for 1 prompt (79 duplicates), then advised another --seed, which greedy ignores."""
    from draftsmith.data.selfmade import MagpieConfig

    with pytest.raises(DraftsmithError) as e:
        MagpieConfig(n=4, temperature=0.0)
    assert str(e.value) == (
        "self-made prompts: at --temperature 0 (greedy) the target asks one question per "
        "opening (1: no --openings), not 4: sample with --temperature > 0, or ask for at most 1")
    with pytest.raises(DraftsmithError, match=r"one question per opening \(2: --openings\), "
                       "not 3"):
        MagpieConfig(n=3, temperature=0.0, openings=("A", "B", "A"))
    assert MagpieConfig(n=2, temperature=0.0, openings=("A", "B")).n == 2
    assert MagpieConfig(n=1, temperature=0.0).n == 1


def test_a_greedy_run_decodes_each_opening_once(target, model, tmp_path: Path,
                                                monkeypatch) -> None:
    """Greedy rows that failed (here every one unfinished) failed alike each round: a run of
    --self-made 1 decoded 20 rounds of the same row before it said so."""
    from test_selfmade_review6 import _engine

    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts

    spent = _engine(monkeypatch, target, ["a question that runs on and on"], 4)
    said: list[str] = []
    cfg = MagpieConfig(n=1, batch_size=1, max_new_tokens=4, temperature=0.0)
    stats = self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False,
                              log=said.append)
    assert len(spent) == 1 and stats["kept"] == 0 and stats["unfinished"] == 1
    assert said[0].startswith("prompts: warning: only 0 of 1 unique prompts after 1 rounds of 1")
    three = MagpieConfig(n=3, batch_size=2, max_new_tokens=4, temperature=0.0,
                         openings=("A", "B", "C"))
    spent = _engine(monkeypatch, target, ["runs on and on"] * 2, 4)
    self_made_prompts(target, tmp_path / "q.jsonl", three, model, progress=False,
                      log=said.append)
    assert len(spent) == 2  # rounds 0 and 1 start A, B, then C, A: every opening once
