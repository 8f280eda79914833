"""Review 14 of prompt sources: a missing file named by the flag that gave it, HumanEval read
from a file as the bundled one is read, and plain text prompt files."""

from __future__ import annotations

import gzip
import json

import pytest

from draftsmith.data.prompts import load_prompts, read_humaneval, read_prompts
from draftsmith.errors import DraftsmithError

# --- the flag that named a prompt file --------------------------------------------------------


def test_a_missing_prompt_file_is_named_by_its_flag(tmp_path):
    """`bench --suite /x.jsonl` said "/x.jsonl: no such file or folder", not which flag."""
    missing = tmp_path / "x.jsonl"
    with pytest.raises(DraftsmithError, match=rf"^--suite {missing}: no such file or folder$"):
        read_prompts(missing, flag="--suite")
    with pytest.raises(DraftsmithError, match=rf"^{missing}: no such file or folder$"):
        load_prompts(missing)  # no flag: as before


def test_a_bad_prompt_file_is_named_by_its_flag(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[{")
    with pytest.raises(DraftsmithError, match=rf"^--prompts {bad}:1: not valid JSON"):
        load_prompts(bad, flag="--prompts")
    with pytest.raises(DraftsmithError, match=r"^--prompts: an empty prompt source"):
        load_prompts(" ", flag="--prompts")


# --- HumanEval from a file --------------------------------------------------------------------

HE = {"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Twice x.\"\"\"\n",
      "canonical_solution": "    return 2 * x\n", "test": "def check(c): pass\n",
      "entry_point": "f"}


def _write(path, rec):
    if path.suffix == ".parquet":  # the Hub's openai_humaneval ships Parquet
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([rec]), path)
        return
    data = (json.dumps(rec) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


@pytest.mark.parametrize("name", ["HumanEval.jsonl", "HumanEval.jsonl.gz", "test.parquet"])
def test_a_humaneval_file_reads_as_the_bundled_humaneval(tmp_path, name):
    """A downloaded HumanEval.jsonl(.gz) gave the bare function stub as the prompt, without the
    instruction the name `humaneval` asks with, and lost its task_id: a bench on the file
    timed other prompts than one on `humaneval`."""
    path = tmp_path / name
    _write(path, HE)
    [conv] = load_prompts(path).conversations
    bundled = read_humaneval().conversations[0]
    assert conv.meta == {"source": "humaneval", "task_id": "HumanEval/0"}
    assert conv.first_user().startswith("Complete the following Python function.")
    assert conv.first_user().endswith(HE["prompt"] + "```")
    assert bundled.first_user().startswith("Complete the following Python function.")


def test_a_copy_of_the_bundled_humaneval_gives_its_conversations(tmp_path):
    import shutil

    from draftsmith.data.prompts import humaneval_file

    copy = tmp_path / "HumanEval.jsonl.gz"
    shutil.copy(humaneval_file(), copy)
    bundled = load_prompts("humaneval").conversations
    assert [c.to_json() for c in load_prompts(copy).conversations] == [
        c.to_json() for c in bundled]


def test_a_prompt_with_a_task_id_alone_stays_a_plain_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"task_id": "t1", "prompt": "Say hi"}) + "\n")
    [conv] = load_prompts(path).conversations
    assert conv.first_user() == "Say hi" and conv.meta == {}


# --- plain text prompt files ------------------------------------------------------------------


def test_a_text_file_holds_one_prompt_a_line(tmp_path):
    """A prompts.txt was read as JSON Lines: every line skipped as "not valid JSON", then
    "no conversations in prompts.txt"."""
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbfWrite a haiku\r\n\r\n  \nExplain TCP\r\nWrite a haiku\n")
    ps = load_prompts(path)
    assert [c.messages for c in ps.conversations] == [
        [{"role": "user", "content": "Write a haiku"}],
        [{"role": "user", "content": "Explain TCP"}]]
    assert ps.problems == [] and ps.duplicates == 1


