"""Training review 13: online skips said, the small-vocab advice when the vocab holds every
data token, and --resume naming the option to repeat."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from test_train_loop import setup  # noqa: F401 - the tiny target and dataset fixture

from draftsmith.errors import DraftsmithError
from draftsmith.train.sources import open_online


def write_convs(path: Path, answered: int, bare: int) -> Path:
    rows = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "an answer"}]
            for i in range(answered)]
    rows += [[{"role": "user", "content": f"open {i}"}] for i in range(bare)]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def said(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = call()
    return out, [str(x.message) for x in w]


def test_online_says_how_many_conversations_had_no_answer(target, tmp_path):
    """Online training dropped 4 of 5 unanswered conversations without a word ("1 samples");
    now one line says how many of how many and names `data regenerate`."""
    path = write_convs(tmp_path / "p.jsonl", answered=1, bare=4)
    data, lines = said(lambda: open_online(path, target, None, None))
    assert len(data.lengths) == 1 and data.summary["skipped_without_assistant"] == 4
    hits = [x for x in lines if "no assistant answer" in x]
    assert len(hits) == 1 and "\n" not in hits[0], lines
    assert "4 of 5 conversation(s)" in hits[0] and "draftsmith data regenerate" in hits[0]


def test_online_without_any_answer_is_refused_naming_the_fix(target, tmp_path):
    path = write_convs(tmp_path / "p.jsonl", answered=0, bare=3)
    with pytest.raises(DraftsmithError) as e:
        open_online(path, target, None, None)
    msg = str(e.value)
    assert "\n" not in msg and "3 of 3 conversation(s) have no assistant answer" in msg
    assert "draftsmith data regenerate" in msg


def test_online_answers_past_max_len_say_raise_max_len(target, tmp_path):
    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
            [{"role": "user", "content": "word " * 30}, {"role": "assistant", "content": "ok"}]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    data, lines = said(lambda: open_online(path, target, None, None, max_len=60))
    assert len(data.lengths) == 1
    hits = [x for x in lines if "past --max-len 60" in x]
    assert len(hits) == 1 and "1 of 2" in hits[0] and "no assistant answer" not in hits[0]


def covering_vocab(root: Path) -> Path:
    """A vocab of every distinct assistant token of the dataset (as `data make` writes it)."""
    from draftsmith.data.vocab import build_vocab, count_dataset, save_vocab
    from draftsmith.targets import load_target

    vocab = load_target(root / "target").cfg.vocab_size
    counts = count_dataset(root / "data", vocab)
    return save_vocab(build_vocab(counts, int((counts > 0).sum()), vocab), root / "all_vocab")


def low_lines(cfg) -> list[str]:
    from draftsmith.train import train

    _, lines = said(lambda: train(cfg))
    return [x for x in lines if "low draft vocab coverage" in x or "nothing trained" in x]


def test_a_vocab_holding_every_data_token_advises_more_data_not_a_larger_vocab(train_root):
    """A vocab of every distinct token of the data covered the target's next tokens at 83%,
    and the advice was "--vocab is too small; make a larger one", "raise --draft-vocab-size
    (now 167)" or "regrow with a larger --draft-vocab-size": none can help. Now each says the
    vocab already holds every data token and the fix is more (or greedy) data."""
    from test_train_review4 import config

    vocab = covering_vocab(train_root)
    runs = {"file": dict(vocab=str(vocab)), "size": dict(draft_vocab_size=100000)}
    for out, over in runs.items():
        lines = low_lines(config(train_root, f"all_{out}", **over))
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert "already holds every token of the data's answers" in lines[0], lines
        assert "more data" in lines[0]
        assert "too small" not in lines[0] and "raise --draft-vocab-size" not in lines[0]
    lines = low_lines(config(train_root, "all_init", init_from=str(train_root / "all_file"),
                             max_steps=2))
    assert len(lines) == 1 and f"the vocab of --init-from {train_root / 'all_file'}" in lines[0]
    assert "already holds every token" in lines[0] and "larger --draft-vocab-size" not in lines[0]


def test_resume_without_the_first_runs_vocab_names_vocab_never_none(train_root):
    """The first run had --vocab, the rerun forgot it: "draft_vocab_size was None in that run,
    now 32000" leaked None and named an option the user never gave. Now --vocab is named with
    the path to repeat."""
    from test_train_review4 import config

    from draftsmith.train import train

    vocab = covering_vocab(train_root)
    said(lambda: train(config(train_root, "vocab_cut", vocab=str(vocab), time_limit=0.0)))
    with pytest.raises(DraftsmithError) as e:
        train(config(train_root, "vocab_cut", resume=True))
    msg = str(e.value)
    assert "\n" not in msg and "None" not in msg and "draft_vocab_size" not in msg, msg
    assert f"--vocab was '{vocab}' in that run, not given now" in msg, msg
    assert f"resume with the same options: --vocab {vocab} " in msg, msg


def test_resume_clashes_are_told_as_flags_and_follow_the_option_that_set_them():
    from types import SimpleNamespace

    from draftsmith.train import TrainConfig
    from draftsmith.train.loop import Trainer

    def clashes(saved: dict, **now) -> list[tuple[str, str]]:
        cfg = TrainConfig(out="o", data="d", **now)
        return Trainer._option_clashes(SimpleNamespace(cfg=cfg), {**vars(cfg), **saved})

    # a first run from --init-from: no --num-layers nor --draft-vocab-size recorded
    said_ = clashes({"init_from": "/runs/d2", "num_layers": None, "draft_vocab_size": None})
    assert said_ == [("--init-from was '/runs/d2' in that run, not given now",
                      "--init-from /runs/d2")]
    assert clashes({"draft_vocab_size": None, "init_from": "/runs/d2"}, init_from="/runs/d2",
                   draft_vocab_size=512) == [
        ("--draft-vocab-size was not given in that run, 512 now", "leave --draft-vocab-size out")]
    assert clashes({"fc_norm": True}) == [("--fc-norm was on in that run, off now", "--fc-norm")]
    assert clashes({"lr": 0.001}) == [("lr was 0.001 in that run, now 0.0001", "--lr 0.001")]


def test_a_drafter_of_another_target_names_the_target_to_pass(setup):  # noqa: F811
    """--init-from (and --resume) of a drafter trained for another target printed two raw
    fingerprints; the refusal now names the target the drafter records, as --target takes it."""
    from test_train_loop import config

    from draftsmith.train import train

    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "other_base", max_steps=1))
    meta_path = root / "other_base" / "draftsmith.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["target_fingerprint"] = "0" * 16
    meta["config"]["target_source"] = "/models/the-other-target"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError) as e:
        train(config(root, "other_next", max_steps=1, init_from=str(root / "other_base"),
                     draft_vocab_size=None))
    assert "pass --target /models/the-other-target" in str(e.value), e.value


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_says_the_online_skips(target, tmp_path, rank):
    """Under torchrun every rank opened the prompts and warned: N copies of each skip line."""
    from types import SimpleNamespace

    import torch

    from draftsmith.train.dist import DistCtx
    from draftsmith.train.loop import Trainer

    path = write_convs(tmp_path / "p.jsonl", answered=1, bare=2)
    cfg = SimpleNamespace(data=None, prompts=path, aux_layer_ids=None, max_samples=None,
                          max_len=None)
    me = SimpleNamespace(cfg=cfg, target=target, ctx=DistCtx(rank, 2, torch.device("cpu")))
    data, lines = said(lambda: Trainer._open_data(me, None))
    assert len(data.lengths) == 1
    assert len([x for x in lines if "no assistant answer" in x]) == (rank == 0), lines
