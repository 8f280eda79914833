"""Training review: refusals before any long work, online training equal to offline training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_train_helpers import AUX

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, train
from draftsmith.train.dist import setup as setup_ctx
from draftsmith.train.loop import Trainer


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def config(root, out, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), max_steps=4, batch_size=2,
                max_len=48, ttt_steps=3, lr=3e-3, log_every=1, save_every=100,
                draft_vocab_size=64, progress=False, loader_workers=0)
    base.update(over)
    return TrainConfig(**base)


def test_a_batch_size_the_data_cannot_fill_is_refused_before_training(root, tiny_llama_dir):
    """With --max-steps the packing was first tried in the loader (a worker's traceback after
    the run had begun); now the Trainer refuses it, with no --out made, in one line."""
    cfg = config(root, "too_wide", target=str(tiny_llama_dir), batch_size=12, max_len=400)
    with pytest.raises(DraftsmithError, match=r"^epoch 0: the data packs into 2 row\(s\) of 400 "
                       r"tokens per rank, fewer than --batch-size 12; lower --batch-size$"):
        Trainer(cfg, setup_ctx("cpu"))
    assert not (root / "too_wide").exists()


def test_shards_unlike_their_manifest_are_refused_before_training(root, tiny_llama_dir):
    """A manifest naming two aux layers over shards holding three failed with a shape error
    inside the first step; each shard's states are checked against it up front."""
    edited = root / "two_aux"
    shutil.copytree(root / "data", edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["aux_layer_ids"] = [1, 2]
    (edited / "manifest.json").write_text(json.dumps(manifest))
    cfg = config(root, "two_aux_run", data=str(edited), target=str(tiny_llama_dir))
    with pytest.raises(DraftsmithError, match=r"shard-00000.safetensors: holds aux states "
                       r"\[3, 64\] and hidden \[64\] a token, but the manifest says 2 aux"):
        Trainer(cfg, setup_ctx("cpu"))


def refusing_target(src, dst):
    """The tiny target whose chat template refuses a conversation opened by 'BOOM'."""
    shutil.copytree(src, dst)
    jinja = dst / "chat_template.jinja"
    jinja.write_text("{% if messages[0]['content'] == 'BOOM' %}{{ raise_exception('roles must "
                     "alternate') }}{% endif %}" + jinja.read_text())
    return dst


def test_online_training_equals_offline_training_on_a_capture(root, tiny_llama_dir):
    """The same conversations captured then trained on, or trained on live, give the same
    drafter: online states are rounded to the shards' bf16, conversations are cut at --max-len
    before those without an assistant token are dropped (one here answers only past it), and
    those the chat template refuses are skipped as capture skips them."""
    from draftsmith.data.capture import CaptureConfig, capture
    from draftsmith.data.prompts import load_prompts
    from draftsmith.data.vocab import build_vocab, save_vocab

    target_dir = refusing_target(tiny_llama_dir, root / "refusing")
    target = load_target(target_dir)
    lines = [[{"role": "user", "content": f"count {i}"},
              {"role": "assistant", "content": "abcabc abcabc " * (1 + i % 3)}] for i in range(8)]
    lines[3] = [{"role": "user", "content": "BOOM"}, {"role": "assistant", "content": "abc"}]
    lines[5] = [{"role": "user", "content": "x" * 70}, {"role": "assistant", "content": "late"}]
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    capture(target, load_prompts(convs).conversations, root / "cap",
            CaptureConfig(AUX, max_len=64), progress=False, log=lambda s: None)
    # every token in the draft vocab: the random target's argmax counts wherever it falls
    counts = torch.ones(target.cfg.vocab_size, dtype=torch.int64)
    vocab = save_vocab(build_vocab(counts, target.cfg.vocab_size), root / "vocab")
    common = dict(target=str(target_dir), max_len=64, vocab=str(vocab), draft_vocab_size=None)
    train(config(root, "offline", data=str(root / "cap"), **common))
    with pytest.warns(UserWarning, match=r"refused 1 conversation.*conversation 3 .*alternate"):
        train(config(root, "online", data=None, prompts=str(convs), aux_layer_ids=AUX,
                     **common))
    off, on = load_drafter(root / "offline"), load_drafter(root / "online")
    a, b = off.state_dict(), on.state_dict()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-5
    rows = [json.loads(x) for x in (root / "online" / "train_log.jsonl").read_text().splitlines()]
    meta = json.loads((root / "online" / "draftsmith.json").read_text())
    assert meta["data"]["samples"] == 6 and meta["data"]["skipped_template_refused"] == 1
    assert rows[-1]["loss"] > 0
