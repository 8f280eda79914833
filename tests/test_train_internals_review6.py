"""Training internals, review 6: a packed, padded TTT batch against a naive reference that
drafts each sample alone, one chain per start position, one token a step, with the drafter's
inference path (KV cache, positions t + j) and scores it step by step: loss (soft cross-entropy
over counted positions, 0.8^j total), acc, cond_acc and the positions step 0 trains on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_drafter import random_drafter, tiny_cfg

from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.models.llama import KVCache
from draftsmith.train.batches import collate, pack
from draftsmith.train.loop import TTTModel
from draftsmith.train.objective import chain_counts, counted_positions, make_targets, summarize

STEPS, DECAY, HT = 4, 0.8, 50  # HT: the target's hidden size, its vocab's here


class Samples:
    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _samples(d: Eagle3Drafter, lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Random samples: a prompt, an answer, sometimes a second prompt and answer (turns)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = torch.zeros(n, dtype=torch.bool)
        a = int(torch.randint(0, max(n // 2, 1), (1,), generator=g))
        mask[a:] = True
        if n > 12:  # a second user turn in the middle, then its answer
            mask[n // 2 : n // 2 + 3] = False
        out.append({
            "input_ids": torch.randint(0, d.cfg.vocab_size, (n,), generator=g),
            "loss_mask": mask,
            "aux": torch.randn(n, 3, d.cfg.target_hidden_size, generator=g),
            "hidden": torch.randn(n, HT, generator=g),
        })
    return out


def _head(d: Eagle3Drafter, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's head [V, HT], near the identity: hidden unit i is token i's logit, and the
    draft vocab's target ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.eye(HT) + 0.3 * torch.randn(HT, HT, generator=g), d.t2d.nonzero().flatten()


@torch.no_grad()
def _steer(d: Eagle3Drafter, samples, used: torch.Tensor) -> None:
    """Make the target agree with every chain from t = 0, STEPS, 2 STEPS, ... at every step
    (their predicted spans do not overlap), so chains reach every step and cond_acc is
    measured there; the other positions keep random targets (often outside the draft vocab)."""
    g = torch.Generator().manual_seed(5)
    for s in samples:
        n, fused = len(s["input_ids"]), d.fuse(s["aux"])
        for t in range(0, n - 2, STEPS):
            for j, z in enumerate(_chain(d, s["input_ids"], fused, t, n)):
                s["hidden"][t + j + 1] = 4 * torch.eye(HT)[used[z.argmax()]] + torch.randn(
                    HT, generator=g) * 0.3


def _chain(d: Eagle3Drafter, ids: torch.Tensor, fused: torch.Tensor, t: int, n: int):
    """Logits of the chain drafted from position t of one sample, as decoding drafts it: the
    prefix through the drafter with its cache, then one fed-back hidden and token a step."""
    cfg = d.cfg
    caches = [KVCache(torch.zeros(1, cfg.num_kv_heads, n + STEPS, cfg.head_dim),
                      torch.zeros(1, cfg.num_kv_heads, n + STEPS, cfg.head_dim))
              for _ in d.layers]
    logits, h = d(ids[None, 1 : t + 2], fused[None, : t + 1], torch.arange(t + 1)[None], caches)
    out, h = [logits[0, -1]], h[:, -1:]
    for j in range(1, STEPS):
        if t + j + 2 >= n:  # nothing left to predict in this sample
            break
        logits, h = d(ids[None, t + j + 1 : t + j + 2], h, torch.tensor([[t + j]]), caches)
        out.append(logits[0, 0])
    return out


def naive(d: Eagle3Drafter, samples, head: torch.Tensor, used: torch.Tensor) -> dict:
    """Per sample, per start, per step. Step j of the chain from t predicts token t + j + 2
    (counted when it is an answer token of the sample), against the target's distribution at
    t + j + 1 over the draft vocab; its loss only where that argmax is a draft token."""
    draft_of = torch.full((head.shape[0],), -1, dtype=torch.long)
    draft_of[used] = torch.arange(used.numel())
    loss = torch.zeros(STEPS, dtype=torch.float64)
    n_loss, hits, valid, c_hits, c_reached = (torch.zeros(STEPS, dtype=torch.float64)
                                              for _ in range(5))
    for s in samples:
        ids, mask, n = s["input_ids"], s["loss_mask"], len(s["input_ids"])
        full = s["hidden"] @ head.T
        label, prob = draft_of[full.argmax(-1)], torch.softmax(full[:, used], -1)
        fused = d.fuse(s["aux"])
        for t in range(n - 2):
            alive = True  # every earlier step of this chain valid and right
            for j, z in enumerate(_chain(d, ids, fused, t, n)):
                u = t + j + 1
                ok = bool(mask[u + 1])
                right = ok and int(z.argmax()) == int(label[u])
                alive = alive and ok
                valid[j] += ok
                hits[j] += right
                c_reached[j] += alive
                c_hits[j] += alive and right
                if ok and label[u] >= 0:
                    loss[j] += float(-(prob[u] * F.log_softmax(z, -1)).sum())
                    n_loss[j] += 1
                alive = alive and right
    per = loss / n_loss
    return {"losses": per, "total": sum(DECAY**j * per[j] for j in range(STEPS)),
            "acc": _rates(hits, valid), "cond_acc": _rates(c_hits, c_reached),
            "counted": n_loss[0].item()}


def _rates(hits: torch.Tensor, reached: torch.Tensor) -> list[float | None]:
    return [float(h / n) if n else None for h, n in zip(hits, reached, strict=True)]


def packed(d: Eagle3Drafter, samples, head, used, max_len: int, multiple: int):
    rows = pack(list(range(len(samples))), [len(s["input_ids"]) for s in samples], max_len)
    batch = collate(Samples(samples), rows, multiple, max_len)
    tg = make_targets(batch.hidden, head, used, batch.loss_mask, batch.doc)
    with torch.no_grad():
        total, losses, correct, valid = TTTModel(d, STEPS, DECAY)(
            batch.tokens, batch.aux, batch.positions, batch.doc, tg.prob, tg.label, tg.ok)
    return batch, total, losses, summarize(chain_counts(correct, valid)), counted_positions(tg)


@pytest.mark.parametrize("over", [{}, {"num_layers": 2}, {"norm_output": True},
                                  {"norm_before_residual": True}])
def test_a_packed_padded_batch_scores_as_each_sample_drafted_alone(over):
    """Rows of several samples (positions restarting, no attention across them), padding to a
    multiple of 8, one sample shorter than the steps: each step's loss, the 0.8^j total, acc,
    cond_acc and the counted positions equal the naive per-sample chains' (float32, 1e-5)."""
    d = random_drafter(tiny_cfg(**over), seed=1)
    head, used = _head(d, 7)
    samples = _samples(d, [9, 5, 14, 3, 11, 7, 16], seed=3)
    _steer(d, samples, used)
    batch, total, losses, stats, counted = packed(d, samples, head, used, 24, 8)
    assert batch.tokens.shape[1] == 24 and (batch.doc < 0).any()  # padded rows
    assert any(len({int(i) for i in row if i >= 0}) > 1 for row in batch.doc)  # packed rows
    with torch.no_grad():
        want = naive(d, samples, head, used)
    assert torch.allclose(losses.double(), want["losses"], rtol=1e-5, atol=1e-6)
    assert float(total) == pytest.approx(float(want["total"]), rel=1e-5)
    assert stats["acc"] == pytest.approx(want["acc"], abs=1e-9)
    assert stats["cond_acc"] == pytest.approx(want["cond_acc"], abs=1e-9)
    assert all(a is not None and a > 0 for a in want["cond_acc"])  # chains reach every step
    assert float(counted) == want["counted"]


