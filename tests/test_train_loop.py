"""The training loop: exact resume, NaN stop, refusals, online mode, 2-process DDP over gloo."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
from test_train_helpers import AUX, write_dataset

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, train
from draftsmith.train.batches import TokenSource, collate, pack, run_target
from draftsmith.train.checkpoint import list_checkpoints
from draftsmith.train.dist import setup as setup_ctx
from draftsmith.train.loop import Trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("train")
    target = load_target(tiny_llama_dir)
    data = write_dataset(root / "data", target, n=24)
    (root / "target").symlink_to(tiny_llama_dir)
    return root, target, data


def config(root, out, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                max_steps=6, batch_size=2, max_len=48, ttt_steps=3, lr=3e-3, log_every=1,
                save_every=3, keep_last=2, draft_vocab_size=64, progress=False, loader_workers=0)
    base.update(over)
    return TrainConfig(**base)


def log_rows(folder):
    rows = [json.loads(x) for x in (folder / "train_log.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("tokens_per_s")
    return rows


def counted_steps(monkeypatch) -> list[int]:
    """Trainer.train_step spied on: the list grows by one each step a run trains."""
    calls, real = [], Trainer.train_step

    def spy(self):
        calls.append(1)
        real(self)

    monkeypatch.setattr(Trainer, "train_step", spy)
    return calls


def test_resume_continues_exactly(setup, monkeypatch):
    """Logged every 2 steps, checkpointed every 3: the checkpoint at step 3 falls inside a log
    window, so the resumed step-4 row holds step 3's sums only if the window was restored; the
    resumed run trains steps 4-6 alone (a run restarted from scratch would equal the straight
    one too)."""
    root, _, _ = setup
    with pytest.warns(UserWarning, match="distinct assistant tokens"):
        train(config(root, "straight", log_every=2))
    calls = {"n": 0}
    real = Trainer.train_step

    def dies_at_step_5(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(Trainer, "train_step", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning):
        train(config(root, "cut", loader_workers=2, log_every=2))  # workers: the same order
    monkeypatch.setattr(Trainer, "train_step", real)
    with pytest.raises(DraftsmithError, match="--resume"):
        train(config(root, "cut", log_every=2))
    resumed = counted_steps(monkeypatch)
    train(config(root, "cut", resume=True, loader_workers=1, log_every=2))
    assert len(resumed) == 3  # steps 4-6, from the step-3 checkpoint
    monkeypatch.setattr(Trainer, "train_step", real)

    a, b = root / "straight", root / "cut"
    assert [r["step"] for r in log_rows(b)] == [2, 4, 6]
    assert log_rows(a) == log_rows(b)
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)
    assert [p.name for p in list_checkpoints(b)] == ["step-00000003", "step-00000006"]
    assert not [p for p in (b / "checkpoints").iterdir() if p.name.startswith(".")]
    assert (b / "train_curves.png").stat().st_size > 0
    losses = [r["loss"] for r in log_rows(a)]
    assert losses[-1] < losses[0]
    meta = json.loads((a / "draftsmith.json").read_text())
    assert meta["config"]["aux_layer_ids"] == AUX and meta["training"]["steps"] == 6
    with pytest.raises(DraftsmithError, match="lr was"):
        train(config(root, "cut", resume=True, lr=1e-3, log_every=2))


def test_time_limit_stops_at_a_checkpoint_and_resume_finishes_the_same_run(setup, monkeypatch):
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "whole", save_every=100))
    stale = root / "timed"
    stale.mkdir()
    (stale / "train_log.jsonl").write_text('{"step": 40, "loss": 9.0}\n')  # a killed run's row
    with pytest.warns(UserWarning):
        train(config(root, "timed", save_every=100, time_limit=0.0))
    assert [p.name for p in list_checkpoints(stale)] == ["step-00000001"]
    assert not (stale / "draftsmith.json").exists()  # no final drafter from a stopped run
    resumed = counted_steps(monkeypatch)
    train(config(root, "timed", save_every=100, resume=True, time_limit=3600.0))
    assert len(resumed) == 5  # steps 2-6: the resume started at the step-1 checkpoint
    assert log_rows(stale) == log_rows(root / "whole")
    da, db = load_drafter(root / "whole").state_dict(), load_drafter(stale).state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)


@pytest.mark.parametrize("option, value, said", [
    ("lr", -1.0, "--lr must be > 0, got -1.0"), ("lr", 0.0, "--lr must be > 0"),
    ("max_samples", -1, "--max-samples must be >= 1"), ("max_samples", 0, "--max-samples"),
    ("loader_workers", -2, "--loader-workers must be >= 0, got -2"),
    ("max_steps", 0, "--max-steps must be >= 1, got 0"), ("max_steps", -3, "--max-steps"),
    ("step_decay", -2.0, "--step-decay must be > 0"), ("warmup_ratio", 5.0, "--warmup-ratio"),
    ("warmup_ratio", -0.1, "--warmup-ratio"), ("warmup_steps", -1, "--warmup-steps"),
    ("profile_steps", -1, "--profile-steps must be >= 0"), ("time_limit", -1.0, "--time-limit"),
    ("keep_last", 0, "--keep-last must be >= 1"), ("keep_last", -1, "--keep-last"),
    ("grad_clip", -1.0, "--grad-clip must be > 0"), ("weight_decay", -1.0, "--weight-decay"),
    ("min_lr", 1.0, "--min-lr 1.0 is above --lr"), ("draft_vocab_size", 0, "--draft-vocab-size"),
])
def test_out_of_range_options_are_refused_by_flag(setup, option, value, said):
    root, _, _ = setup
    with pytest.raises(DraftsmithError, match=said):
        config(root, "never", **{option: value})
    assert not (root / "never").exists()


def test_out_must_be_a_training_runs_folder(setup):
    """A model folder (or a file) as --out is refused before anything is written; a run's own
    folder still needs --resume, and --resume into a drafter without checkpoints is refused."""
    root, target, _ = setup
    model = shutil.copytree(target.folder, root / "model_copy")
    weights = (model / "model.safetensors").read_bytes()
    with pytest.raises(DraftsmithError, match="holds .*config.json, .* not a draftsmith training"):
        train(config(root, "model_copy"))
    with pytest.raises(DraftsmithError, match="not a draftsmith training"):
        train(config(root, "model_copy", resume=True))
    assert (model / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in model.iterdir()) == sorted(
        p.name for p in target.folder.iterdir())
    (root / "afile").write_text("mine")
    with pytest.raises(DraftsmithError, match="afile: is a file, not a folder"):
        train(config(root, "afile"))
    assert (root / "afile").read_text() == "mine"
    lone = root / "lone"
    lone.mkdir()
    (lone / "model.safetensors").write_bytes(weights)
    with pytest.raises(DraftsmithError, match="holds model.safetensors, not a draftsmith"):
        train(config(root, "lone"))
    drafter = root / "drafter_only"
    with pytest.warns(UserWarning):
        train(config(root, "drafter_only", max_steps=1))
    shutil.rmtree(drafter / "checkpoints")
    meta = (drafter / "draftsmith.json").read_text()
    with pytest.raises(DraftsmithError, match="holds a drafter but no checkpoint"):
        train(config(root, "drafter_only", max_steps=1, resume=True))
    assert (drafter / "draftsmith.json").read_text() == meta


def test_aux_layers_unlike_the_datasets_are_refused(setup):
    root, _, _ = setup
    with pytest.raises(DraftsmithError, match=r"--aux-layers \[0, 1, 2\]: the dataset .* holds "
                       r"aux layers \[1, 2, 4\]"):
        Trainer(config(root, "aux", aux_layer_ids=[0, 1, 2]), setup_ctx("cpu"))
    with pytest.warns(UserWarning):
        t = Trainer(config(root, "aux", aux_layer_ids=[1, 2, 4]), setup_ctx("cpu"))
    assert t.drafter.cfg.aux_layer_ids == [1, 2, 4]


def test_draft_vocab_size_smaller_than_the_vocab_file_is_refused(setup):
    from draftsmith.data.vocab import build_vocab, count_dataset, save_vocab

    root, _, data = setup
    path = save_vocab(build_vocab(count_dataset(data, 128), 16, 128), root / "v16")
    with pytest.raises(DraftsmithError, match="--draft-vocab-size 8 conflicts with --vocab .*"
                       "holds 16 draft tokens"):
        Trainer(config(root, "v", vocab=str(path), draft_vocab_size=8), setup_ctx("cpu"))
    for size in (None, 16, 64):  # not given, equal, or a cap the file meets
        t = Trainer(config(root, "v", vocab=str(path), draft_vocab_size=size), setup_ctx("cpu"))
        assert t.drafter.cfg.draft_vocab_size == 16


def test_init_head_from_target_starts_from_its_readout(setup):
    root, target, _ = setup
    cfg = config(root, "inithead", max_steps=1, init_head="target")
    with pytest.warns(UserWarning):
        trainer = Trainer(cfg, setup_ctx("cpu"))
    d = trainer.drafter
    used = d.d2t + torch.arange(d.d2t.numel())
    head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
    assert torch.equal(d.lm_head.weight, head.float()[used])
    assert torch.equal(d.norm.weight, target.weights["model.norm.weight"].float())
    with pytest.raises(DraftsmithError, match="init_head"):
        config(root, "bad", init_head="zeros")


def test_init_from_starts_a_fresh_run_from_a_drafters_weights(setup):
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "base"))
    keep = dict(init_from=str(root / "base"), draft_vocab_size=None)  # the drafter's vocab
    warm = Trainer(config(root, "warm", **keep), setup_ctx("cpu"))
    base = load_drafter(root / "base").state_dict()
    got = warm.drafter.state_dict()
    assert all(torch.equal(got[k], base[k].to(got[k].dtype)) for k in base)
    assert warm.step == 0 and not warm.opt.state  # a fresh optimizer, from step 0
    train(config(root, "warm", **keep))  # its vocab: no recount, no warning
    first = [log_rows(root / d)[0]["loss"] for d in ("base", "warm")]
    assert first[1] < first[0]  # it starts where the base run got to, not from random weights
    with pytest.raises(DraftsmithError, match="init-head"):
        config(root, "both", init_from=str(root / "base"), init_head="target")


def assert_same_ttt_logits(a, b) -> None:
    """Drafters `a` and `b` give the same TTT logits, step by step, on random tokens and aux
    states: a grown drafter still computes what the drafter it grew from did."""
    from draftsmith.train.ttt import unroll

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.cfg.vocab_size, (2, 12), generator=g)
    n_aux = len(a.cfg.aux_layer_ids)
    aux = torch.randn(2, 12, n_aux, a.fc.in_features // n_aux, generator=g)
    pos, doc = torch.arange(12).expand(2, 12), torch.zeros(2, 12, dtype=torch.long)
    with torch.no_grad():
        for x, y in zip(unroll(a, tokens, a.fuse(aux), pos, doc, 3),
                        unroll(b, tokens, b.fuse(aux), pos, doc, 3), strict=True):
            assert torch.allclose(x, y, atol=1e-5)


def test_init_from_deepens_a_drafter_that_starts_as_the_shallow_one(setup):
    """--num-layers 2 from a 1-layer drafter: the old weights kept, the new layer adds nothing
    at first (TTT logits equal the old drafter's), then it trains; without --num-layers a warm
    start keeps the drafter's depth; fewer layers is an error."""
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "one", max_steps=2))
    keep = dict(init_from=str(root / "one"), draft_vocab_size=None)
    old = load_drafter(root / "one")
    deep = Trainer(config(root, "two", **keep, num_layers=2), setup_ctx("cpu")).drafter
    assert deep.cfg.num_layers == 2 and len(deep.extra_layers) == 1
    a, b = old.state_dict(), deep.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_ttt_logits(old, deep)
    train(config(root, "two", **keep, num_layers=2, max_steps=2))
    trained = load_drafter(root / "two")
    assert trained.cfg.num_layers == 2
    assert trained.extra_layers[0].mlp.down.weight.abs().sum() > 0  # it learned
    same = Trainer(config(root, "same", init_from=str(root / "two"), draft_vocab_size=None),
                   setup_ctx("cpu")).drafter  # no --num-layers: the drafter's own depth
    assert same.cfg.num_layers == 2
    b = trained.state_dict()
    assert all(torch.equal(v, b[k].to(v.dtype)) for k, v in same.state_dict().items())
    with pytest.raises(DraftsmithError, match="decoder layers 2 there, 1 here"):
        Trainer(config(root, "back", init_from=str(root / "two"), draft_vocab_size=None,
                       num_layers=1), setup_ctx("cpu"))


