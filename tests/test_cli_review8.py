"""Command-line review, eighth pass: a command given a damaged or foreign --drafter folder
refuses it in one line naming its file before the target loads (minutes on a big model), not
after, and not as a KeyError traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_review import run_main
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE

LOADED = "the target was loaded"


@pytest.fixture(scope="module")
def good(target, tmp_path_factory) -> Path:
    return make(target, tmp_path_factory.mktemp("d8") / "good")


def _damaged(good: Path, tmp: Path, how: str) -> tuple[Path, str]:
    """A copy of `good` damaged `how`, and the start of the error that names it."""
    d = tmp / how
    d.mkdir()
    (d / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes())
    meta = json.loads((good / CONFIG_FILE).read_text())
    cfg = meta["config"]
    if how == "not_json":
        (d / CONFIG_FILE).write_text("{not json")
        return d, f"{d / CONFIG_FILE}"
    if how == "no_config":
        del meta["config"]
    elif how == "float_layers":
        cfg["num_layers"] = 2.0
    elif how == "unknown_key":
        cfg["bogus"] = 1
    elif how == "no_aux":
        del cfg["aux_layer_ids"]
    elif how == "no_weights":
        (d / WEIGHTS_FILE).unlink()
    elif how == "cut_weights":
        (d / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes()[:200])
    (d / CONFIG_FILE).write_text(json.dumps(meta))
    return d, f"{d}" if how.endswith("weights") else f"{d / CONFIG_FILE}: "


HOWS = ["not_json", "no_config", "float_layers", "unknown_key", "no_aux", "no_weights",
        "cut_weights"]


@pytest.fixture
def no_target(monkeypatch):
    """Loading the target is refused: a command reaching it checked its drafter too late."""
    def refuse(*a, **k):
        raise DraftsmithError(LOADED)

    monkeypatch.setattr("draftsmith.targets.load_target", refuse)


def _args(cmd: str, target, d: Path, out: Path) -> list[str]:
    t = str(target.folder)
    return {
        "generate": ["generate", "-p", "hi", "--target", t, "--drafter", str(d)],
        "bench": ["bench", "--target", t, "--drafter", str(d), "--out", str(out)],
        "serve": ["serve", "--target", t, "--drafter", str(d), "--port", "0"],
        "tune": ["tune", "--target", t, "--drafter", str(d), "--out", str(out)],
        "tune_tp": ["tune", "--target", t, "--drafter", str(d), "--out", str(out), "--tp",
                    "2"],
    }[cmd]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("cmd", ["generate", "bench", "serve", "tune", "tune_tp"])
def test_a_damaged_drafter_is_refused_before_the_target(monkeypatch, capsys, target, good,
                                                       tmp_path, no_target, cmd, how):
    d, named = _damaged(good, tmp_path, how)
    code, out, err = run_main(monkeypatch, capsys, *_args(cmd, target, d, tmp_path / "o"))
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"draftsmith: error: {named}"), err
    assert LOADED not in err and "Traceback" not in err


@pytest.mark.parametrize("cmd", ["generate", "bench", "serve", "tune"])
def test_a_sound_drafter_reaches_the_target(monkeypatch, capsys, target, good, tmp_path,
                                            no_target, cmd):
    """The checks refuse nothing sound: the command goes on to load the target."""
    code, _, err = run_main(monkeypatch, capsys, *_args(cmd, target, good, tmp_path / "o"))
    assert code == 2 and err.strip() == f"draftsmith: error: {LOADED}"


def test_nccl_sweep_names_a_config_without_aux_layers(good, tmp_path):
    """`_nccl_for` indexed ["config"]["aux_layer_ids"]: a KeyError traceback after the tune."""
    from draftsmith.tune.cli import _nccl_for

    d, named = _damaged(good, tmp_path, "no_aux")
    report = {"recommendations": [{"batch": 1, "verify_tokens": 4}]}
    with pytest.raises(DraftsmithError, match=rf"^{named}.*aux_layer_ids"):
        _nccl_for(report, 2, "tiny", "cpu", None, "quick", tmp_path / "nccl", d)


def test_serve_refuses_a_topk_past_the_draft_vocabulary_before_the_target(
        monkeypatch, capsys, target, good, no_target):
    """generate and bench refused it up front; serve only once the target had loaded."""
    code, _, err = run_main(monkeypatch, capsys, "serve", "--target", str(target.folder),
                            "--drafter", str(good), "--topk", "41", "--num-draft-tokens", "50",
                            "--port", "0")
    assert code == 2
    assert err.strip() == ("draftsmith: error: --topk 41 exceeds the drafter's draft "
                           "vocabulary of 40")
