"""Training review 23: online --max-samples takes the first N samples a capture of the same
conversations holds (skipped conversations count for none), as offline --max-samples does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train_helpers import write_dataset
from test_train_review13 import said

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target
from draftsmith.train import TrainConfig, train
from draftsmith.train.sources import open_offline, open_online


def half_answered(n: int) -> list[list[dict]]:
    """n conversations, the odd ones without an answer (nothing of them trains)."""
    out = []
    for i in range(n):
        m = [{"role": "user", "content": f"q{i}"}]
        if i % 2 == 0:
            m.append({"role": "assistant", "content": "ab " * (3 + i)})
        out.append(m)
    return out


def write(path: Path, rows: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def test_online_max_samples_equals_offline_max_samples_on_a_capture(target, tmp_path):
    """Online --max-samples 3 cut the conversations first and skipped after: 2 samples (and a
    --batch-size 3 refused), where offline --max-samples 3 on a capture of them trains 3."""
    every = half_answered(8)
    path = write(tmp_path / "p.jsonl", every)
    capture(target, [Conversation(m) for m in every], tmp_path / "data",
            CaptureConfig(aux_layer_ids=[1, 2, 4], batch_size=2, max_len=400), progress=False,
            log=lambda s: None, command="test")
    off = open_offline(tmp_path / "data", target, 3, max_len=400)
    on, lines = said(lambda: open_online(path, target, [1, 2, 4], 3, max_len=400))
    assert on.lengths == off.lengths and len(on.lengths) == 3
    assert on.summary["samples"] == 3
    # the skipped ones counted among the conversations it read: up to the third sample's
    hits = [x for x in lines if "no assistant answer" in x]
    assert len(hits) == 1 and "2 of 5 conversation(s)" in hits[0], lines


def test_online_max_samples_past_the_data_takes_every_sample(target, tmp_path):
    path = write(tmp_path / "p.jsonl", half_answered(5))
    on, _ = said(lambda: open_online(path, target, None, 50, max_len=400))
    whole, _ = said(lambda: open_online(path, target, None, None, max_len=400))
    assert on.lengths == whole.lengths and len(on.lengths) == 3
    assert on.identity() == whole.identity()


def convs_file(path: Path) -> Path:
    return write(path, [[{"role": "user", "content": f"q{i}"},
                         {"role": "assistant", "content": "ab cd " * (4 + i)}] for i in range(6)])


def small(out: Path, **over) -> TrainConfig:
    base = dict(out=str(out), max_steps=3, batch_size=1, max_len=48, ttt_steps=2, log_every=1,
                save_every=100, draft_vocab_size=64, progress=False, loader_workers=0,
                time_limit=0.0)
    return TrainConfig(**{**base, **over})


def test_an_online_resume_without_its_aux_layers_names_the_flag(tiny_llama_dir, tmp_path):
    """An online run on --aux-layers 1,3,4 resumed without them said "resume with the same
    options" and no option: now it names --aux-layers as that run had them."""
    over = dict(prompts=str(convs_file(tmp_path / "c.jsonl")), target=str(tiny_llama_dir))
    said(lambda: train(small(tmp_path / "d", aux_layer_ids=[1, 3, 4], **over)))
    with pytest.raises(DraftsmithError) as e:
        said(lambda: train(small(tmp_path / "d", resume=True, **over)))
    msg = str(e.value)
    assert "\n" not in msg and "resume with the same options" in msg, msg
    assert "--aux-layers 1,3,4" in msg, msg


def test_an_offline_resume_on_data_captured_again_at_other_layers_names_the_dataset(
        train_root, tmp_path):
    """The dataset captured again at other aux layers (no option sets them offline) was told
    "resume with the same options"; now the line names the dataset and what it holds."""
    data = tmp_path / "data"
    shutil.copytree(train_root / "data", data)
    over = dict(data=str(data), target=str(train_root / "target"))
    said(lambda: train(small(tmp_path / "d", **over)))
    shutil.rmtree(data)
    write_dataset(data, load_target(str(train_root / "target")), n=24, aux=[0, 2, 3])
    with pytest.raises(DraftsmithError) as e:
        said(lambda: train(small(tmp_path / "d", resume=True, **over)))
    msg = str(e.value)
    assert "\n" not in msg and str(data) in msg and "[0, 2, 3]" in msg, msg
    assert "--aux-layers" not in msg, msg


