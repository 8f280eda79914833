"""Training review 11: --no-progress keeps the logged steps' lines (no bar); --prompts and
--aux-layers clashes refused before the target loads; the dataset manifest read once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from test_train_helpers import AUX

from draftsmith.errors import DraftsmithError
from draftsmith.train import loop
from draftsmith.train.dist import setup as setup_ctx
from draftsmith.train.loop import TrainConfig, Trainer, train


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def config(root: Path, out: str, **over) -> TrainConfig:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                max_steps=4, batch_size=2, max_len=48, ttt_steps=2, lr=3e-3, log_every=2,
                save_every=100, draft_vocab_size=64, progress=False, loader_workers=0,
                device="cpu")
    base.update(over)
    return TrainConfig(**base)


def quiet_train(cfg: TrainConfig) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(cfg)


@pytest.fixture
def no_target(monkeypatch):
    """Loading the target fails the test: the refusal had to come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(loop, "resolve_target", refuse)


def prompts(root: Path, name: str, n: int = 8) -> str:
    path = root / name
    if not path.exists():
        lines = [[{"role": "user", "content": f"count {i} {name}"},
                  {"role": "assistant", "content": "abcabc abcabc " * (1 + i % 3)}]
                 for i in range(n)]
        path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    return str(path)


def online(root: Path, out: str, **over) -> TrainConfig:
    return config(root, out, **{"data": None, "prompts": prompts(root, "convs.jsonl"),
                                "aux_layer_ids": AUX, **over})


def step_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("draftsmith train: step ")]


@pytest.mark.parametrize("terminal", [False, True])
def test_no_progress_keeps_a_line_a_logged_step(root, capfd, monkeypatch, terminal):
    """--no-progress dropped the logged steps' lines too (loss, acc, accept): CI and a
    `2> log` lost them. Now only the bar goes, on a terminal as off it."""
    monkeypatch.setattr(loop, "on_terminal", lambda: terminal)
    quiet_train(config(root, f"quiet-{terminal}"))
    steps = step_lines(capfd.readouterr().err)
    assert [x.split(":")[1] for x in steps] == [" step 2/4", " step 4/4"], steps
    assert all(" loss " in x and " accept " in x and " eta " in x for x in steps), steps
    # the draft vocab's share of the target's next tokens: data vocab's figure counts the data's
    assert all(" cover(target) " in x for x in steps), steps


def test_progress_on_a_terminal_is_the_bar_alone(root, capfd, monkeypatch):
    monkeypatch.setattr(loop, "on_terminal", lambda: True)
    quiet_train(config(root, "bar", progress=True))
    err = capfd.readouterr().err
    assert not step_lines(err) and "train: 100%" in err, err


@pytest.fixture(scope="module")
def stopped_online(root) -> str:
    """An online run stopped at its first logged step with a checkpoint."""
    quiet_train(online(root, "online-stopped", time_limit=0.0))
    return "online-stopped"


def test_resume_with_other_prompts_is_refused_before_the_target_loads(root, stopped_online,
                                                                     no_target):
    other = prompts(root, "other.jsonl")
    with pytest.raises(DraftsmithError, match=r"--resume from .*step-00000002: prompts was "
                       r".*convs.jsonl' in that run, now .*other.jsonl'; resume with the same"):
        train(online(root, stopped_online, resume=True, prompts=other))


def test_resume_with_other_aux_layers_is_refused_before_the_target_loads(root, stopped_online,
                                                                        no_target):
    with pytest.raises(DraftsmithError, match=r"--resume from .*step-00000002: aux layers "
                       r"\[1, 2, 4\] in that run, \[0, 2\] now; resume with the same options"):
        train(online(root, stopped_online, resume=True, aux_layer_ids=[0, 2]))


def test_the_same_resume_passes_the_early_checks(root, stopped_online, no_target):
    with pytest.raises(AssertionError, match="target was loaded"):
        train(online(root, stopped_online, resume=True))


def test_aux_layers_other_than_the_datasets_are_refused_before_the_target_loads(root,
                                                                               no_target):
    with pytest.raises(DraftsmithError, match=r"^--aux-layers \[0, 1\]: the dataset .*data "
                       r"holds aux layers \[1, 2, 4\] \(canonical\), which offline training"):
        train(config(root, "aux-clash", aux_layer_ids=[0, 1]))


def test_init_from_with_other_aux_layers_is_refused_before_the_target_loads(root,
                                                                           monkeypatch):
    first = quiet_train(config(root, "first", max_steps=2))
    monkeypatch.setattr(loop, "resolve_target", lambda *a: pytest.fail("target loaded"))
    with pytest.raises(DraftsmithError, match=r"^--init-from .*first: aux layers \[1, 2, 4\] "
                       r"there, \[0, 2\] here$"):
        train(online(root, "warm", init_from=str(first), aux_layer_ids=[0, 2],
                     draft_vocab_size=None))


class Opened(Exception):
    """The data is open: the count of manifest reads is complete."""


def test_the_dataset_manifest_is_read_once_at_start(root, monkeypatch):
    """The early check, the recorded target and open_offline each read manifest.json."""
    from draftsmith.data import shards
    from draftsmith.train import sources

    real, reads = shards.read_manifest, []

    def counted(folder):
        reads.append(folder)
        return real(folder)

    monkeypatch.setattr(shards, "read_manifest", counted)
    monkeypatch.setattr(sources, "read_manifest", counted)
    monkeypatch.setattr(loop, "Plan", lambda *a: (_ for _ in ()).throw(Opened()))
    with pytest.raises(Opened):
        Trainer(config(root, "once", target=None), setup_ctx("cpu"))
    assert len(reads) == 1, reads


def test_a_profile_window_past_the_runs_end_is_warned_before_training(root):
    """--profile-steps 5 on a 4-step run trained and wrote no profile.json, saying nothing.
    Now the Trainer warns before the first step (the run still trains, as before)."""
    with pytest.warns(UserWarning, match=r"^--profile-steps 5: the profile starts after 3 "
                      r"warm-up steps, but this run has 4 step\(s\) to train, so no profile.json "
                      r"will be written; pass --profile-steps 1 or fewer$"):
        Trainer(config(root, "shortprof", profile_steps=5), setup_ctx("cpu"))


def test_a_profile_window_within_the_run_is_not_warned(root):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="--profile-steps")
        warnings.filterwarnings("ignore", message="(?!--profile-steps)")
        train(config(root, "fitprof", profile_steps=1))
    assert (root / "fitprof" / "profile.json").exists()