def test_init_from_widens_the_mlp_and_starts_as_the_narrow_drafter(setup):
    """--intermediate-size wider than a drafter's: its weights kept, the new MLP units silent at
    first (TTT logits equal the narrow drafter's), then they train; a new drafter takes the width
    asked for; narrower than the drafter is an error."""
    root, target, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "narrow", max_steps=2))
    old = load_drafter(root / "narrow")
    w = old.cfg.intermediate_size
    assert w == target.cfg.intermediate_size  # the default: the target's width
    keep = dict(init_from=str(root / "narrow"), draft_vocab_size=None)
    wide = Trainer(config(root, "wide", **keep, intermediate_size=3 * w),
                   setup_ctx("cpu")).drafter
    assert wide.cfg.intermediate_size == 3 * w
    gate_up, down = wide.midlayer.mlp.gate_up.weight, wide.midlayer.mlp.down.weight
    assert gate_up.shape[0] == 6 * w and down.shape[1] == 3 * w
    old_gate, old_up = old.midlayer.mlp.gate_up.weight.split(w)
    assert torch.equal(gate_up[:w], old_gate) and torch.equal(gate_up[3 * w : 4 * w], old_up)
    assert torch.equal(down[:, :w], old.midlayer.mlp.down.weight)
    assert not down[:, w:].any() and gate_up[w : 3 * w].abs().sum() > 0  # silent, not dead
    assert_same_ttt_logits(old, wide)
    both = Trainer(config(root, "both", **keep, intermediate_size=3 * w, num_layers=2),
                   setup_ctx("cpu")).drafter  # widened, then deepened at the new width
    assert both.extra_layers[0].mlp.down.weight.shape[1] == 3 * w
    assert_same_ttt_logits(old, both)
    train(config(root, "wide", **keep, intermediate_size=3 * w, max_steps=2))
    trained = load_drafter(root / "wide")
    assert trained.cfg.intermediate_size == 3 * w
    assert trained.midlayer.mlp.down.weight[:, w:].abs().sum() > 0  # the new units learned
    with pytest.raises(DraftsmithError, match=f"MLP width {3 * w} there, {w} here"):
        Trainer(config(root, "back", init_from=str(root / "wide"), draft_vocab_size=None,
                       intermediate_size=w), setup_ctx("cpu"))
    with pytest.warns(UserWarning):
        fresh = Trainer(config(root, "fresh", intermediate_size=2 * w), setup_ctx("cpu")).drafter
    assert fresh.cfg.intermediate_size == 2 * w
    with pytest.raises(DraftsmithError, match="--intermediate-size must be >= 1"):
        config(root, "zero", intermediate_size=0)


