"""Prompt sources review 4: the shapes people bring (ShareGPT, OpenAI messages, Alpaca,
UltraChat, Parquet, text), and bytes they should not: UTF-16 files (Windows PowerShell's `>`,
Notepad's "Unicode") were read as NUL-laced prompts; JSON Python cannot parse (deep nesting,
an integer of over 4,300 digits) was a traceback; a table's turns holding both key pairs'
columns (the other pair's null) were refused as `unknown from None`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from draftsmith.data.prompts import load_prompts
from draftsmith.errors import DraftsmithError

SHAREGPT = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "hi"},
                              {"from": "gpt", "value": "yo"}]}
OPENAI = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
ALPACA = {"instruction": "do x", "input": "with y", "output": "done"}
ULTRACHAT = {"id": "0", "data": ["u1", "a1", "u2", "a2"]}


def test_every_shape_in_one_file_line_by_line_with_a_bom_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r) for r in (SHAREGPT, OPENAI, ALPACA, ULTRACHAT)]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\n  \n".join([*lines, "plain text", "[1]"]).encode())
    ps = load_prompts(path)
    assert [c.messages[-1]["content"] for c in ps.conversations] == ["yo", "a", "do x\n\nwith y",
                                                                     "a2"]
    assert ps.conversations[0].system() == "S"
    assert ps.problems == [f"{path}:13: not valid JSON (Expecting value)",
                           f"{path}:16: expected a JSON object, got list"]


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl", "p.json", "p.txt.gz"])
@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_or_utf32_text_is_refused_in_one_line_naming_the_file(
        tmp_path: Path, name: str, codec: str) -> None:
    text = "\n".join(json.dumps(r) for r in (OPENAI, ALPACA)) + "\n"
    data = text.encode(codec)
    if codec == "utf-16-be":
        data = b"\xfe\xff" + data
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(DraftsmithError) as e:
        load_prompts(path)
    assert str(e.value) == (f"{path}: UTF-16 or UTF-32 text (it opens with a byte-order mark): "
                            "save it as UTF-8")


DEEP = '{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG_INT = '{"prompt": "a", "x": ' + "9" * 5000 + "}"


@pytest.mark.parametrize(("line", "why"), [
    (DEEP, "not valid JSON (it nests arrays or objects too deeply)"),
    (LONG_INT, "not valid JSON (an integer of over 4300 digits)")], ids=["deep", "long-int"])
def test_json_python_cannot_parse_is_a_record_named_at_its_line(
        tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "first"}}\n{line}\n{{"prompt": "last"}}\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["first", "last"]
    assert ps.problems == [f"{path}:2: {why}"]
    with pytest.raises(DraftsmithError, match=f"^{path}:2: "):
        load_prompts(path, strict=True)
    whole = tmp_path / "p.json"
    whole.write_text(f"[{line}]")
    with pytest.raises(DraftsmithError) as e:
        load_prompts(whole)
    assert str(e.value) == f"{whole}: {why}"


def test_a_table_whose_turns_hold_both_key_pairs_reads_each_by_its_own(tmp_path: Path) -> None:
    """Arrow unifies the turns' structs of a merged dataset: a ShareGPT turn gets null
    `role`/`content`, an OpenAI one null `from`/`value`."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"conversations": [{"role": "user", "content": "q"}]},
            {"conversations": [{"from": None, "value": "x"}]}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ps = load_prompts(path)
    assert [c.messages for c in ps.conversations] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        [{"role": "user", "content": "q"}]]
    assert ps.problems == [f"{path} row 3: message 0: unknown from None"]


class _DatasetDict(dict):
    pass


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, splits: dict[str, list]) -> None:
    """A stand-in `datasets` (the package is optional): load_from_disk gives `splits`."""
    import sys
    import types

    mod = types.ModuleType("datasets")
    mod.DatasetDict = _DatasetDict  # type: ignore[attr-defined]
    mod.load_from_disk = lambda path: _DatasetDict(splits)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", mod)


@pytest.mark.parametrize(("splits", "read"), [
    ({"test": [{"prompt": "t"}], "train": [{"prompt": "r"}]}, ["r"]),
    ({"train_sft": [{"prompt": "s"}]}, ["s"])], ids=["train", "only"])
def test_a_saved_dataset_dict_reads_its_train_or_only_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, splits: dict, read: list) -> None:
    _fake_datasets(monkeypatch, splits)
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    ps = load_prompts(tmp_path)
    assert [c.first_user() for c in ps.conversations] == read
    assert ps.problems == []


def test_a_saved_dataset_dict_of_splits_and_no_train_is_refused_naming_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It read whichever split was saved first: a test split as readily as a training one."""
    _fake_datasets(monkeypatch, {"test_sft": [{"prompt": "t"}], "train_sft": [{"prompt": "s"}]})
    (tmp_path / "dataset_dict.json").write_text("{}")
    with pytest.raises(DraftsmithError) as e:
        load_prompts(tmp_path)
    assert str(e.value) == (f"{tmp_path}: a DatasetDict of splits test_sft, train_sft and no "
                            f"'train': give the folder of the split to read ({tmp_path}/test_sft)")


def test_a_saved_dataset_dict_of_no_split_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a RuntimeError (StopIteration inside the row generator)."""
    _fake_datasets(monkeypatch, {})
    (tmp_path / "dataset_dict.json").write_text("{}")
    with pytest.raises(DraftsmithError) as e:
        load_prompts(tmp_path)
    assert str(e.value) == f"{tmp_path}: a DatasetDict of no split: it holds no prompts"