def test_a_sample_past_max_len_scores_as_its_first_max_len_tokens_alone():
    """A sample cut by the packer is its first max_len tokens, drafted alone."""
    d = random_drafter(tiny_cfg(), seed=2)
    head, used = _head(d, 8)
    samples = _samples(d, [10, 30, 6], seed=4)
    _steer(d, samples, used)
    _, total, losses, stats, counted = packed(d, samples, head, used, 16, 1)
    cut = [{k: v[:16] for k, v in s.items()} for s in samples]
    with torch.no_grad():
        want = naive(d, cut, head, used)
    assert torch.allclose(losses.double(), want["losses"], rtol=1e-5, atol=1e-6)
    assert stats["acc"] == pytest.approx(want["acc"], abs=1e-9)
    assert stats["cond_acc"] == pytest.approx(want["cond_acc"], abs=1e-9)
    assert float(counted) == want["counted"]


def test_collate_rounds_the_width_up_to_multiple_without_a_cap():
    """`multiple` rounds the width up with no `cap` too: it was ignored then (the width the
    longest row's), so a caller asking for padding silently got none."""
    one = [{"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.bool)}]
    assert collate(one, [[(0, 5)]], 8).tokens.shape[1] == 8
    assert collate(one, [[(0, 5)]], 8, 6).tokens.shape[1] == 6  # a cap still bounds it
    assert collate(one, [[(0, 5)]]).tokens.shape[1] == 5