def test_init_from_regrows_the_draft_vocab(setup):
    """A larger draft vocab than the drafter's: every weight kept, each head row moved to its
    token's new row, rows of new tokens fresh; the run then trains."""
    root, _, _ = setup
    train(config(root, "small", draft_vocab_size=16))
    old = load_drafter(root / "small")
    with pytest.warns(UserWarning, match="distinct assistant tokens"):
        grown = Trainer(config(root, "grown", init_from=str(root / "small"), draft_vocab_size=64),
                        setup_ctx("cpu")).drafter
    assert grown.cfg.draft_vocab_size == 31 and old.cfg.draft_vocab_size == 16
    new_ids = grown.to_target(torch.arange(31)).tolist()
    old_row = {t: i for i, t in enumerate(old.to_target(torch.arange(16)).tolist())}
    assert set(old_row) < set(new_ids)
    for i, t in enumerate(new_ids):
        if t in old_row:
            assert torch.equal(grown.lm_head.weight[i], old.lm_head.weight[old_row[t]])
        else:
            assert not any(torch.equal(grown.lm_head.weight[i], r) for r in old.lm_head.weight)
    a, b = old.state_dict(), grown.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ("lm_head.weight", "d2t", "t2d"))
    with pytest.warns(UserWarning, match="distinct assistant tokens"):
        train(config(root, "grown", init_from=str(root / "small"), draft_vocab_size=64))
    assert load_drafter(root / "grown").cfg.draft_vocab_size == 31


