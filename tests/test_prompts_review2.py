"""Files edited on Windows begin with a UTF-8 BOM. A regenerate or self-made output JSONL that
held only a BOM (an "empty" file saved by an editor), a BOM and a blank line, or a BOM ahead of
a first record a kill tore, stopped every rerun as "not valid JSON" at line 1."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import pytest

from draftsmith.data.prompts import appended_records

REC = {"id": "a", "messages": [{"role": "user", "content": "hi"}], "meta": {"prompt_id": "a"}}
LINE = json.dumps(REC).encode()


def test_a_whole_first_record_behind_a_bom_is_read(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    out.write_bytes(codecs.BOM_UTF8 + LINE + b"\n")
    assert appended_records(out) == ([(1, REC)], False)


@pytest.mark.parametrize("body", [b"", b"\n", b"\r\n", b"  "])
def test_a_bom_without_records_is_an_empty_file(tmp_path: Path, body: bytes) -> None:
    out = tmp_path / "a.jsonl"
    out.write_bytes(codecs.BOM_UTF8 + body)
    assert appended_records(out)[0] == []


def test_a_torn_first_record_behind_a_bom_is_cut(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    out.write_bytes(codecs.BOM_UTF8 + LINE[:20])
    assert appended_records(out) == ([], True)
    assert out.read_bytes() == b""


def test_a_whole_unended_first_record_behind_a_bom_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    out.write_bytes(codecs.BOM_UTF8 + LINE)
    assert appended_records(out) == ([(1, REC)], True)
    assert out.read_bytes() == codecs.BOM_UTF8 + LINE + b"\n"


def peak(fn, *args) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_json_lines_under_a_json_name_are_not_read_whole(tmp_path: Path) -> None:
    """Such a file (as many datasets ship) was read and decoded whole, parsed up to its second
    line, then read again line by line: a multi-GB one held twice its size at once."""
    from draftsmith.data.prompts import load_prompts

    path = tmp_path / "data.json"
    line = json.dumps({"prompt": "q" * 2000}) + "\n"
    path.write_bytes(codecs.BOM_UTF8 + (line * 2000).encode())  # duplicates: kept once
    size = path.stat().st_size
    ps = load_prompts(path)
    assert len(ps.conversations) == 1 and ps.duplicates == 1999 and not ps.problems
    assert peak(load_prompts, path) < size / 4


def test_a_json_array_is_parsed_without_its_bytes_held(tmp_path: Path) -> None:
    """The file's bytes, its text and the parsed records were held at once: three copies."""
    from draftsmith.data.prompts import load_prompts

    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "x" * 2_000_000}, {"prompt": "y" * 2_000_000}]))
    assert len(load_prompts(path).conversations) == 2
    assert peak(load_prompts, path) < 2.5 * path.stat().st_size
