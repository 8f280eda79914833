"""Review of data making: where a JSON array's or a table's bad record is, a capture of a grown
answers file, the vocabulary's two files, `humaneval` beside a file of that name, and empty
answers from a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_data_capture import CFG, convs

from draftsmith.data.capture import capture
from draftsmith.data.prompts import Conversation, load_prompts, read_jsonl_tail_safe
from draftsmith.data.regenerate import Answer, RegenConfig, regenerate, reply
from draftsmith.errors import DraftsmithError

# --- a bad record named where it is -------------------------------------------------------------


def test_a_json_arrays_bad_item_is_named_by_its_index_not_a_line(tmp_path):
    """`a.json:2` named line 2 of a file whose records are items: the bad one is item [1]."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "one"}, {"x": 1}, {"prompt": "three"}], indent=2))
    ps = load_prompts(path)
    assert len(ps.conversations) == 2
    assert ps.problems == [f"{path} item [1]: no 'messages', 'conversations', 'prompt' or "
                           "'instruction' (keys: x)"]
    with pytest.raises(DraftsmithError, match=r"a\.json item \[1\]: no 'messages'"):
        load_prompts(path, strict=True)
    path.write_text(json.dumps({"x": 1}))  # a file of one object: no item to name
    assert load_prompts(path).problems[0].startswith(f"{path}: no 'messages'")


def test_a_parquet_tables_bad_row_is_named_as_a_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["fine", " "]}), path)
    assert load_prompts(path).problems[0].startswith(f"{path} row 2: ")


# --- `humaneval` beside a file of that name -----------------------------------------------------


def test_humaneval_beside_a_file_of_that_name_is_refused_not_guessed(tmp_path, monkeypatch):
    """The bare name read the bundled HumanEval though ./humaneval (a user's prompts) was
    meant, or the other way round: which one cannot be told, so neither is read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").write_text(json.dumps({"prompt": "mine"}) + "\n")
    with pytest.raises(DraftsmithError, match=r"'humaneval' names both the bundled "
                                              r"HumanEval and the file humaneval here"):
        load_prompts("humaneval")
    mine = load_prompts(str(tmp_path / "humaneval")).conversations
    assert [c.first_user() for c in mine] == ["mine"]
    assert load_prompts("./humaneval").conversations[0].first_user() == "mine"


# --- capture of a grown answers file ------------------------------------------------------------


def test_a_grown_input_is_refused_saying_what_changed_and_that_grow_keeps_shards(
        target, model, tmp_path):
    """The refusal named two bare digests; it now says the input changed, by how much, and that
    --grow keeps the shards whose samples stay."""
    capture(target, convs(6), tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    with pytest.raises(DraftsmithError, match=r"other conversations \(its 6 conversations and "
                                              r"3 more: the input grew since\); pass --grow"):
        capture(target, convs(9), tmp_path, CFG, progress=False, model=model, log=lambda s: None)


def test_data_capture_grow_reaches_the_capture(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    seen = {}
    monkeypatch.setattr("draftsmith.data.capture.capture",
                        lambda *a, **k: seen.update(k) or {"totals": {"samples": 1, "tokens": 1,
                                                                       "shards": 1},
                                                            "complete": True, "rank": None})
    monkeypatch.setattr("draftsmith.targets.load_target", lambda name: None)
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    res = CliRunner().invoke(app, ["capture", str(src), "--out", str(tmp_path / "d"),
                                   "--device", "cpu", "--grow"])
    assert res.exit_code == 0, res.output
    assert seen["grow"] is True


# --- the vocabulary's two files -----------------------------------------------------------------


def test_a_failed_vocab_write_never_leaves_another_vocabularys_summary(tmp_path, monkeypatch):
    """vocab.safetensors replaced, then vocab.json: a failure between left the new vocabulary
    beside the old one's summary (its size and coverage)."""
    from draftsmith.data import atomic
    from draftsmith.data.vocab import build_vocab, load_vocab, save_vocab, vocab_json

    counts = torch.tensor([5, 4, 3, 2, 1, 0])
    save_vocab(build_vocab(counts, 2, 6), tmp_path)
    assert vocab_json(tmp_path)["draft_vocab_size"] == 2

    def full(path, obj):
        raise DraftsmithError(f"{path}: cannot write it (No space left on device)")

    monkeypatch.setattr(atomic, "write_json", full)
    with pytest.raises(DraftsmithError, match="No space left"):
        save_vocab(build_vocab(counts, 4, 6), tmp_path)
    assert load_vocab(tmp_path)[0].numel() == 4
    assert not (tmp_path / "vocab.json").exists()


# --- empty answers from a server ----------------------------------------------------------------


def _completion(content: str | None, tool_calls: list | None = None) -> SimpleNamespace:
    msg = SimpleNamespace(content=content, tool_calls=tool_calls)
    return SimpleNamespace(model="m", choices=[SimpleNamespace(message=msg,
                                                               finish_reason="stop")],
                           usage=SimpleNamespace(completion_tokens=1))


def test_a_servers_empty_answer_is_a_failed_one_not_a_training_conversation(target, tmp_path):
    """A missing text (a tool call, a parser that took it) was kept as the target's answer, an
    empty one: a conversation that trains the drafter on an end of turn right after the prompt.
    An empty string is the target's own (an end of turn at once), kept as the engine keeps it."""
    assert reply(_completion("ok"), "m") == Answer("ok", 1, "stop")
    assert reply(_completion(""), "m").text == "" and reply(_completion(""), "m").finish == "stop"
    for r in (_completion(None), _completion("  \n", [{"id": "t"}]),
              _completion(None, [{"id": "t"}])):
        got = reply(r, "m")
        assert got.finish.startswith("error: the server's reply holds no text") and not got.text
    assert "but a tool call" in reply(_completion(None, [{"id": "t"}]), "m").finish

    class Server:
        name, model_name = "openai", "m"
        base_url = "http://x"

        def answer(self, batch):
            return [reply(_completion(None if "empty" in m[-1]["content"] else "fine"), "m")
                    for m in batch]

    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=4)
    asks = [Conversation([{"role": "user", "content": t}]) for t in ("empty one", "full one")]
    out = tmp_path / "a.jsonl"
    stats = regenerate(asks, out, Server(), target.tokenizer, cfg, False, lambda s: None)
    assert stats["failed"] == 1 and stats["answered"] == 1
    assert [r["meta"]["prompt_id"] for r in read_jsonl_tail_safe(out)] == [asks[1].id]


# --- a capture of several ranks not yet merged --------------------------------------------------


def test_an_unmerged_capture_says_to_merge_it(target, model, tmp_path):
    """`data inspect`, `data vocab` or training of a torchrun capture not yet merged said only
    that the folder held no manifest.json (not a dataset folder)."""
    from draftsmith.data.shards import Dataset

    capture(target, convs(2), tmp_path / "rank-0", CFG, progress=False, model=model,
            log=lambda s: None)
    with pytest.raises(DraftsmithError, match=r"holds the ranks' captures but no manifest\.json "
                                              r"joining them: .*run `draftsmith data merge "):
        Dataset(tmp_path)