def test_init_from_a_run_stopped_at_a_checkpoint_names_its_latest_checkpoint(train_root,
                                                                            tmp_path):
    """--init-from a training --out stopped at a checkpoint (no final drafter yet) said "no
    draftsmith.json (not a draftsmith drafter folder)" once the target had loaded; now one line
    before --out is made names its latest checkpoint and --resume."""
    over = dict(data=str(train_root / "data"), target=str(train_root / "target"))
    said(lambda: train(small(tmp_path / "a", **over)))
    step = tmp_path / "a" / "checkpoints" / "step-00000001"
    with pytest.raises(DraftsmithError) as e:
        said(lambda: train(small(tmp_path / "b", init_from=str(tmp_path / "a"),
                                 draft_vocab_size=None, time_limit=None, **over)))
    msg = str(e.value)
    assert "\n" not in msg and f"--init-from {step}" in msg and "--resume" in msg, msg
    assert not (tmp_path / "b").exists()


def test_online_init_from_a_drafter_of_other_aux_layers_names_the_flag(tiny_llama_dir, tmp_path):
    """Online --init-from a drafter trained on --aux-layers 1,3,4, without them: "aux layers
    [1, 3, 4] there, [0, 2, 4] here" and nothing to do; now it names --aux-layers."""
    over = dict(prompts=str(convs_file(tmp_path / "c.jsonl")), target=str(tiny_llama_dir))
    said(lambda: train(small(tmp_path / "a", aux_layer_ids=[1, 3, 4], time_limit=None, **over)))
    with pytest.raises(DraftsmithError) as e:
        said(lambda: train(small(tmp_path / "b", init_from=str(tmp_path / "a"),
                                 draft_vocab_size=None, **over)))
    msg = str(e.value)
    assert "\n" not in msg and "aux layers [1, 3, 4] there, [0, 2, 4] here" in msg, msg
    assert msg.endswith(": pass --aux-layers 1,3,4"), msg


def test_offline_init_from_a_drafter_of_other_aux_layers_names_the_capture(train_root, tmp_path):
    target = str(train_root / "target")
    other = write_dataset(tmp_path / "other", load_target(target), n=8, aux=[0, 2, 3])
    said(lambda: train(small(tmp_path / "a", data=str(other), target=target, time_limit=None)))
    with pytest.raises(DraftsmithError) as e:
        said(lambda: train(small(tmp_path / "b", data=str(train_root / "data"), target=target,
                                 init_from=str(tmp_path / "a"), draft_vocab_size=None)))
    msg = str(e.value)
    assert "\n" not in msg and "aux layers [0, 2, 3] there, [1, 2, 4] here" in msg, msg
    assert msg.endswith("(`draftsmith data capture --aux-layers 0,2,3`)"), msg


@pytest.mark.parametrize("online", [False, True])
def test_max_samples_past_the_data_says_it_trains_on_all(train_root, tmp_path, capsys, online):
    """--max-samples 1000 on 24 samples (or 6 conversations) trained on all of them without a
    word, as if the data held 1000. Now one line says what it holds and that all of it trains."""
    data = (dict(prompts=str(convs_file(tmp_path / "c.jsonl"))) if online else
            dict(data=str(train_root / "data")))
    said(lambda: train(small(tmp_path / "d", max_samples=1000, time_limit=None,
                             target=str(train_root / "target"), **data)))
    n = 6 if online else 24
    assert json.loads((tmp_path / "d" / "draftsmith.json").read_text())["data"]["samples"] == n
    err = capsys.readouterr().err
    hits = [x for x in err.splitlines() if "--max-samples 1000" in x]
    assert len(hits) == 1 and f"{n} sample(s)" in hits[0], err


def test_max_samples_counts_no_conversation_the_template_refused(monkeypatch):
    """Refused conversations (skipped, as capture skips them) give no sample either: the
    conversations taken reach past them to the n-th that trains, each encoded once."""
    from draftsmith.data.chat import AnswerTally
    from draftsmith.train import sources

    seen: list[int] = []

    def encode(tok, convs, prompts, tally):  # conversation c refused where c % 3 == 1
        seen.extend(convs)
        kept = [([0, 1, 2], [False, False, c % 3 != 2]) for c in convs if c % 3 != 1]
        return kept, [(i, f"conversation {c}") for i, c in enumerate(convs) if c % 3 == 1]

    monkeypatch.setattr(sources, "_encode", encode)
    convs = list(range(20))
    # trains: 0, 3, 6, 9 (2, 5, 8 unanswered; 1, 4, 7 refused)
    got, encoded, refused = sources._first_trained(None, convs, "p", 48, 4, AnswerTally())
    assert got == convs[:10] and len(encoded) == 7
    assert [i for i, _ in refused] == [1, 4, 7]
    assert sorted(seen) == sorted(set(seen))  # none encoded twice
    got, _, refused = sources._first_trained(None, convs, "p", 48, 100, AnswerTally())
    assert got == convs and [i for i, _ in refused] == [1, 4, 7, 10, 13, 16, 19]
