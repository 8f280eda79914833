"""Training review 3: runs that would train on nothing, many shards, the DDP loss weighting."""

from __future__ import annotations

import json
import os
import resource
import socket
import warnings

import pytest
import torch
from test_train_helpers import write_dataset

from draftsmith.data.shards import OPEN_SHARDS, Dataset
from draftsmith.data.vocab import build_vocab, save_vocab
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, train
from draftsmith.train.batches import Plan, batches, collate
from draftsmith.train.dist import setup as setup_ctx
from draftsmith.train.loop import Trainer
from draftsmith.train.objective import counted_positions, make_targets
from draftsmith.train.reader import ShardReader
from draftsmith.train.sources import target_head

UNTRAINED = "nothing trained"


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def config(root, out, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                max_steps=3, batch_size=2, max_len=48, ttt_steps=2, lr=3e-3, log_every=1,
                save_every=100, draft_vocab_size=64, progress=False, loader_workers=0)
    base.update(over)
    return TrainConfig(**base)


def log_rows(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "train_log.jsonl").read_text().splitlines()]


def test_a_max_len_that_cuts_off_every_answer_is_refused_before_training(root):
    """Answers start at token 5 of each sample: --max-len 4 trained 3 steps of loss 0 and wrote
    a drafter that had never moved; now it is refused up front, with no --out made."""
    with pytest.raises(DraftsmithError, match=r"^--max-len 4 cuts off every answer: .* the "
                       r"earliest is token 5; raise --max-len well past 5$"):
        Trainer(config(root, "short", max_len=4, ttt_steps=1, batch_size=1), setup_ctx("cpu"))
    assert not (root / "short").exists()
    with pytest.raises(DraftsmithError, match="cuts off every answer"):
        Trainer(config(root, "short", max_len=4, ttt_steps=1, batch_size=1, max_samples=3),
                setup_ctx("cpu"))


def never_predicted(root) -> list[int]:
    """Token ids the random target's argmax never takes over the dataset."""
    target = load_target(root / "target")
    head = target_head(target)[1]
    reader = ShardReader(Dataset(root / "data"))
    seen = set()
    for i in range(len(reader)):
        seen |= set((reader[i]["hidden"].float() @ head.T).argmax(-1).tolist())
    return [t for t in range(target.cfg.vocab_size) if t not in seen]


