"""Training review 4: the draft vocab's coverage of the target's next tokens, logged and warned."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_train_review3 import log_rows

from draftsmith.data.shards import Dataset
from draftsmith.data.vocab import build_vocab, save_vocab
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, train
from draftsmith.train.checkpoint import STATE, list_checkpoints
from draftsmith.train.loop import COVERAGE_FLOOR, Trainer
from draftsmith.train.reader import ShardReader
from draftsmith.train.sources import read_vocab, target_head

LOW = "low draft vocab coverage"


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


@pytest.fixture(scope="module")
def next_tokens(root) -> torch.Tensor:
    """The target's argmax at every position a drafter learns (an assistant token next)."""
    head = target_head(load_target(root / "target"))[1]
    reader = ShardReader(Dataset(root / "data"))
    out = []
    for i in range(len(reader)):
        s = reader[i]
        learns = s["loss_mask"].bool()[1:]
        out.append((s["hidden"].float() @ head.T).argmax(-1)[:-1][learns])
    return torch.cat(out)


def config(root, out, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                batch_size=1, max_len=48, ttt_steps=2, lr=3e-3, log_every=1000,
                save_every=1000, progress=False, loader_workers=0)
    base.update(over)
    return TrainConfig(**base)


def vocab_of(root, name: str, tokens: torch.Tensor, size: int):
    """A vocab file of the `size` most frequent of `tokens` (as if counted on other answers)."""
    vocab = load_target(root / "target").cfg.vocab_size
    counts = torch.bincount(tokens, minlength=vocab)
    return save_vocab(build_vocab(counts, size, vocab), root / name)


def share_in(tokens: torch.Tensor, vocab) -> float:
    """The share of `tokens` inside the vocab file."""
    t2d = read_vocab(vocab, load_target(vocab.parent.parent / "target").cfg.vocab_size)[1]
    return float(t2d[tokens].double().mean())


def run(cfg: TrainConfig) -> list[str]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train(cfg)
    return [str(w.message) for w in said if LOW in str(w.message)]


def test_a_draft_vocab_covering_few_target_tokens_warns_and_logs_its_coverage(root, next_tokens):
    """A --vocab holding a few of the target's next tokens trained a drafter that can never
    propose the rest without a word (only a vocab missing every one was warned); now each row
    logs the share covered and the first window warns in one line naming --vocab."""
    rare = next_tokens.unique()[-6:]  # a few of the tokens the target predicts
    vocab = vocab_of(root, "few_vocab", rare, 6)
    want = share_in(next_tokens, vocab)
    assert 0 < want < 0.5
    lines = run(config(root, "few", vocab=str(vocab)))
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"at {want:.1%} of {len(next_tokens)} assistant positions" in lines[0]
    assert f"--vocab {vocab} is too small" in lines[0]
    rows = log_rows(root / "few")
    assert len(rows) == 1 and rows[0]["coverage"] == pytest.approx(want, abs=1e-12)
    meta = json.loads((root / "few" / "draftsmith.json").read_text())
    assert meta["training"]["last_coverage"] == rows[0]["coverage"]
    # counted on the data itself, a too small --draft-vocab-size is named
    small = run(config(root, "small", draft_vocab_size=2, max_steps=3))
    assert len(small) == 1 and "raise --draft-vocab-size (now 2;" in small[0]


def test_a_vocab_covering_most_targets_logs_its_share_and_does_not_warn(root, next_tokens):
    """A vocab counted on the target's own predictions: the logged figure is the real share of
    the run's positions it covers (every sample trained once), with no warning."""
    size = int(next_tokens.unique().numel()) - 2  # misses the two rarest
    vocab = vocab_of(root, "good_vocab", next_tokens, size)
    want = share_in(next_tokens, vocab)
    assert COVERAGE_FLOOR <= want < 1
    assert run(config(root, "good", vocab=str(vocab))) == []
    rows = log_rows(root / "good")
    assert len(rows) == 1 and rows[0]["coverage"] == pytest.approx(want, abs=1e-12)


def test_resume_logs_the_same_coverage_and_old_checkpoints_load(root, next_tokens, monkeypatch):
    """Checkpointed inside a log window: the resumed run's rows (coverage included) equal the
    uninterrupted run's. A checkpoint written before coverage was counted still resumes; its
    window's coverage is that of the steps after the resume, not diluted by the steps before.
    The resumed run does not warn again of its second window as "the first"."""
    vocab = str(vocab_of(root, "resume_vocab", next_tokens, 16))
    cfg = dict(vocab=vocab, max_steps=6, log_every=2, save_every=3)
    assert len(run(config(root, "straight", **cfg))) == 1
    run(config(root, "per_step", **{**cfg, "log_every": 1}))
    real = Trainer.train_step
    calls = {"n": 0}

    def dies_at_step_5(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        real(self)

    for out in ("cut", "old"):
        calls["n"] = 0
        monkeypatch.setattr(Trainer, "train_step", dies_at_step_5)
        with pytest.raises(KeyboardInterrupt):
            run(config(root, out, **cfg))
    monkeypatch.setattr(Trainer, "train_step", real)
    state_file = list_checkpoints(root / "old")[-1] / STATE
    state = torch.load(state_file, weights_only=False)
    for key in ("counted", "uncounted"):
        del state["window"][key]
    torch.save(state, state_file)
    for out in ("cut", "old"):  # the first window (steps 1-2) was judged before the cut
        assert run(config(root, out, **cfg, resume=True)) == []

    def rows(out):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in log_rows(root / out)]

    straight, per_step, old = rows("straight"), rows("per_step"), rows("old")
    assert [r["step"] for r in straight] == [2, 4, 6]
    assert rows("cut") == straight
    assert 0 < straight[1]["coverage"] < 1
    assert old[1]["coverage"] == per_step[3]["coverage"] != straight[1]["coverage"]
    assert {k: v for k, v in old[1].items() if k != "coverage"} == \
        {k: v for k, v in straight[1].items() if k != "coverage"}