def test_profiled_steps_write_phases_and_change_nothing(setup):
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "plain", save_every=100))
    with pytest.warns(UserWarning):
        train(config(root, "profiled", save_every=100, profile_steps=2))
    assert log_rows(root / "plain") == log_rows(root / "profiled")
    rep = json.loads((root / "profiled" / "profile.json").read_text())
    assert rep["steps"] == 2 and rep["wall_ms_per_step"] > 0
    assert set(rep["phase_ms"]) == {"batch", "target", "targets", "forward", "backward",
                                    "optimizer", "stats"}
    assert 0.5 * rep["wall_ms_per_step"] < sum(rep["phase_ms"].values()) <= rep[
        "wall_ms_per_step"] * 1.01
    assert "aten::" in (root / "profiled" / "profile.txt").read_text()
    assert not (root / "plain" / "profile.json").exists()


@pytest.mark.slow  # compiles the loss on CPU (~13 s); test_train_ttt checks compiled = eager
def test_compiled_loss_trains_the_same_run(setup, monkeypatch):
    """--compile-loss changes how the loss is computed, not the run: the same losses,
    accuracies and gradient norms step by step (float rounding aside)."""
    from draftsmith.train import loop

    root, _, _ = setup
    calls, real = [], loop.compiled_step_loss()

    def spy(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(loop, "compiled_step_loss", lambda: spy)
    with pytest.warns(UserWarning):
        train(config(root, "eager_loss", save_every=100, max_steps=3))
    assert calls == []
    with pytest.warns(UserWarning):
        train(config(root, "compiled_loss", save_every=100, max_steps=3, compile_loss=True))
    assert calls == [0, 1, 2] * 3  # every TTT step of every optimizer step went through it
    a, b = log_rows(root / "eager_loss"), log_rows(root / "compiled_loss")
    assert len(a) == len(b) == 3
    saved = [json.loads((root / r / "draftsmith.json").read_text())["training"]["config"]
             for r in ("eager_loss", "compiled_loss")]
    assert [c["compile_loss"] for c in saved] == [False, True]  # what ran, not the None default
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        for key in ("loss", "grad_norm", "accept_length"):
            assert y[key] == pytest.approx(x[key], rel=1e-4), key
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-6)