def test_a_draft_vocab_missing_every_target_token_warns_in_one_line(root):
    """A --vocab counted on other data (none of its tokens ever the target's next token) trained
    at loss 0 without a word; now the first log window says so, naming --vocab."""
    vocab_size = load_target(root / "target").cfg.vocab_size
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    counts[never_predicted(root)[:4]] = 1
    vocab = save_vocab(build_vocab(counts, 4, vocab_size), root / "other_vocab")
    with pytest.warns(UserWarning) as said:
        train(config(root, "other", vocab=str(vocab), draft_vocab_size=None))
    lines = [str(w.message) for w in said if UNTRAINED in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "never one of the 4 draft tokens" in lines[0] and f"--vocab {vocab}" in lines[0]
    assert [r["loss"] for r in log_rows(root / "other")] == [0.0, 0.0, 0.0]
    with warnings.catch_warnings(record=True) as fine:
        warnings.simplefilter("always")
        train(config(root, "fine"))
    assert not [w for w in fine if UNTRAINED in str(w.message)]
    assert log_rows(root / "fine")[0]["loss"] > 0


@pytest.fixture(scope="module")
def many_shards(root):
    """More one-sample shards than a Dataset or ShardReader keeps open."""
    return write_dataset(root / "many", load_target(root / "target"), n=2 * OPEN_SHARDS,
                         per_shard=1)


class FileLimit:
    """RLIMIT_NOFILE lowered to the files open now plus `room`, restored on exit."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __enter__(self) -> None:
        self.old = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + self.room, self.old[1]))

    def __exit__(self, *exc) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, self.old)


def test_shard_reader_reads_more_shards_than_the_open_file_limit(many_shards):
    """The reader kept one descriptor per shard open: a dataset of more shards than the
    open-file limit failed with 'Too many open files'. Reads and loader workers now work under
    a limit below the shard count, reading what the Dataset reads."""
    ds = Dataset(many_shards)
    want = [ds[i] for i in range(len(ds))]
    reader = ShardReader(Dataset(many_shards))
    plan = Plan(ds.lengths(), 1, 64, 1, 0, 0)
    total = plan.steps_per_epoch(0)
    refs = [collate(ds, plan.rows(k)[2]) for k in range(total)]
    with FileLimit(OPEN_SHARDS + 48):
        got = [reader[i] for i in range(len(ds))]
        reader.close()
        # each batch compared as it comes: batches held from a worker hold descriptors too
        same = [torch.equal(batch.aux, ref.aux) and torch.equal(batch.tokens, ref.tokens)
                for (_, _, batch), ref in zip(batches(plan, reader, 0, total, workers=1), refs,
                                              strict=True)]
    assert len(same) == total and all(same)
    for a, b in zip(want, got, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(os.listdir("/proc/self/fd")) < OPEN_SHARDS + 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, cfg: TrainConfig) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(cfg)


def rank_loss_and_grad(trainer: Trainer, rank: int) -> tuple[float, torch.Tensor, int, tuple]:
    """(loss, flat gradient, counted positions, (step-0 positions in the draft vocab, step-0
    assistant positions)) of `rank`'s first batch in a 2-rank run, from the same initial drafter
    in this process."""
    c = trainer.cfg
    plan = Plan(trainer.data.lengths, c.batch_size, c.max_len, 2, rank, c.seed)
    b = collate(trainer.data.source, plan.rows(0)[2])
    tg = make_targets(b.hidden, trainer.head, trainer.used, b.loss_mask, b.doc)
    trainer.drafter.zero_grad()
    loss, _, _, valid = trainer.model(b.tokens, b.aux, b.positions, b.doc, tg.prob, tg.label,
                                      tg.ok)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in trainer.drafter.parameters() if p.requires_grad])
    return float(loss.detach()), grad, int(valid.sum()), (float(counted_positions(tg)),
                                                            float(valid[0].sum()))


@pytest.mark.filterwarnings("ignore:only .* distinct assistant tokens")
def test_ddp_loss_is_each_ranks_mean_averaged_over_ranks(root, capfd):
    """Two gloo ranks: the logged loss and gradient norm are those of the ranks' own means
    averaged (not of one mean over both ranks' positions), and the run's summary says so."""
    import torch.multiprocessing as mp

    one_step = dict(max_steps=1, batch_size=1, max_len=40)
    cfg = config(root, "ddp", **one_step)
    mp.start_processes(_ddp_worker, args=(2, _free_port(), cfg), nprocs=2, join=True,
                       start_method="fork")
    assert "loss: each rank's mean over its counted positions, averaged over ranks" in \
        capfd.readouterr().err
    row = log_rows(root / "ddp")[0]
    alone = Trainer(config(root, "ddp_alone", **one_step), setup_ctx("cpu"))
    (l0, g0, n0, c0), (l1, g1, n1, c1) = (rank_loss_and_grad(alone, r) for r in (0, 1))
    assert n0 != n1  # the two weightings differ
    assert row["loss"] == pytest.approx((l0 + l1) / 2, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(float(((g0 + g1) / 2).norm()), rel=1e-4)
    pooled = float(((n0 * g0 + n1 * g1) / (n0 + n1)).norm())
    assert row["grad_norm"] != pytest.approx(pooled, rel=1e-3)
    assert c0[0] / c0[1] != c1[0] / c1[1]  # the coverage is over both ranks' positions
    assert row["coverage"] == pytest.approx((c0[0] + c1[0]) / (c0[1] + c1[1]), rel=1e-12)
    assert load_drafter(root / "ddp").cfg.draft_vocab_size == alone.drafter.cfg.draft_vocab_size
