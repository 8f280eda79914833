"""Training review 22: online training says how many conversations --max-len cut and by how
much (a line and the drafter's record), and holds --max-len to the target's positions through
capture's own `within_positions`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train_loop import setup  # noqa: F401 - the tiny target and dataset fixture
from test_train_review13 import said

from draftsmith.data.capture import CaptureConfig, capture, within_positions
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset
from draftsmith.train import TrainConfig, train
from draftsmith.train.sources import open_online


def write(path: Path, rows: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def rows(long: int, short: int) -> list[list[dict]]:
    out = [[{"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": "ab " * (30 + 10 * i)}] for i in range(long)]
    out += [[{"role": "user", "content": f"s{i}"}, {"role": "assistant", "content": "ok"}]
            for i in range(short)]
    return out


def test_online_says_once_how_many_conversations_max_len_cut_and_by_how_much(target, tmp_path):
    """Capture says how many conversations --max-len truncated; online training cut them
    without a word. Now one line says how many of how many and the tokens dropped, and the
    data's summary (the drafter's record) keeps the same counts."""
    path = write(tmp_path / "p.jsonl", rows(long=3, short=2))
    data, lines = said(lambda: open_online(path, target, None, None, max_len=40))
    whole = data.uncut
    dropped = sum(n - 40 for n in whole if n > 40)
    assert sum(n > 40 for n in whole) == 3 and dropped > 0
    hits = [x for x in lines if "--max-len 40" in x]
    assert len(hits) == 1 and "\n" not in hits[0], lines
    assert "3 of 5 conversation(s)" in hits[0] and f"{dropped} token(s)" in hits[0], hits
    most = max(whole) - 40
    assert f"at most {most} of one" in hits[0], hits
    assert data.summary["cut_at_max_len"] == {"conversations": 3, "tokens": dropped,
                                              "most": most, "max_len": 40}


def test_online_says_nothing_where_max_len_cuts_nothing(target, tmp_path):
    path = write(tmp_path / "p.jsonl", rows(long=0, short=3))
    data, lines = said(lambda: open_online(path, target, None, None, max_len=40))
    assert not [x for x in lines if "--max-len" in x], lines
    assert data.summary["cut_at_max_len"]["conversations"] == 0


def test_the_trained_drafter_records_the_cut(target, tiny_llama_dir, tmp_path):
    path = write(tmp_path / "p.jsonl", rows(long=2, short=2))
    cfg = TrainConfig(out=str(tmp_path / "d"), target=str(tiny_llama_dir), prompts=str(path),
                      max_steps=1, batch_size=1, max_len=40, ttt_steps=2, log_every=1,
                      draft_vocab_size=50, progress=False, loader_workers=0)
    _, lines = said(lambda: train(cfg))
    meta = json.loads((tmp_path / "d" / "draftsmith.json").read_text())
    cut = meta["data"]["cut_at_max_len"]
    assert cut["conversations"] == 2 and cut["max_len"] == 40 and cut["tokens"] > 0
    assert len([x for x in lines if "--max-len 40" in x]) == 1, lines


@pytest.mark.parametrize("asked", [None, 100, 511, 512, 513, 2048])
def test_online_holds_max_len_to_the_positions_as_capture_does(target, tmp_path, asked):
    """train had its own copy of capture's `within_positions`; both must hold --max-len to the
    same length: the online samples' length is capture's held --max-len."""
    most = target.cfg.max_position_embeddings
    path = write(tmp_path / "p.jsonl", [[{"role": "user", "content": "long"},
                                         {"role": "assistant", "content": "ab " * 400}]])
    data, _ = said(lambda: open_online(path, target, None, None, max_len=asked))
    held = within_positions(CaptureConfig(max_len=asked or 10**9), most, lambda s: None).max_len
    assert data.lengths == [min(held, data.uncut[0])]


def test_online_samples_equal_a_capture_past_the_positions(target, tmp_path):
    """Both paths on one file with --max-len past the target's positions: the same lengths."""
    every = rows(long=2, short=1) + [[{"role": "user", "content": "x"},
                                      {"role": "assistant", "content": "ab " * 400}]]
    path = write(tmp_path / "p.jsonl", every)
    convs = [Conversation(m) for m in every]
    capture(target, convs, tmp_path / "data", CaptureConfig(aux_layer_ids=[1, 2, 4],
            batch_size=2, max_len=2048), progress=False, log=lambda s: None, command="test")
    data, lines = said(lambda: open_online(path, target, [1, 2, 4], None, max_len=2048))
    assert data.lengths == Dataset(tmp_path / "data").lengths()
    most = target.cfg.max_position_embeddings
    hits = [x for x in lines if "max_position_embeddings" in x]
    assert len(hits) == 1 and f"{most} tokens" in hits[0] and "1 of 4" in hits[0], lines


