"""Doctor review 7: slots holding a norm's output named as such (not blamed on the target), one
error for a drafter reading another count of states, and a speculative run that says what it
did not do (fewer prompts than asked, no training log to compare with)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_doctor as td
import torch
from test_doctor import TRUE, doctor, errors, make_drafter
from test_doctor_review2 import edit_shards

target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w).bfloat16()


def _normed(src: Path, dst: Path, target, norm: str) -> Path:
    """A copy of `src` whose aux[1] (layer 3's output) went through `norm`: layer 4's input norm
    (what its attention reads, a hook on the attention's input) or the final norm."""
    model = target.build()
    module = model.layers[TRUE[1] + 1].input_norm if norm == "input" else model.norm

    def edit(t: dict[str, torch.Tensor]) -> None:
        t["aux"][:, 1] = _rms(t["aux"][:, 1], module.weight.detach(), module.eps)

    return edit_shards(src, dst, edit)


def test_a_slot_of_a_layers_attention_input_is_named_not_blamed_on_the_target(
        data_dir, target, target_dir, tmp_path):
    """It 'matched no live layer clearly (nearest final norm)' and the fix said the data was
    not captured from this target: check --target."""
    rep = doctor(data=_normed(data_dir, tmp_path / "d", target, "input"), target=str(target_dir))
    slot = rep.wiring["slots"][1]
    assert (slot["status"], slot["best"], slot["normed"]) == (
        "normed", "layer 3", "layer 4 input norm output")
    assert rep.wiring["true_ids"] == [1, None, 5]
    (f,) = errors(rep)
    assert f.what.startswith("aux[1] holds layer 4's input norm output (what its attention "
                             "reads: layer 3's output, normed)")
    assert "--target" not in f.fix and "layer 3's output (canonical 3)" in f.fix
    json.dumps(rep.to_dict(), allow_nan=False)  # strict JSON still


def test_a_slot_normed_by_another_norm_is_named_by_its_direction(data_dir, target, target_dir,
                                                                 tmp_path):
    rep = doctor(data=_normed(data_dir, tmp_path / "d", target, "final"), target=str(target_dir))
    (f,) = errors(rep)
    assert "follows layer 3's output in direction" in f.what and "normed copy" in f.what
    assert "--target" not in f.fix and "canonical 3" in f.fix


def test_data_of_another_target_still_names_the_target(data_dir, tmp_path):
    from conftest import write_tiny_folder

    other = write_tiny_folder(tmp_path / "other", "llama", seed=5, num_hidden_layers=8)
    rep = doctor(data=data_dir, target=str(other))
    fixes = [f.fix for f in errors(rep, "wiring") if f.what.startswith("aux[")]
    assert fixes and all("check --target" in fx for fx in fixes)


def test_a_drafter_reading_another_count_of_states_is_one_error(work, target, target_dir):
    """Two errors, the second's fix (write three ids into a drafter whose fc reads two) one that
    fails to load."""
    two = make_drafter(work / "two", target, [1, 3])
    rep = doctor(data=work / "data", drafter=two, target=str(target_dir))
    (f,) = rep.errors()
    assert f.check == "sizes" and "reads 2 aux states, the data holds 3" in f.what


def test_more_prompts_than_the_run_has_are_said(work, target, target_dir):
    good = make_drafter(work / "good7", target, TRUE)
    rep = doctor(drafter=good, target=str(target_dir), run=True, prompts=6, max_new=4)
    assert rep.behaviour["runs"]["as configured"]["prompts"] == 4
    (f,) = [f for f in rep.findings if f.check == "behaviour" and f.severity == "info"]
    assert "took 4 prompts, not the 6 --prompts asks for: the built-in set holds 4" in f.what


@pytest.fixture(scope="module")
def logged(work, target) -> Path:
    """A drafter whose training log promises 90 % at position 0 (its random weights accept
    none of it)."""
    folder = make_drafter(work / "logged", target, TRUE)
    row = {"step": 10, "cond_acc": [0.9, 0.8, 0.7], "accept_length": 2.5}
    (folder / "train_log.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def test_an_exported_folder_says_its_run_is_not_compared_with_training(logged, data_dir,
                                                                        target_dir, tmp_path):
    """The same drafter: its own folder's run is held against the log; exported, the run passed
    'behaviour' silently, with no log to hold it against."""
    from draftsmith.export import export_drafter

    rep = doctor(data=data_dir, drafter=logged, run=True, prompts=2, max_new=8)
    assert rep.behaviour["promised"] is not None
    assert not any("holds no train_log.jsonl" in s for s in rep.skipped)
    sg = export_drafter(logged, "sglang", tmp_path / "sg", target=str(target_dir))
    rep = doctor(data=data_dir, drafter=sg, run=True, prompts=2, max_new=8)
    assert rep.behaviour["runs"] and rep.behaviour["promised"] is None
    assert "behaviour" not in rep.passed
    (note,) = [s for s in rep.skipped if s.startswith("behaviour: the run against training")]
    assert "holds no train_log.jsonl" in note and "exported folder" in note


def test_a_config_check_builds_no_model(work, target, target_dir, monkeypatch):
    """--no-run without --data reads configs only: it built the target (an fp32 copy of its
    weights) all the same."""
    from draftsmith.targets import Target

    def refuse(*a, **k):
        raise AssertionError("built the target")

    folder = make_drafter(work / "cfgonly", target, [0, 2, 4], trained_on=TRUE)
    monkeypatch.setattr(Target, "build", refuse)
    rep = doctor(drafter=folder, target=str(target_dir))
    assert "trained on data recorded as [1, 3, 5]" in errors(rep, "wiring")[0].what
