"""Training internals, review 3: exact resume across an epoch boundary with loader workers
(weights, optimizer, schedule, RNG), a checkpoint missing a rank's RNG file, DDP sharding, a
sample past --max-len, and the TTT objective on a hand-built two-step example."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train_helpers import write_dataset

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, report, train
from draftsmith.train.batches import Plan, TokenSource, batches, collate, pack
from draftsmith.train.checkpoint import (
    STATE,
    checkpoint_dir,
    list_checkpoints,
    load_trainer_state,
)
from draftsmith.train.loop import Trainer
from draftsmith.train.objective import (
    chain_counts,
    counted_positions,
    make_targets,
    step_loss,
    summarize,
)

LENGTHS = [12 + (i * 7) % 13 for i in range(24)]  # test_train_helpers' samples


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("internals3")
    write_dataset(root / "data", load_target(tiny_llama_dir), n=24)
    (root / "target").symlink_to(tiny_llama_dir)
    return root


def config(root, out, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                max_steps=3, batch_size=2, max_len=48, ttt_steps=2, lr=3e-3, log_every=1,
                save_every=2, keep_last=2, max_samples=8, draft_vocab_size=64, progress=False,
                loader_workers=1)
    base.update(over)
    return TrainConfig(**base)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resume_at_an_epoch_boundary_with_workers_equals_the_straight_run(root, monkeypatch):
    """2 steps an epoch: a run stopped at the step-2 checkpoint (the epoch's end) and resumed,
    loader workers reading ahead in both, ends as the straight run bit for bit: weights,
    optimizer moments, schedule, log and the RNG state. The loader drew its workers' seed from
    the global RNG, so the resumed run's RNG state was one draw past the straight run's."""
    assert Plan(LENGTHS[:8], 2, 48, 1, 0, 0).steps_per_epoch(0) == 2
    monkeypatch.setattr(report, "plot", lambda out: None)  # the curves' PNG: slow, not compared
    train(config(root, "straight"))
    real, calls = Trainer.train_step, {"n": 0}

    def stops_after_step_2(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(Trainer, "train_step", stops_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        train(config(root, "cut"))
    monkeypatch.setattr(Trainer, "train_step", real)
    assert [p.name for p in list_checkpoints(root / "cut")] == ["step-00000002"]
    train(config(root, "cut", resume=True))

    a, b = root / "straight", root / "cut"
    rows = [[json.loads(x) for x in (f / "train_log.jsonl").read_text().splitlines()]
            for f in (a, b)]
    for r in (*rows[0], *rows[1]):
        r.pop("tokens_per_s")
    assert rows[0] == rows[1] and [r["epoch"] for r in rows[0]] == [0, 0, 1]
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)
    sa, sb = (load_trainer_state(checkpoint_dir(f, 3), 0) for f in (a, b))
    assert sa[0]["step"] == 3 and sa[0]["scheduler"]["last_epoch"] == 3
    for key in ("optimizer", "scheduler", "tokens", "window"):
        assert _equal(sa[0][key], sb[0][key]), key
    assert torch.equal(sa[1]["torch"], sb[1]["torch"])


def test_loader_workers_leave_the_global_rng_as_it_was():
    source = TokenSource([([5] * 10, [True] * 10) for _ in range(8)])
    plan = Plan(source.lengths(), 2, 16, 1, 0, 0)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    got = list(batches(plan, source, 0, 2, workers=1))
    assert len(got) == 2 and torch.equal(torch.get_rng_state(), before)


def _fake_checkpoints(out, world: int = 1) -> None:
    for step in (1, 2):
        folder = checkpoint_dir(out, step)
        folder.mkdir(parents=True)
        torch.save({"step": step, "world": world}, folder / STATE)
        for r in range(world):
            torch.save({"torch": torch.get_rng_state()}, folder / f"rng-{r}.pt")


def test_a_checkpoint_missing_a_ranks_rng_file_is_named_not_resumed_without_it(tmp_path):
    """A checkpoint copied without rng-0.pt resumed silently, its RNG never restored."""
    _fake_checkpoints(tmp_path, world=2)
    (checkpoint_dir(tmp_path, 2) / "rng-1.pt").unlink()
    for rank in (0, 1):  # every rank refuses alike (none left waiting for the other)
        with pytest.raises(DraftsmithError, match=r"no rng-1\.pt \(a rank's RNG state\); that "
                           r"checkpoint is unreadable: delete .*step-00000002 and --resume "
                           "resumes from step-00000001"):
            load_trainer_state(checkpoint_dir(tmp_path, 2), rank)
    state, rng = load_trainer_state(checkpoint_dir(tmp_path, 1), 1)
    assert state["step"] == 1 and rng is not None
    # a rank past the run's world has none: the loop refuses the other world by name
    assert load_trainer_state(checkpoint_dir(tmp_path, 1), 2)[1] is None


def test_a_trainer_state_of_something_else_is_named(tmp_path):
    _fake_checkpoints(tmp_path)
    torch.save([1, 2], checkpoint_dir(tmp_path, 2) / STATE)
    with pytest.raises(DraftsmithError, match="holds no trainer state; that checkpoint is "
                       "unreadable"):
        load_trainer_state(checkpoint_dir(tmp_path, 2), 0)


def test_ranks_partition_every_epoch_and_orders_are_seeded_per_epoch():
    """Simulated ranks of a 3-rank run: each epoch no sample on two ranks or twice on one, the
    same steps on every rank; over epochs every sample trains; orders differ by epoch, and are
    the same again for the same seed."""
    world, n_epochs = 3, 4

    def epoch_samples(rank: int, seed: int, e: int) -> list[int]:
        plan = Plan(LENGTHS, 1, 48, world, rank, seed)
        first = sum(plan.steps_per_epoch(k) for k in range(e))
        out = []
        for step in range(first, first + plan.steps_per_epoch(e)):
            assert plan.rows(step)[0] == e
            out += [i for row in plan.rows(step)[2] for i, _ in row]
        return out

    seen: set[int] = set()
    for e in range(n_epochs):
        ranks = [epoch_samples(r, 7, e) for r in range(world)]
        flat = [i for r in ranks for i in r]
        assert len(flat) == len(set(flat))
        steps = {Plan(LENGTHS, 1, 48, world, r, 7).steps_per_epoch(e) for r in range(world)}
        assert len(steps) == 1
        seen |= set(flat)
    assert seen == set(range(len(LENGTHS)))
    assert epoch_samples(0, 7, 0) != epoch_samples(0, 7, 1)
    assert epoch_samples(1, 7, 2) == epoch_samples(1, 7, 2)
    assert epoch_samples(0, 7, 0) != epoch_samples(0, 8, 0)


def test_a_sample_past_max_len_takes_its_first_tokens_and_its_cut_end_scores_nothing():
    ids = [list(range(10, 15)), list(range(20, 40)), list(range(50, 54))]
    source = TokenSource([(x, [True] * len(x)) for x in ids])
    rows = pack([0, 1, 2], source.lengths(), 8)
    assert rows == [[(0, 5)], [(1, 8)], [(2, 4)]]
    b = collate(source, rows)
    assert b.tokens[1].tolist() == list(range(20, 28)) and b.positions[1].tolist() == [*range(8)]
    assert b.doc[0].tolist() == [0] * 5 + [-1] * 3 and b.tokens_used == 17
    head = torch.eye(64)[:, :8] * 5
    hidden = torch.nn.functional.one_hot(b.tokens % 8, 8).float()
    tg = make_targets(hidden, head, torch.arange(64), b.loss_mask, b.doc)
    # the target of the cut sample's last kept token is not known to be an answer token
    assert tg.ok[1].tolist() == [True] * 7 + [False]
    assert not tg.ok[0, 4:].any() and not tg.ok[2, 3:].any()  # padding never counts


def _ce(p: list[float], z: list[float]) -> float:
    lse = math.log(sum(math.exp(x) for x in z))
    return -sum(pi * (zi - lse) for pi, zi in zip(p, z, strict=True))


def _softmax(x: list[float]) -> list[float]:
    e = [math.exp(v) for v in x]
    return [v / sum(e) for v in e]


def test_two_ttt_steps_by_hand():
    """Target vocab 4, draft vocab = target ids [0, 1, 3] (2 outside); documents 0 (indices
    0-5) and 1 (6-7), index 0 a prompt token. Step j at t is scored at u = t + j + 1 where
    token u+1 is an answer token of t's document; out-of-vocab argmax targets are misses in
    the statistics but no loss."""
    used = torch.tensor([0, 1, 3])
    hidden = torch.tensor([[0, 3, 0, 0], [2, 1, 0, 0], [0, 0, 3, 1], [0, 1, 0, 2],
                           [1, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [1, 0, 0, 0]]).float()
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    doc = torch.tensor([[0] * 6 + [1] * 2])
    tg = make_targets(hidden[None], torch.eye(4), used, loss_mask, doc)
    assert tg.label[0].tolist() == [1, 0, -1, 2, 1, 0, 0, 0]
    assert tg.ok[0].tolist() == [True] * 5 + [False, True, False]
    p = [_softmax([row[0], row[1], row[3]]) for row in hidden.tolist()]

    z0 = torch.zeros(1, 8, 3)
    z0[0, 0], z0[0, 1], z0[0, 2], z0[0, 3] = (torch.tensor(v) for v in (
        [3.0, 0, 0], [0, 0, 1.0], [0, 0, 2.0], [1.0, 0, 0]))
    z1 = torch.zeros(1, 8, 3)
    z1[0, 0], z1[0, 1], z1[0, 2] = (torch.tensor(v) for v in ([0, 1.0, 0], [0, 0, 1.0],
                                                               [0, 2.0, 0]))
    loss0, c0, v0 = step_loss(z0, tg, 0)
    loss1, c1, v1 = step_loss(z1, tg, 1)
    # step 0 counts t = 0, 2, 3 (u = 1, 3, 4); t = 1 (u = 2) is out of vocab, t = 5 crosses
    want0 = sum(_ce(p[t + 1], z0[0, t].tolist()) for t in (0, 2, 3)) / 3
    want1 = sum(_ce(p[t + 2], z1[0, t].tolist()) for t in (1, 2)) / 2  # u = 3, 4
    assert loss0.item() == pytest.approx(want0, rel=1e-6)
    assert loss1.item() == pytest.approx(want1, rel=1e-6)
    assert v0[0].tolist() == [True] * 4 + [False] * 4
    assert v1[0].tolist() == [True] * 3 + [False] * 5
    assert c0[0].tolist() == [True, False, True, False, False, False, False, False]
    assert c1[0].tolist() == [False, True, True, False, False, False, False, False]
    assert counted_positions(tg).item() == 3
    stats = summarize(chain_counts(torch.stack([c0, c1]), torch.stack([v0, v1])))
    # acc over every valid position (out of vocab a miss); step 1's chains: t = 0, 2
    assert stats["acc"] == [pytest.approx(2 / 4), pytest.approx(2 / 3)]
    assert stats["cond_acc"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert stats["accept_length"] == pytest.approx(1.75)


def _tiny_drafter():
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

    return Eagle3Drafter(Eagle3Config(
        hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
        target_hidden_size=16, vocab_size=40, draft_vocab_size=40, aux_layer_ids=[0, 1, 2]))


def test_a_checkpoint_whose_removal_was_cut_short_goes_at_the_next_rotation(tmp_path):
    """A kill while an old checkpoint was removed (its trainer state first) left a folder of
    weights no --resume takes and no later rotation removed; the good ones are kept as
    --keep-last says, and a newer stateless folder (no rotation's leftover) is left alone."""
    from draftsmith.train.checkpoint import save_checkpoint

    drafter = _tiny_drafter()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, drafter, {"step": step}, {}, keep_last=2)
    (checkpoint_dir(tmp_path, 1) / STATE).unlink()  # the removal cut short here
    checkpoint_dir(tmp_path, 9).mkdir()
    save_checkpoint(tmp_path, 3, drafter, {"step": 3}, {}, keep_last=2)
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 2), checkpoint_dir(tmp_path, 3)]
    assert not checkpoint_dir(tmp_path, 1).exists() and checkpoint_dir(tmp_path, 9).is_dir()
    save_checkpoint(tmp_path, 4, drafter, {"step": 4}, {}, keep_last=1)
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 4)]


def test_resume_names_a_torn_checkpoint_it_passes_over(tmp_path):
    """A step-N folder newer than the last whole checkpoint but without its trainer state (a
    write cut short) was passed over without a word: --resume went back further, silently."""
    from types import SimpleNamespace

    from draftsmith.train import checkpoint as ckpt
    from draftsmith.train.loop import Trainer

    root = tmp_path / "run" / ckpt.CHECKPOINTS
    for step, whole in ((2, True), (4, False), (1, False)):
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        if whole:
            (folder / ckpt.STATE).write_bytes(b"x")
    said: list[str] = []
    me = SimpleNamespace(out=tmp_path / "run", cfg=SimpleNamespace(resume=True), say=said.append)
    assert Trainer._find_checkpoint(me) == root / "step-00000002"
    assert said == [f"--resume: {root / 'step-00000004'} holds no trainer state (a write or "
                    "removal cut short): passed over"]