def test_padded_batch_widths_train_the_same_run(setup):
    """--pad-multiple (the GPU default rounds widths up to 128) only adds padding: the same
    losses and accuracies step by step, and widths land on the multiple or on max_len."""
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "pad1", save_every=100, max_steps=4, pad_multiple=1))
    with pytest.warns(UserWarning):
        train(config(root, "pad32", save_every=100, max_steps=4, pad_multiple=32))
    a, b = log_rows(root / "pad1"), log_rows(root / "pad32")
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-6)
    src = TokenSource([([1, 5, 9, 30, 44, 7], [0, 0, 1, 1, 1, 1]), ([3, 8, 8, 20], [0, 1, 1, 1]),
                       ([4, 4, 60, 61, 62], [0, 0, 0, 1, 1])])
    rows = pack([0, 1, 2], src.lengths(), 11)
    exact = collate(src, rows)
    assert exact.tokens.shape[1] == 10
    assert collate(src, rows, 4, 11).tokens.shape[1] == 11  # 12 would pass max_len
    padded = collate(src, rows, 8, 64)
    assert padded.tokens.shape[1] == 16
    assert torch.equal(padded.tokens[:, :10], exact.tokens)
    assert torch.equal(padded.doc[:, :10], exact.doc) and (padded.doc[:, 10:] == -1).all()
    assert not padded.loss_mask[:, 10:].any()


def test_a_run_ending_inside_the_profiled_window_writes_no_profile(setup):
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "shortprof", max_steps=4, save_every=100, profile_steps=5))
    assert (root / "shortprof" / "draftsmith.json").exists()
    assert not (root / "shortprof" / "profile.json").exists()


def test_device_busy_time_is_the_union_of_kernel_spans():
    from draftsmith.train.profile import union_us

    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25  # overlap counted once
    assert union_us([]) == 0


@pytest.mark.parametrize("log_every", [1, 100])  # 100: the check runs a step late
def test_non_finite_loss_names_step_and_samples(setup, log_every):
    root, target, _ = setup
    if not (root / "poisoned").exists():
        write_dataset(root / "poisoned", target, n=8, poison=5)
    cfg = config(root, f"nan{log_every}", data=str(root / "poisoned"), batch_size=1, max_len=24,
                 max_steps=8, log_every=log_every)
    with pytest.raises(DraftsmithError, match=r"loss is nan at step \d+ .*id s5"), \
            pytest.warns(UserWarning):
        train(cfg)
    out = root / f"nan{log_every}"
    assert not list_checkpoints(out) or all(
        torch.isfinite(load_drafter(p).fc.weight).all() for p in list_checkpoints(out))


def test_non_finite_gradient_norm_stops_the_run_too(setup, monkeypatch):
    """A finite loss with a NaN gradient (here forced) stops before any checkpoint is written
    after it, and the error says it was the gradient."""
    from draftsmith.train import loop

    root, _, _ = setup
    real, seen = torch.nn.utils.clip_grad_norm_, []

    def clip(params, max_norm):
        seen.append(1)
        norm = real(params, max_norm)
        return norm * float("nan") if len(seen) == 4 else norm

    monkeypatch.setattr(loop.torch.nn.utils, "clip_grad_norm_", clip)
    said = r"gradient norm is nan with a finite loss at step 4"
    with pytest.raises(DraftsmithError, match=said), pytest.warns(UserWarning):
        train(config(root, "nangrad", save_every=2))
    assert [int(p.name.split("-")[1]) for p in list_checkpoints(root / "nangrad")] == [2]


def test_pread_reader_equals_the_dataset(setup):
    from draftsmith.data.shards import Dataset
    from draftsmith.train.reader import ShardReader

    ds = Dataset(setup[2])
    reader = ShardReader(ds)
    for i in range(len(ds)):
        a, b = ds[i], reader[i]
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (i, k)


