"""Training review 8: the packed TTT loss equals the per-document loss; schedule and optimizer."""

from __future__ import annotations

import pytest
import torch
from test_drafter import random_drafter, tiny_cfg
from test_train_review3 import log_rows
from test_train_review5 import config
from test_train_review6 import quiet_train

from draftsmith.errors import DraftsmithError
from draftsmith.train import loop
from draftsmith.train.batches import collate
from draftsmith.train.loop import TTTModel
from draftsmith.train.objective import make_targets, step_loss
from draftsmith.train.ttt import unroll

STEPS = 4


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def _docs(n: int, seed: int = 11) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (9, 6, 11, 3)[:n]:
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3 :] = True  # a prompt, then the answer
        out.append({"input_ids": torch.randint(0, 50, (length,), generator=g),
                    "loss_mask": mask,
                    "aux": torch.randn(length, 3, 24, generator=g),
                    "hidden": torch.randn(length, 16, generator=g)})
    return out


def _sums(model: TTTModel, docs, rows, head, used, multiple: int = 1):
    """Per step: the loss summed over counted positions, correct and valid counts."""
    b = collate(docs, rows, multiple)
    tg = make_targets(b.hidden, head, used, b.loss_mask, b.doc)
    with torch.no_grad():
        _, losses, correct, valid = model(b.tokens, b.aux, b.positions, b.doc, tg.prob,
                                          tg.label, tg.ok)
    t = b.tokens.shape[1]
    counted = []
    for j in range(STEPS):
        s, n = j + 1, max(t - j - 1, 0)
        ok = tg.ok[:, s:] & (tg.doc[:, :n] == tg.doc[:, s:]) & (tg.label[:, s:] >= 0)
        counted.append(ok.sum())
    counted = torch.stack(counted).double()
    return (losses.double() * counted, correct.sum((1, 2)), valid.sum((1, 2)), counted)


def test_packed_batch_loss_equals_each_document_alone():
    """Documents packed into padded rows train on exactly the positions, with exactly the
    per-position losses, they train on one by one: no prompt, padding, cross-document or
    past-the-end position counts at any TTT step."""
    cfg = tiny_cfg()
    drafter = random_drafter(cfg).float()
    model = TTTModel(drafter, STEPS, 0.8)
    torch.manual_seed(3)
    head = torch.randn(cfg.vocab_size, 16)
    used = drafter.d2t + torch.arange(cfg.draft_vocab_size)
    docs = _docs(4)
    packed = _sums(model, docs, [[(0, 9), (1, 6)], [(2, 11), (3, 3)]], head, used, multiple=8)
    alone = [_sums(model, docs, [[(i, len(d["input_ids"]))]], head, used)
             for i, d in enumerate(docs)]
    for k, what in enumerate(("loss", "correct", "valid", "counted")):
        want = sum(a[k] for a in alone)
        assert torch.allclose(packed[k].double(), want.double(), atol=1e-4), (what, packed[k],
                                                                               want)
    assert packed[3][0] > 0 and packed[3][-1] > 0  # deep steps count something


def test_a_batch_narrower_than_the_ttt_steps_trains(root):
    """Rows of 12-token samples alone (--max-len 16 packs one a row) under 14 TTT steps: the
    unrolled steps past the row's width shifted nothing in and crashed in torch.cat."""
    out = root / "narrow"
    quiet_train(config(root, "narrow", ttt_steps=14, max_len=16, batch_size=1, max_steps=4,
                       log_every=1, max_samples=4))
    rows = log_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(len(r["acc"]) == 14 for r in rows) and any(r["loss"] > 0 for r in rows)


def test_narrow_unroll_yields_every_step():
    drafter = random_drafter(tiny_cfg()).float()
    t = 3
    tokens, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 3, 24)
    doc, pos = torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None]
    with torch.no_grad():
        out = list(unroll(drafter, tokens, drafter.fuse(aux), pos, doc, 6))
    assert len(out) == 6 and all(x.shape == (1, t, 20) for x in out)


