"""Training review 21: the draft vocab counts only the tokens the loss can see (the first
--max-len of each sample), offline and online alike, and a resume keeps its stored vocab."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import TrainConfig, train
from draftsmith.train.sources import Data

MAX_LEN = 64
LATE = "~"  # a character only the long answer holds, and only past MAX_LEN


def conversations() -> list[dict]:
    rows = [[{"role": "user", "content": f"q{i}"},
             {"role": "assistant", "content": "abc abd " * (1 + i % 3)}] for i in range(5)]
    rows.append([{"role": "user", "content": "long"},
                 {"role": "assistant", "content": "abc " * 30 + LATE * 4}])
    return [{"messages": m} for m in rows]


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_llama_dir, target):
    """(root, prompts file, a capture of it cut far past MAX_LEN) for the tiny llama."""
    root = tmp_path_factory.mktemp("review21")
    (root / "target").symlink_to(tiny_llama_dir)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    convs = [Conversation(c["messages"]) for c in conversations()]
    cfg = CaptureConfig(aux_layer_ids=[1, 2, 4], batch_size=3, samples_per_shard=4, max_len=400)
    capture(target, convs, root / "data", cfg, progress=False, log=lambda s: None,
            command=f"draftsmith data capture {prompts} --out {root / 'data'}")
    return root, prompts, root / "data"


def config(root: Path, out: str, **over) -> TrainConfig:
    base = dict(out=str(root / out), target=str(root / "target"), max_steps=2, batch_size=1,
                max_len=MAX_LEN, ttt_steps=2, lr=3e-3, log_every=1, save_every=1, keep_last=3,
                draft_vocab_size=100, progress=False, loader_workers=0)
    base.update(over)
    return TrainConfig(**base)


def quiet(cfg: TrainConfig) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)


def used(folder: Path) -> list[int]:
    d = load_drafter(folder)
    return (d.d2t + torch.arange(d.d2t.numel())).tolist()


def test_offline_and_online_vocabs_count_the_same_tokens_those_within_max_len(both, target):
    """Offline training counted every loss-masked token of the shards, those past --max-len
    too (which it never trains on), online only those within it: one data, two vocabs. Now
    both count the tokens within --max-len, --max-samples' first shards alike."""
    root, prompts, data = both
    late = target.tokenizer.encode(LATE, add_special_tokens=False)[-1]
    quiet(config(root, "online", prompts=str(prompts), aux_layer_ids=[1, 2, 4]))
    quiet(config(root, "offline", data=str(data)))
    quiet(config(root, "head", data=str(data), max_samples=6))
    online = used(root / "online")
    assert late not in online
    assert used(root / "offline") == online
    assert used(root / "head") == online


def old_counts(self: Data, vocab: int, max_len: int | None = None) -> torch.Tensor:
    """The count before this review: every loss-masked token, past --max-len too."""
    from draftsmith.data.vocab import count_ids
    from draftsmith.train.sources import token_pairs

    pairs = token_pairs(self.source)
    return count_ids(((i.tolist(), m.tolist()) for i, m in pairs), vocab)


def test_a_resume_keeps_the_vocab_its_checkpoint_stored(both, target, monkeypatch):
    """A run stopped before this change counted the late token into its vocab; resumed now,
    it keeps the vocab its checkpoint stored and ends as the uninterrupted run does."""
    root, _, data = both
    late = target.tokenizer.encode(LATE, add_special_tokens=False)[-1]
    monkeypatch.setattr(Data, "token_counts", old_counts)
    quiet(config(root, "straight", data=str(data), max_steps=3))
    quiet(config(root, "cut", data=str(data), max_steps=3, time_limit=0.0))
    monkeypatch.undo()
    quiet(config(root, "cut", data=str(data), max_steps=3, resume=True))
    assert late in used(root / "straight")
    assert used(root / "cut") == used(root / "straight")
    a, b = load_drafter(root / "straight").state_dict(), load_drafter(root / "cut").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_drafter_of_another_hidden_size_without_a_fingerprint_is_refused(
        both, tmp_path):
    """A drafter recording no target fingerprint (an imported EAGLE-3 checkpoint) made for a
    target of hidden size 32 passed --init-from against data of hidden size 64, and the run
    crashed at its first step ("mat1 and mat2 shapes cannot be multiplied"). Now it is refused
    before training, in one line naming both sizes and --target."""
    from conftest import write_tiny_folder
    from test_train_helpers import write_dataset

    from draftsmith.errors import DraftsmithError
    from draftsmith.targets import load_target

    root, _, data = both
    small = write_tiny_folder(tmp_path / "small", "llama", hidden_size=32, intermediate_size=64)
    write_dataset(tmp_path / "data_s", load_target(small), n=4)
    quiet(config(tmp_path, "d_small", data=str(tmp_path / "data_s"), target=str(small),
                 max_steps=1, max_len=48))
    meta = tmp_path / "d_small" / "draftsmith.json"
    m = json.loads(meta.read_text())
    for key in ("target_fingerprint", "target_source"):
        m["config"].pop(key)
    meta.write_text(json.dumps(m))
    with pytest.raises(DraftsmithError) as e:
        quiet(config(root, "grown", data=str(data), init_from=str(tmp_path / "d_small")))
    msg = str(e.value)
    assert "\n" not in msg and "target hidden size 32 there, 64 here" in msg, msg
    assert "--target" in msg, msg
    assert not (root / "grown").exists()  # refused before --out is made: nothing lost


def test_max_samples_keeps_the_manifest_so_the_advice_names_the_capture(both, target):
    """Offline with --max-samples, the data lost its manifest (None marked "count every
    shard"), so the low-coverage advice forgot the command that made the data and gave the
    generic one. Now the first samples' data keep it: the advice is the whole data's."""
    from draftsmith.train.loop import more_data_advice
    from draftsmith.train.sources import open_offline

    _, _, data = both
    whole = more_data_advice(open_offline(data, target, None), str(data))
    assert "`data regenerate --temperature 0`" in whole, whole
    assert more_data_advice(open_offline(data, target, 2), str(data)) == whole


def test_online_holds_samples_to_the_targets_positions_as_capture_does(target, tmp_path):
    """Capture holds conversations to the target's max_position_embeddings (512 here); online
    training cut them at --max-len only, so it trained on states of positions the target never
    saw and differed from offline training on a capture of the same file. Now it holds them
    too, said in one warning."""
    from draftsmith.train.sources import open_online

    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 10}],
            [{"role": "user", "content": "long"}, {"role": "assistant", "content": "ab " * 300}]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    most = target.cfg.max_position_embeddings
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        data = open_online(path, target, None, None, max_len=2048)
    assert max(data.lengths) == most, data.lengths
    lines = [str(w.message) for w in said if "max_position_embeddings" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and f"{most} tokens" in lines[0], lines