def test_online_aux_equals_offline_capture_of_packed_rows(setup):
    """Each packed document gets the states it gets alone, in the shards' bf16."""
    _, target, _ = setup
    model = target.build(torch.float32)
    seqs = [([1, 5, 9, 30, 44, 7], [0, 0, 1, 1, 1, 1]), ([3, 8, 8, 20], [0, 1, 1, 1]),
            ([4, 4, 60, 61, 62], [0, 0, 0, 1, 1])]
    src = TokenSource(seqs)
    rows = pack([0, 1, 2], src.lengths(), 11)
    assert rows == [[(0, 6), (1, 4)], [(2, 5)]]
    batch = run_target(model, collate(src, rows), tuple(AUX))
    with torch.no_grad():
        for r, row in enumerate(rows):
            at = 0
            for i, n in row:
                ids = torch.tensor([seqs[i][0]])
                fo = model(ids, torch.arange(n)[None], aux_ids=tuple(AUX), want_logits=False)
                for got, want in ((batch.aux, fo.aux), (batch.hidden, fo.hidden)):
                    assert got.dtype == torch.bfloat16
                    assert torch.allclose(got[r, at : at + n].float(), want[0], atol=1e-5,
                                          rtol=2**-8)
                at += n


def test_online_aux_of_a_sliding_window_target_equals_its_forward_per_document(tmp_path):
    """A target attending over a window of 3 (Mistral's kind): packed documents get the states
    each gets alone, past the window too (the packed mask saw the whole document)."""
    from conftest import write_tiny_folder

    from draftsmith.targets import load_target

    target = load_target(write_tiny_folder(tmp_path / "m", "mistral", sliding_window=3))
    model = target.build(torch.float32)
    seqs = [([1, 5, 9, 30, 44, 7, 12], [0, 0, 1, 1, 1, 1, 1]), ([3, 8, 8, 20, 21], [0, 1, 1, 1, 1])]
    src = TokenSource(seqs)
    rows = pack([0, 1], src.lengths(), 12)
    assert rows == [[(0, 7), (1, 5)]]
    batch = run_target(model, collate(src, rows), (0, 1))
    with torch.no_grad():
        at = 0
        for i, n in rows[0]:
            fo = model(torch.tensor([seqs[i][0]]), torch.arange(n)[None], aux_ids=(0, 1),
                       want_logits=False)
            assert torch.allclose(batch.hidden[0, at : at + n].float(), fo.hidden[0], atol=1e-5,
                                  rtol=2**-8)
            at += n


