"""Training review 18: runs stopped and resumed (online, several epochs) end as the straight run;
the TTT step inputs and targets as EAGLE-3 defines them; the written drafter generates."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from test_train_review3 import config
from test_train_review6 import quiet_train

from draftsmith.data.vocab import build_vocab, save_vocab
from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import report
from draftsmith.train.checkpoint import checkpoint_dir, list_checkpoints, load_trainer_state
from draftsmith.train.loop import Trainer


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


@pytest.fixture(autouse=True)
def no_plot(monkeypatch):
    monkeypatch.setattr(report, "plot", lambda out: None)  # slow, not compared


@pytest.fixture(scope="module")
def convs(root) -> Path:
    path = root / "convs18.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"count {i}"},
                           {"role": "assistant", "content": "abcabc abcabc " * (1 + i % 3)}]}
             for i in range(6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def whole_vocab(root) -> str:
    """A draft vocab of every target token: the tiny target's argmax is rarely in the data."""
    return str(save_vocab(build_vocab(torch.ones(128, dtype=torch.int64), 128, 128),
                          root / "vocab18"))


def rows(folder: Path) -> list[dict]:
    out = [json.loads(x) for x in (folder / "train_log.jsonl").read_text().splitlines()]
    for r in out:
        r.pop("tokens_per_s")
    return out


def ctrl_c_after(monkeypatch, step: int) -> None:
    calls, real = [], Trainer.train_step

    def spy(self):
        real(self)
        calls.append(1)
        if len(calls) == step:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(Trainer, "train_step", spy)


def same_run(a: Path, b: Path, step: int) -> None:
    assert rows(a) == rows(b)
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)
    sa, sb = (load_trainer_state(checkpoint_dir(f, step), 0) for f in (a, b))
    for key in ("step", "tokens", "scheduler"):
        assert sa[0][key] == sb[0][key], key
    for k, v in sa[0]["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb[0]["optimizer"]["state"][k][name]), (k, name)
    assert torch.equal(sa[1]["torch"], sb[1]["torch"])


@pytest.mark.parametrize("name, over, stop", [
    ("online", dict(data=None, prompts="CONVS", max_len=64, aux_layer_ids=[1, 3, 4],
               draft_vocab_size=None, vocab="VOCAB"), 2),
    ("epochs", dict(max_steps=None, epochs=3, max_samples=8), 3),
    ("workers", dict(max_steps=None, epochs=3, max_samples=8, loader_workers=2), 4),
])
def test_a_run_stopped_by_ctrl_c_and_resumed_equals_the_straight_run(root, convs, whole_vocab,
                                                                      monkeypatch,
                                                                      name, over, stop):
    """ctrl-C after step `stop` (online; 3 epochs of 2 steps stopped inside epoch 1 or at its
    end, loader workers reading ahead in the cut run only), then --resume: log rows, weights,
    AdamW moments, schedule and RNG state as the straight run's, bit for bit."""
    given = {"CONVS": str(convs), "VOCAB": whole_vocab}
    over = {k: given.get(v, v) if isinstance(v, str) else v for k, v in over.items()}
    quiet_train(config(root, f"{name}-straight", **{**over, "loader_workers": 0}))
    ctrl_c_after(monkeypatch, stop)
    with pytest.raises(KeyboardInterrupt):
        quiet_train(config(root, f"{name}-cut", **over))
    monkeypatch.undo()
    monkeypatch.setattr(report, "plot", lambda out: None)
    assert [p.name for p in list_checkpoints(root / f"{name}-cut")] == [f"step-{stop:08d}"]
    quiet_train(config(root, f"{name}-cut", resume=True, **over))
    total = rows(root / f"{name}-straight")[-1]["step"]
    if name != "online":
        assert [r["epoch"] for r in rows(root / f"{name}-cut")] == [0, 0, 1, 1, 2, 2]
    same_run(root / f"{name}-straight", root / f"{name}-cut", total)


def generate(monkeypatch, capsys, *args: str) -> tuple[int, list[dict], str]:
    from test_cli_review import run_main

    code, out, err = run_main(monkeypatch, capsys, "generate", "-p", "abc", "-p", "count 3",
                              "--device", "cpu", "-n", "12", "--json", *args)
    return code, [json.loads(x) for x in out.splitlines()], err


def test_the_written_drafter_generates_the_targets_text_with_the_runs_settings(root, monkeypatch,
                                                                                capsys):
    """A two-layer, norm-output drafter with a draft vocab narrower than the target's: what
    `draftsmith.json` records is what the run trained, and `generate --drafter` decodes with it
    the target's own greedy text."""
    over = dict(num_layers=2, norm_output=True, norm_before_residual=True, ttt_steps=3,
                draft_vocab_size=48, max_steps=4)
    quiet_train(config(root, "gen", **over))
    out = root / "gen"
    meta = json.loads((out / "draftsmith.json").read_text())
    d = load_drafter(out)
    assert (d.cfg.num_layers, d.cfg.norm_output, d.cfg.norm_before_residual) == (2, True, True)
    # the counted vocab caps at the data's distinct tokens (warned): the drafter's is its size
    assert d.cfg.draft_vocab_size == meta["vocab"]["draft_vocab_size"] < 128
    assert meta["training"]["steps"] == 4
    ran = meta["training"]["config"]
    assert {k: ran[k] for k in over} == over
    target = str(root / "target")
    code, plain, err = generate(monkeypatch, capsys, "--target", target)
    assert code == 0, err
    code, spec, err = generate(monkeypatch, capsys, "--target", target, "--drafter", str(out),
                               "--steps", "3")
    assert code == 0, err
    assert spec == plain and len(plain) == 2
    assert "accept length" in err


@pytest.mark.parametrize("over", [dict(num_layers=2), dict(norm_before_residual=True),
                                  dict(norm_output=True, num_layers=3)])
def test_ttt_equals_chain_drafting_for_deeper_and_normed_drafters(over):
    """Step j at index t: token x_{t+j+1}, the drafter's own step-(j-1) hidden at t, rope
    position t+j (EAGLE-3's TTT) equals drafting a chain from t with a KV cache, in every layer
    of a deeper drafter and under the norm flags (the shipped test covers one plain layer)."""
    from test_drafter import random_drafter, tiny_cfg

    from draftsmith.models.llama import KVCache
    from draftsmith.train.ttt import unroll

    d, steps, t = random_drafter(tiny_cfg(**over)), 4, 10
    torch.manual_seed(2)
    x, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 3, 24)
    with torch.no_grad():
        fused = d.fuse(aux)
        ttt = torch.stack(list(unroll(d, x, fused, torch.arange(t)[None],
                                      torch.zeros(1, t, dtype=torch.long), steps)))[:, 0]
        for start in range(t - 1):
            caches = [KVCache(torch.zeros(1, 2, 32, 8), torch.zeros(1, 2, 32, 8))
                      for _ in d.layers]
            logits, h = d(x[:, 1 : start + 2], fused[:, : start + 1],
                          torch.arange(start + 1)[None], caches)
            assert torch.allclose(logits[0, -1], ttt[0, start], atol=1e-5)
            h = h[:, -1:]
            for j in range(1, min(steps, t - start - 1)):
                logits, h = d(x[:, start + j + 1 : start + j + 2], h,
                              torch.tensor([[start + j]]), caches)
                assert torch.allclose(logits[0, 0], ttt[j, start], atol=1e-5), (start, j)