def test_answers_past_the_positions_do_not_say_raise_max_len(target, tmp_path):
    """A conversation whose answer starts past the target's 512 positions was skipped "past
    --max-len 512 ...; raise --max-len", with --max-len 2048 given: no --max-len keeps it. Now
    the line names the positions and the fix that works, as capture's does."""
    late = [{"role": "user", "content": "word " * 600}, {"role": "assistant", "content": "ok"}]
    path = write(tmp_path / "p.jsonl", rows(long=0, short=2) + [late])
    data, lines = said(lambda: open_online(path, target, None, None, max_len=2048))
    hits = [x for x in lines if "1 of 3" in x]
    assert len(data.lengths) == 2 and len(hits) == 1, lines
    assert "raise --max-len" not in hits[0] and "max_position_embeddings 512" in hits[0], hits
    assert "shorten" in hits[0], hits


def test_offline_training_says_how_many_samples_max_len_cuts(target, tiny_llama_dir, tmp_path):
    """Offline, the packer says the cut (`cut_note`); the drafter's record now keeps it too,
    as online's does."""
    every = rows(long=2, short=2)
    capture(target, [Conversation(m) for m in every], tmp_path / "data",
            CaptureConfig(aux_layer_ids=[1, 2, 4], batch_size=2, max_len=400), progress=False,
            log=lambda s: None, command="test")
    lengths = Dataset(tmp_path / "data").lengths()
    cfg = TrainConfig(out=str(tmp_path / "d"), data=str(tmp_path / "data"), max_steps=1,
                      batch_size=1, max_len=40, ttt_steps=2, log_every=1, draft_vocab_size=50,
                      progress=False, loader_workers=0, target=str(tiny_llama_dir))
    _, lines = said(lambda: train(cfg))
    hits = [x for x in lines if "--max-len 40" in x]
    dropped = sum(n - 40 for n in lengths if n > 40)
    assert len(hits) == 1 and "2 of 4 sample(s)" in hits[0], lines
    meta = json.loads((tmp_path / "d" / "draftsmith.json").read_text())
    assert meta["data"]["cut_at_max_len"]["tokens"] == dropped


def test_a_vocab_counted_on_longer_samples_than_max_len_is_said(setup, capsys):  # noqa: F811
    """`data make` records in vocab.json the length its samples were cut at (`counted_from`);
    training on that --vocab with a shorter --max-len said nothing, though the vocab then holds
    tokens only the cut tails carry. Now one note names both lengths and the fix."""
    from test_train_loop import config, setup_ctx

    from draftsmith.data.vocab import build_vocab, count_dataset, counted_from, save_vocab
    from draftsmith.train.loop import Trainer

    root, _, data = setup
    longest = max(Dataset(data).lengths())
    made = counted_from(data)
    path = save_vocab(build_vocab(count_dataset(data, 128), 16, 128), root / "vlen",
                      {"made_from": {**made, "max_len": longest + 16}})
    short = longest - 4  # cuts the longest sample
    Trainer(config(root, "vlen_short", vocab=str(path), max_len=short), setup_ctx("cpu"))
    said = capsys.readouterr()
    assert (f"note: --vocab {path} was counted on samples of up to {longest + 16} tokens, and "
            f"--max-len {short} trains on fewer") in said.out + said.err
    # as long or longer than the count, or than every sample (the demo's rows): nothing is cut
    for max_len in (longest, longest + 16, 128):
        Trainer(config(root, f"vlen_{max_len}", vocab=str(path), max_len=max_len),
                setup_ctx("cpu"))
        said = capsys.readouterr()
        assert "was counted on samples" not in said.out + said.err