def test_online_training_from_conversations(setup, tmp_path):
    root, _, _ = setup
    convs = tmp_path / "convs.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"count {i}"},
                           {"role": "assistant", "content": "abcabc abcabc " * (1 + i % 3)}]}
             for i in range(6)]
    convs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.warns(UserWarning):
        train(config(root, "online", data=None, prompts=str(convs), max_steps=2, max_len=64,
                     aux_layer_ids=[1, 3, 4]))
    d = load_drafter(root / "online")
    assert d.cfg.aux_layer_ids == [1, 3, 4]
    assert log_rows(root / "online")[-1]["step"] == 2
    # a stopped online run resumes only on the layers (and target) its drafter reads
    with pytest.warns(UserWarning):
        train(config(root, "online_stop", data=None, prompts=str(convs), max_steps=4,
                     max_len=64, aux_layer_ids=[1, 3, 4], time_limit=0.0))
    with pytest.raises(DraftsmithError, match=r"aux layers \[1, 3, 4\] in that run, \[0, 2, 5\]"):
        train(config(root, "online_stop", data=None, prompts=str(convs), max_steps=4,
                     max_len=64, aux_layer_ids=[0, 2, 5], resume=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, cfg: TrainConfig, dump: str) -> None:
    import warnings

    from safetensors.torch import save_file

    from draftsmith.train.dist import setup as dist_setup

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    ctx = dist_setup("cpu")
    try:
        t = Trainer(cfg, ctx)
        t.run()
        save_file({k: v.contiguous() for k, v in t.drafter.state_dict().items()},
                  f"{dump}/rank{rank}.safetensors")
    finally:
        ctx.close()


def test_two_process_ddp_over_gloo_keeps_ranks_identical(setup, tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    root, _, _ = setup
    cfg = config(root, "ddp", max_steps=3, batch_size=1, save_every=2)
    # fork: the children inherit the imported modules (a spawn re-imports torch and transformers)
    mp.start_processes(_ddp_worker, args=(2, _free_port(), cfg, str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    a, b = load_file(tmp_path / "rank0.safetensors"), load_file(tmp_path / "rank1.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = load_drafter(root / "ddp").state_dict()
    assert all(torch.equal(saved[k], a[k]) for k in a)
    state = torch.load(list_checkpoints(root / "ddp")[-1] / "trainer_state.pt",
                       weights_only=False)
    assert state["world"] == 2 and state["step"] == 3
    with pytest.raises(DraftsmithError, match="2 ranks"):
        train(config(root, "ddp", max_steps=3, batch_size=1, save_every=2, resume=True))


@pytest.mark.filterwarnings("ignore:only .* distinct assistant tokens")
def test_cli_train_export_import(setup, tmp_path):
    import typer
    from typer.testing import CliRunner

    from draftsmith.export.cli import export, import_
    from draftsmith.train.cli import train as train_cmd

    root, _, _ = setup
    app = typer.Typer()
    app.command("train")(train_cmd)
    app.command("export")(export)
    app.command("import")(import_)
    run = CliRunner().invoke
    r = run(app, ["train", "--out", str(tmp_path / "d"), "--data", str(root / "data"),
                  "--max-steps", "2", "--batch-size", "1", "--max-len", "32", "--ttt-steps", "2",
                  "--draft-vocab-size", "64", "--no-progress", "--log-every", "1",
                  "--target", str(root / "target")])
    assert r.exit_code == 0, r.output
    r = run(app, ["export", str(tmp_path / "d"), "--format", "sglang", "--out",
                  str(tmp_path / "sg"), "--dtype", "bf16"])
    assert r.exit_code == 0, r.output
    assert "written for SGLang as [1, 2, 4]" in r.output
    r = run(app, ["export", str(tmp_path / "d"), "-f", "speculators", "-o", str(tmp_path / "sp")])
    assert r.exit_code == 0 and "[2, 3, 5]" in r.output, r.output
    r = run(app, ["import", str(tmp_path / "sg"), "--out", str(tmp_path / "back"), "--target",
                  str(root / "target")])
    assert r.exit_code == 0, r.output
    assert load_drafter(tmp_path / "back").cfg.aux_layer_ids == AUX
    meta = json.loads((tmp_path / "d" / "draftsmith.json").read_text())
    assert meta["training"]["config"]["extra"]["command"].startswith("draftsmith")


def test_cli_train_prints_the_vocab_warning_as_one_line(setup, tmp_path):
    import typer
    from typer.testing import CliRunner

    from draftsmith.train.cli import train as train_cmd

    root, _, _ = setup
    app = typer.Typer()
    app.command("train")(train_cmd)
    app.command("other")(lambda: None)
    r = CliRunner().invoke(app, [
        "train", "--out", str(tmp_path / "d"), "--data", str(root / "data"), "--max-steps", "1",
        "--max-len", "32", "--ttt-steps", "2", "--draft-vocab-size", "500", "--no-progress",
        "--target", str(root / "target"), "--device", "cpu", "--loader-workers", "0"])
    assert r.exit_code == 0, r.output
    assert "draftsmith train: warning: only 31 distinct assistant tokens" in r.output
    assert "UserWarning" not in r.output and "loop.py" not in r.output


def test_online_data_masks_as_capture_does_and_refuses_unordered_layers(target, tmp_path):
    """Online training encodes conversations as capture stores them: a turn cut at max tokens
    leaves its end-of-turn marker out of the loss; aux layers out of order are refused."""
    from draftsmith.data.capture import CaptureConfig, encode_sample
    from draftsmith.data.prompts import Conversation
    from draftsmith.train.sources import open_online

    msgs = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "on and on"}]
    conv = Conversation(msgs, meta={"answers": [{"turn": 0, "finish": "length"}]})
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(conv.to_json()) + "\n")
    data = open_online(path, target, [1, 3], None)
    ids, mask = data.source.samples[0]
    stored, stored_mask, _ = encode_sample(target.tokenizer, conv, CaptureConfig([1, 3]))
    assert (list(ids), list(mask)) == (stored, stored_mask)
    kept = target.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert kept == "on and on"  # no <|im_end|>: the target did not end the turn
    with pytest.raises(DraftsmithError, match="not ascending.*give --aux-layers 1,3"):
        open_online(path, target, [3, 1], None)


def test_a_vocab_file_that_maps_wrongly_is_refused_before_training(setup):
    """--vocab is checked as the doctor checks an exported drafter: target ids outside the
    target (an IndexError at the first batch), two draft ids for one token, or a t2d unlike d2t
    (a drafter exported with both) are refused by name; an unsorted map is fine."""
    from safetensors.torch import save_file

    root, _, _ = setup
    cases = {"outside": ([3, 5, 200], "map outside the target vocab .* draft 2 -> 200"),
             "negative": ([-1, 3, 5], r"draft 0 -> -1"), "twice": ([3, 5, 5], "several draft"),
             "t2d": ([3, 5, 9], "t2d marks 4 tokens, not exactly"), "unsorted": ([9, 3, 5], "")}
    for name, (used, said) in cases.items():
        used = torch.tensor(used)
        t2d = torch.zeros(128, dtype=torch.bool)
        t2d[used.clamp(0, 127)] = True
        t2d[10] = name == "t2d"
        path = root / f"vocab_{name}.safetensors"
        save_file({"d2t": used - torch.arange(3), "t2d": t2d}, str(path))
        cfg = config(root, f"vocab_{name}", vocab=str(path), draft_vocab_size=None)
        if not said:
            assert Trainer(cfg, setup_ctx("cpu")).drafter.to_target(torch.arange(3)).tolist() \
                == [9, 3, 5]
            continue
        with pytest.raises(DraftsmithError, match=f"vocab_{name}.safetensors: .*{said}"):
            Trainer(cfg, setup_ctx("cpu"))


def test_resume_on_changed_data_is_refused(setup):
    """A dataset grown (or rewritten) in place since the checkpoint would change the data order
    and the schedule's length under the same --data path: --resume says so."""
    root, target, _ = setup
    grow = root / "grow"
    shutil.copytree(root / "data", grow)
    with pytest.warns(UserWarning):
        train(config(root, "grown_data", data=str(grow), time_limit=0.0, max_steps=2))
    shutil.rmtree(grow)
    write_dataset(grow, target, n=30)
    with pytest.raises(DraftsmithError, match="the data changed since that run: 24 samples of "
                       r"\d+ tokens then, 30 of \d+ now"):
        train(config(root, "grown_data", data=str(grow), resume=True, max_steps=2))


def test_a_device_typo_is_refused_by_name():
    for device in ("gpu", "meta", "cuda1"):
        with pytest.raises(DraftsmithError, match=f"--device {device}: training runs on cpu, "):
            setup_ctx(device)


def test_resume_after_a_row_cut_short_and_names_an_unreadable_rng_file(setup):
    """A log row cut short by a kill while it was appended is dropped on --resume (it came
    after the checkpoint) instead of a JSONDecodeError; a damaged RNG file is named."""
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "torn", time_limit=0.0, max_steps=2, save_every=100))
    log = root / "torn" / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 2, "lo')
    train(config(root, "torn", max_steps=2, save_every=100, resume=True))
    assert [r["step"] for r in log_rows(root / "torn")] == [1, 2]
    rng = list_checkpoints(root / "torn")[-1] / "rng-0.pt"
    rng.write_bytes(b"cut")
    with pytest.raises(DraftsmithError, match="rng-0.pt: unreadable checkpoint"):
        train(config(root, "torn", max_steps=2, save_every=100, resume=True))


