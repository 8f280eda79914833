"""Doctor review 24: a training log whose rows hold values no training writes (a hand edit) is
the warning a damaged log gets, the run kept, not a traceback; a --drafter that is a dataset
folder or a training run stopped at a checkpoint is named as what it is, with the way on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_doctor as td

from draftsmith.doctor.artifacts import read_checked
from draftsmith.doctor.behaviour import promised
from draftsmith.errors import DraftsmithError

target_dir, target, data_dir = td.target_dir, td.target, td.data_dir
GOOD = {"step": 1, "cond_acc": [0.6, 0.4, None], "accept_length": 1.8}
BAD = [
    ("cond_acc", 0.5),  # a number, not a list: `len()` of a float
    ("cond_acc", [0.6, "x"]),  # a rate that is text: `sum()` of a str
    ("cond_acc", [60.0, 40.0]),  # percents: a promise of 6000%
    ("cond_acc", [0.6, float("nan")]),
    ("accept_length", "1.8"),
    ("accept_length", float("inf")),
]


def _log(folder: Path, *rows: dict) -> None:
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(("key", "value"), BAD)
def test_a_log_row_of_values_no_training_writes_is_one_line(tmp_path, key, value):
    _log(tmp_path, GOOD, GOOD | {"step": 2, key: value})
    with pytest.raises(DraftsmithError) as e:
        promised(tmp_path)
    said = str(e.value)
    assert "\n" not in said and "train_log.jsonl" in said and "step 2" in said and key in said


def test_a_good_log_still_promises(tmp_path):
    _log(tmp_path, GOOD, GOOD | {"step": 2, "cond_acc": [0.8, 0.6, 0.2]})
    p = promised(tmp_path)
    assert p is not None and p["cond_acc"] == pytest.approx([0.7, 0.5, 0.2])
    assert p["accept_length"] == pytest.approx(1.8)


def test_the_doctor_warns_of_such_a_log_and_keeps_the_run(target, data_dir, tmp_path):
    """It was a TypeError traceback out of `draftsmith doctor`, the whole report lost."""
    folder = td.make_drafter(tmp_path / "d", target, td.TRUE)
    _log(folder, GOOD, GOOD | {"step": 2, "cond_acc": 0.5})
    rep = td.doctor(drafter=folder, data=data_dir, run=True, prompts=1, max_new=4)
    (f,) = [f for f in rep.findings if f.check == "behaviour"]
    assert f.severity == "warning" and "the run is not compared with training" in f.what
    assert "step 2" in f.what and f.fix == "repair or remove that line of the training log"
    assert rep.behaviour["runs"] and rep.exit_code() == 0


def test_a_dataset_folder_given_as_the_drafter_is_named_as_one(data_dir):
    with pytest.raises(DraftsmithError) as e:
        read_checked(data_dir)
    assert str(e.value) == (f"{data_dir}: a dataset folder (manifest.json), not a drafter; "
                            "pass the drafter trained on it (`draftsmith doctor` takes a "
                            "dataset as --data)")


def test_a_training_run_stopped_at_a_checkpoint_names_the_checkpoint(target, tmp_path):
    """It said "no config.json (not a Hugging Face checkpoint folder)" of a draftsmith run."""
    run = tmp_path / "run"
    for step in (10, 20):
        ck = run / "checkpoints" / f"step-{step:08d}"
        td.make_drafter(ck, target, td.TRUE)
        (ck / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(DraftsmithError) as e:
        read_checked(run)
    latest = run / "checkpoints" / "step-00000020"
    assert str(e.value) == (
        f"{run}: a training run stopped at step-00000020, with no final drafter yet; pass its "
        f"checkpoint {latest} as the drafter, or finish that run first (its train command "
        "with --resume)")
    assert read_checked(latest).layout == "draftsmith"


def test_a_finished_run_keeps_reading_as_its_drafter(target, tmp_path):
    run = td.make_drafter(tmp_path / "run", target, td.TRUE)
    shutil.copytree(run, run / "checkpoints" / "step-00000010")
    (run / "checkpoints" / "step-00000010" / "trainer_state.pt").write_bytes(b"")
    assert read_checked(run).folder == run


def test_a_checkpoint_is_held_against_its_runs_log_up_to_its_step(tmp_path):
    """The way on above: the checkpoint's folder holds no log (the run's does, beside
    checkpoints/), so the doctor said it was an exported folder and compared nothing."""
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step-00000020"
    ck.mkdir(parents=True)
    _log(run, GOOD | {"step": 10, "cond_acc": [0.2]}, GOOD | {"step": 20, "cond_acc": [0.4]},
         GOOD | {"step": 30, "cond_acc": [0.9]})  # step 30: trained after the checkpoint
    p = promised(ck)
    assert p is not None and p["steps"] == [10, 20] and p["cond_acc"] == pytest.approx([0.3])
    assert p["source"] == str(run / "train_log.jsonl")
    assert promised(run)["steps"] == [10, 20, 30]
    assert promised(tmp_path) is None


@pytest.mark.parametrize(("kind", "said"), [
    ("drafter", "a drafter folder (draftsmith.json), not a dataset; pass it as --drafter, and "
                "the data it was trained on as --data"),
    ("target", "a model folder (config.json), not a dataset; pass a target as --target, an "
               "exported drafter as --drafter, and a dataset (manifest.json) as --data"),
])
def test_a_model_folder_given_as_the_data_is_named_as_one(target, target_dir, tmp_path, kind,
                                                          said):
    """It said "no manifest.json (not a draftsmith dataset folder)", the way on unnamed."""
    folder = td.make_drafter(tmp_path / "d", target, td.TRUE) if kind == "drafter" \
        else target_dir
    with pytest.raises(DraftsmithError) as e:
        td.doctor(data=folder, target=str(target_dir))
    assert str(e.value) == f"{folder}: {said}"