def test_a_text_file_line_not_utf8_is_named_and_skipped(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"good one\n\xff\xfe bad\n")
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["good one"]
    assert ps.problems == [f"{path}:2: not UTF-8 text (byte 0)"]


# --- the draft vocabulary of conversations without answers -----------------------------------


def test_vocab_of_prompts_without_answers_says_what_to_count(tmp_path, tiny_llama_dir):
    """`data vocab prompts.jsonl` said only that the data has no assistant tokens."""
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "Write a haiku"}) + "\n")
    res = CliRunner().invoke(app, ["vocab", str(src), "--target", str(tiny_llama_dir)])
    assert isinstance(res.exception, DraftsmithError)
    assert str(res.exception) == (
        "no loss-masked tokens to count: the data has no assistant tokens; count "
        "conversations with answers (`data regenerate`'s output) or a dataset captured from "
        "them")
    assert not (tmp_path / "vocab.safetensors").exists()


def test_vocab_reads_the_conversations_before_loading_the_target(tmp_path, monkeypatch):
    """A missing or empty JSONL was found only after the target loaded (the default: a GGUF)."""
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    monkeypatch.setattr("draftsmith.targets.load_target",
                        lambda *a: pytest.fail("target loaded before the conversations"))
    missing = tmp_path / "answers.jsonl"
    res = CliRunner().invoke(app, ["vocab", str(missing)])
    assert str(res.exception) == f"{missing}: no such file or folder"
    missing.write_text("\n")
    res = CliRunner().invoke(app, ["vocab", str(missing)])
    assert str(res.exception) == f"no conversations in {missing}"


# --- a top-level system prompt ------------------------------------------------------------------


@pytest.mark.parametrize("rec", [
    {"system": "Answer in French.", "conversations": [{"from": "human", "value": "Hi"}]},
    {"system": "Answer in French.", "messages": [{"role": "user", "content": "Hi"}]},
    {"system": "Answer in French.", "instruction": "Hi"},
    {"system": "Answer in French.", "prompt": "Hi"},
])
def test_a_system_field_is_the_conversations_system_prompt(tmp_path, rec):
    """ShareGPT and Alpaca files as LLaMA-Factory reads them carry the system prompt in a
    top-level "system": it was dropped, and every prompt asked without it."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    [conv] = load_prompts(path).conversations
    assert conv.messages == [{"role": "system", "content": "Answer in French."},
                             {"role": "user", "content": "Hi"}]


def test_a_system_field_that_cannot_be_used_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    recs = [{"system": 3, "prompt": "Hi"},
            {"system": "a", "messages": [{"role": "system", "content": "b"},
                                         {"role": "user", "content": "Hi"}]},
            {"system": " ", "prompt": "Hi"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ps = load_prompts(path)
    assert ps.problems == [f"{path}:1: 'system' is not a string, got int",
                           f"{path}:2: a 'system' field beside a system message: keep one"]
    assert [c.messages for c in ps.conversations] == [[{"role": "user", "content": "Hi"}]]


# --- a folder of data files (a Hub download), not one `save_to_disk` wrote ---------------------


def test_a_folder_of_data_files_names_them(tmp_path):
    """A dataset downloaded from the Hub (data/train-*.parquet) was taken for a save_to_disk
    folder: "needs the datasets package", which then could not read it either."""
    snap = tmp_path / "sharegpt"
    (snap / "data").mkdir(parents=True)
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet",
                 "test-00000-of-00001.parquet", "extra.jsonl"):
        _write(snap / "data" / name, {"prompt": "hi"})
    (snap / "README.md").write_text("# card\n")
    with pytest.raises(DraftsmithError, match=(
            rf"^{snap}: a folder of data files, not one `datasets` save_to_disk wrote: give "
            r"its files \(data/extra.jsonl, data/test-00000-of-00001.parquet, "
            r"data/train-00000-of-00002.parquet, \.\.\.\)$")):
        load_prompts(snap)