def test_init_from_refuses_a_norm_its_drafter_was_trained_without(setup):
    """--init-from cannot add a norm to trained weights: asked for, it is refused by flag
    (it was silently dropped while the run's config said it was on)."""
    root, _, _ = setup
    with pytest.warns(UserWarning):
        train(config(root, "plain_norms", max_steps=1))
    with pytest.raises(DraftsmithError, match="--fc-norm False there, True here; --norm-output"):
        Trainer(config(root, "more_norms", init_from=str(root / "plain_norms"),
                       draft_vocab_size=None, fc_norm=True, norm_output=True), setup_ctx("cpu"))


def test_online_data_cut_at_max_len_keeps_the_identity_its_checkpoints_recorded(target,
                                                                                  tmp_path):
    """Online samples are now cut at --max-len as capture cuts them (packing cut them later
    before), which changed the data's identity: `--resume` of yesterday's online run said the
    data changed. The identity stays that of the uncut samples, so the order and the checkpoint
    agree; a sample the cut leaves no answer token is gone, and that is a change."""
    import hashlib

    from draftsmith.train.sources import open_online

    long = "word " * 40
    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": long}],
            [{"role": "user", "content": "word " * 15}, {"role": "assistant", "content": "ok"}]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    full = open_online(path, target, None, None)
    cut = open_online(path, target, None, None, max_len=120)
    assert max(cut.lengths) == 120 < max(full.lengths)
    assert cut.identity() == full.identity()
    digest = hashlib.sha256(json.dumps(full.lengths).encode()).hexdigest()[:16]
    assert full.identity()["lengths"] == digest  # what checkpoints before the cut recorded
    assert len(open_online(path, target, None, None, max_len=60).lengths) == 1