def test_weight_decay_spares_norm_gains(root):
    """--weight-decay decays the matrices only: RMSNorm gains (1-D) are exempt, as in HF
    Trainer; decayed, gains that start at 1 were pulled towards 0."""
    drafter = random_drafter(tiny_cfg()).float()
    groups = loop.decay_groups(drafter, 0.5)
    opt = torch.optim.AdamW(groups, lr=0.1)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    for p in drafter.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        moved = not torch.equal(p, before[n])
        assert moved == (p.dim() > 1), n
    assert len(loop.decay_groups(drafter, 0.0)) == 1


def test_resuming_a_run_that_decayed_every_weight_keeps_its_one_group(root, capfd,
                                                                      monkeypatch):
    """A checkpoint of a run whose optimizer held one group (every weight decayed) resumes
    as it began, and says so, instead of a torch ValueError on the group count."""
    real = loop.decay_groups
    monkeypatch.setattr(loop, "decay_groups", lambda d, w, split=True: real(d, w, False))
    quiet_train(config(root, "one-group", weight_decay=0.1, time_limit=0.0))
    monkeypatch.setattr(loop, "decay_groups", real)
    capfd.readouterr()
    quiet_train(config(root, "one-group", weight_decay=0.1, resume=True))
    err = capfd.readouterr().err
    assert "decays every weight, norm gains too" in err, err
    assert log_rows(root / "one-group")[-1]["step"] == 6


def test_max_steps_with_epochs_is_refused_naming_both(root):
    """--epochs 3 --max-steps 6 trained 6 steps and silently dropped --epochs."""
    with pytest.raises(DraftsmithError, match=r"^--max-steps 6 and --epochs 3: give one") as e:
        config(root, "both", epochs=3)
    assert "\n" not in str(e.value)


def test_a_warmup_longer_than_the_run_is_refused_before_training(root):
    """--warmup-steps 50 over a 6-step run: the learning rate never reached --lr and never
    decayed, silently."""
    with pytest.raises(DraftsmithError, match=r"^--warmup-steps 50 is more than the run's 6 "):
        quiet_train(config(root, "long-warmup", warmup_steps=50))
    assert not (root / "long-warmup").exists()


def test_lr_follows_warmup_then_cosine_to_min_lr_across_a_resume(root):
    """Each log row's lr is the one its step ran at: linear warm-up over --warmup-steps, then
    cosine from --lr down towards --min-lr; a resumed run continues the same curve."""
    import math

    over = dict(max_steps=5, log_every=1, warmup_steps=2, lr=1e-2, min_lr=1e-3, save_every=3)
    quiet_train(config(root, "sched-a", **over))
    quiet_train(config(root, "sched-b", time_limit=0.0, **over))
    quiet_train(config(root, "sched-b", resume=True, **over))
    want = [1e-2 * (s + 1) / 2 if s < 2 else
            1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 3)) for s in range(5)]
    for out in ("sched-a", "sched-b"):
        got = [r["lr"] for r in log_rows(root / out)]
        assert got == pytest.approx(want), out


def test_compiled_loss_is_not_handed_a_batch_no_wider_than_a_step():
    """--compile-loss on rows one token wide: inductor raised ValueRangeError on the empty
    slices of steps 1.. (reproduced on CPU inductor, 28 s: too slow here); those steps, which
    score nothing, now run eager. A stand-in for the compiled loss refuses them."""
    drafter = random_drafter(tiny_cfg()).float()
    model = TTTModel(drafter, 3, 0.8)
    seen = []

    def compiled(logits, tg, j):
        assert logits.shape[1] > j + 1, (logits.shape, j)
        seen.append(j)
        return step_loss(logits, tg, j)

    model.loss_fn = compiled
    torch.manual_seed(1)
    head, used = torch.randn(50, 16), drafter.d2t + torch.arange(20)
    for t in (4, 1):
        b = collate(_docs(1), [[(0, t)]])
        tg = make_targets(b.hidden, head, used, b.loss_mask, b.doc)
        loss, losses, _, valid = model(b.tokens, b.aux, b.positions, b.doc, tg.prob, tg.label,
                                       tg.ok)
        assert torch.isfinite(loss) and losses.shape == (3,)
    assert not valid.any() and seen == [0, 1, 2]
