"""Doctor review 5: the capturable fix on short targets, the promised accept length at the run's
own number of draft steps, and a run that drafted nothing shown as unmeasured."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import test_doctor as td
import torch
from conftest import write_tiny_folder
from test_doctor import TRUE, convs, doctor, errors

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.targets import load_target

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5, a drafter
target_dir, target, data_dir, work, good = td.target_dir, td.target, td.data_dir, td.work, td.good


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> tuple[Path, Path]:
    """A 3-layer target and data at its default aux layers, [-1, 0, 1]."""
    root = tmp_path_factory.mktemp("short")
    folder = write_tiny_folder(root / "t", "llama", num_hidden_layers=3)
    capture(load_target(folder), convs(2), root / "d", CaptureConfig(max_len=48),
            progress=False, log=lambda s: None)
    return folder, root / "d"


def test_a_short_targets_capturable_fix_is_not_the_default_it_flags(short):
    """On 2-3 layers the default ids are [-1, 0, 1]: the fix for "SGLang cannot capture the
    embedding" was to recapture with the defaults, the same data again."""
    folder, data = short
    rep = doctor(data=data, target=str(folder), engine="sglang")
    assert rep.wiring["true_ids"] == [-1, 0, 1]
    (f,) = errors(rep, "capturable")
    assert "without --aux-layers" not in f.fix
    assert f.fix.startswith("SGLang cannot be given 3 distinct layers of this 3-layer target")
    (f,) = [f for f in doctor(data=data, target=str(folder), engine="vllm").findings
            if f.check == "capturable"]
    assert f.severity == "warning" and "needs vLLM id 0" in f.what
    assert "without --aux-layers" not in f.fix and "newer vLLM model files" in f.fix


def test_the_capturable_fix_names_layers_the_engine_captures(target, tmp_path):
    out = tmp_path / "last"
    capture(target, convs(1), out, CaptureConfig(aux_layer_ids=[1, 3, 7], max_len=48),
            progress=False, log=lambda s: None)
    rep = doctor(data=out, target=str(target.folder), engine="sglang")
    (f,) = errors(rep, "capturable")
    assert "last layer output" in f.what
    assert f.fix == ("retrain on layers every engine can capture, e.g. `draftsmith data capture "
                     "--aux-layers 1,3,4`")
    (f,) = [f for f in doctor(data=out, target=str(target.folder), engine="vllm").findings
            if f.check == "capturable"]
    assert f.fix.endswith("`draftsmith data capture --aux-layers 1,3,4`")


def test_the_promised_accept_length_is_the_runs_own_number_of_steps():
    """The log's accept length counts all 7 training-time-test steps: a 3-step run was set
    against 5.22 where 90 % at each position promises 3 steps 3.44, in the finding and in the
    table beside the run's own figure."""
    from draftsmith.doctor.behaviour import gap_findings
    from draftsmith.doctor.render import behaviour_table

    promise = {"cond_acc": [0.9] * 7, "accept_length": 5.22}
    run = {"position_rates": [0.2, 0.5, 0.5], "reached": [400, 80, 40],
           "accepted": [80, 40, 20], "mean_accept_length": 1.35, "tokens_per_s": 9.0,
           "aux_layer_ids": [0, 2, 4]}
    (f,) = gap_findings({"as configured": run}, promise, "d")
    assert f.severity == "error" and "(accept length 1.35 vs 3.44 at 3 draft steps)" in f.what
    tab = behaviour_table({"runs": {"as configured": run}, "prompts": "data",
                           "promised": promise})
    row = [list(c.cells)[3] for c in tab.columns]
    assert row[:3] == ["accept length (3 draft steps)", "3.44", "1.35"]


def test_a_run_that_drafted_nothing_has_no_accept_length(work, good, target_dir):
    """One new token a prompt (the prefill's): no cycle ran, yet the run's accept length read
    0.00, a measured-looking figure, in the table and the JSON."""
    from rich.console import Console

    from draftsmith.doctor.behaviour import spec_run
    from draftsmith.doctor.render import show
    from draftsmith.models.eagle3 import load_drafter

    t = load_target(target_dir)
    prompt = t.chat_ids([{"role": "user", "content": "hi"}])
    run = spec_run(t.build(torch.float32), load_drafter(good), [prompt], 3, 1, t.eos_ids)
    assert run["reached"] == [0, 0, 0] and run["mean_accept_length"] is None
    rep = doctor(data=work / "data", drafter=good, target=str(target_dir), run=True, prompts=1,
                 max_new=1)
    assert rep.behaviour["runs"]["as configured"]["mean_accept_length"] is None
    buf = io.StringIO()
    show(rep, Console(file=buf, width=220))
    line = next(x for x in buf.getvalue().splitlines() if "accept length" in x)
    assert "0.00" not in line and "-" in line
    assert rep.behaviour["runs"]["as configured"]["aux_layer_ids"] == TRUE
