"""Doctor review 9: the run's draft steps stop at the log's measured positions; --json is strict
JSON (null, never NaN); flags that would do nothing are refused by name; a drafter whose ids
do not load is told to fix its ids, not its weights; --steps past the deepest draft refused."""

from __future__ import annotations

import json
import math

import pytest
import test_doctor as td
import typer
from test_doctor import TRUE, doctor, errors, make_drafter
from typer.testing import CliRunner

from draftsmith.doctor import Finding, Report
from draftsmith.doctor import doctor as command
from draftsmith.doctor.run import DoctorOptions, draft_steps
from draftsmith.errors import DraftsmithError

target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work

IDS = "eagle_aux_hidden_state_layer_ids"


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    return app


def _strict(text: str) -> object:
    def refuse(word: str) -> None:
        raise ValueError(f"non-standard JSON literal {word}")

    return json.loads(text, parse_constant=refuse)


def test_draft_steps_stop_at_the_measured_positions():
    """The log's cond_acc holds None where no chain reached a position: those were counted as
    positions to draft (4 steps of a log that measured 2), with a promise that covered none."""
    steps, why = draft_steps(None, {"cond_acc": [0.6, 0.3, None, None]})
    assert steps == 2
    assert why == "the log measured positions 0..1 of 4, no chain reached position 2"
    steps, why = draft_steps(None, {"cond_acc": [None, None, None]})
    assert steps == 3 and "the log measured none of its 3 positions" in why
    steps, why = draft_steps(None, {"cond_acc": [0.5] * 7 + [None]})
    assert steps == 5 and "--steps 7 drafts them all" in why and "0..6 of 8" in why
    assert draft_steps(3, {"cond_acc": [0.5, None]}) == (
        3, "--steps 3 (the log measured position 0 of 2, no chain reached position 1: the "
           "promise covers those)")


def test_the_run_drafts_only_the_logged_positions(work, target, data_dir):
    folder = make_drafter(work / "short9", target, TRUE)
    rows = [{"step": s, "cond_acc": [0.9, 0.5, None, None, None], "accept_length": 2.35}
            for s in (10, 20)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = doctor(drafter=folder, run=True, prompts=1, max_new=4)
    assert rep.behaviour["draft_steps"] == 2
    assert "no chain reached position 2" in rep.behaviour["draft_steps_why"]
    assert all(r["steps"] == 2 for r in rep.behaviour["runs"].values())


def test_json_output_writes_null_for_nan(monkeypatch):
    """A NaN anywhere in the report was printed as the NaN literal jq and JavaScript refuse."""
    rep = Report()
    rep.behaviour = {"promised": {"cond_acc": [math.nan, 0.5], "accept_length": math.inf}}
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: rep)
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--json", "--no-run"])
    assert res.exit_code == 0, res.output
    out = _strict(res.output)
    assert out["behaviour"]["promised"] == {"cond_acc": [None, 0.5], "accept_length": None}


@pytest.mark.parametrize("args, message", [
    (["--drafter", "d", "--no-run", "--steps", "2"],
     "--steps applies only to the speculative run, which --no-run skips: drop --no-run, or "
     "leave it out"),
    (["--data", "x", "--prompts", "8", "-n", "9"],
     "--prompts, --max-new-tokens apply only with --drafter (the speculative run): give "
     "--drafter DIR with them, or leave them out"),
    (["--data", "x", "--no-run", "--steps", "2"],
     "--steps applies only with --drafter (the speculative run): give --drafter DIR with it, "
     "or leave it out"),
    (["--drafter", "d", "--samples", "8", "--full-verify"],
     "--samples, --full-verify apply only with --data (the live match of its stored states): "
     "give --data DIR with them, or leave them out"),
])
def test_flags_that_do_nothing_are_refused(monkeypatch, args, message):
    """`--no-run --steps 2` or `--drafter D --samples 8` ran, silently ignoring the flag."""
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: pytest.fail("ran"))
    res = CliRunner().invoke(_app(), ["doctor", *args])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == message


def test_steps_past_the_deepest_draft_refused():
    with pytest.raises(DraftsmithError, match="--steps must be at most 64, got 65"):
        DoctorOptions(drafter="d", steps=65)


def test_ids_that_do_not_load_are_fixed_as_ids(work, target, target_dir):
    """An edit on an export naming a layer past the target ([1, 3, 5] to [1, 3, 8]): its load
    failure said 'its weights and config.json must agree: re-export or retrain it'."""
    from draftsmith.export import export_drafter

    good = make_drafter(work / "good9", target, TRUE)
    sg = export_drafter(good, "sglang", work / "sg9", target=str(target_dir))
    cfg = json.loads((sg / "config.json").read_text())
    cfg["eagle_config"][IDS] = [1, 3, 8]
    (sg / "config.json").write_text(json.dumps(cfg))
    rep = doctor(drafter=sg, run=True, prompts=1, max_new=2)
    (f,) = errors(rep, "loads")
    assert "does not load" in f.what and "re-export or retrain" not in f.fix
    assert "aux layer ids" in f.fix
    (w,) = errors(rep, "wiring")
    assert w.fix.endswith(f"{IDS} in config.json: [1, 3, 5]")


def test_a_recorded_target_since_moved_says_pass_target(work, target):
    """The drafter's recorded target folder, moved since, failed as '/x/t8: no such file or
    folder', without saying where that path came from or what to pass."""
    folder = make_drafter(work / "moved9", target, TRUE, target_source=str(work / "gone"))
    with pytest.raises(DraftsmithError, match=r"the drafter config names the target .*gone, "
                       r"not a file or folder here \(moved, deleted, or a hub id\): "
                       r"pass --target PATH"):
        doctor(drafter=folder)


def test_sglang_limits_do_not_fail_strict_for_engine_draftsmith(work, target, target_dir):
    """--engine draftsmith on embedding-fed ids: SGLang's capture limit was a warning, so
    --strict exited 1 for an engine the user does not serve with."""
    folder = make_drafter(work / "emb9", target, [-1, 1, 3])
    rep = doctor(drafter=folder, target=str(target_dir), engine="draftsmith")
    (f,) = [f for f in rep.findings if f.check == "capturable"]
    assert f.severity == "info" and "SGLang" in f.what
    assert rep.exit_code(strict=True) == 0, rep.findings
    (f,) = [f for f in doctor(drafter=folder, target=str(target_dir)).findings
            if f.check == "capturable"]
    assert f.severity == "warning"


def test_a_damaged_training_log_costs_the_comparison_not_the_report(work, target, target_dir):
    """A log line that does not parse (not the last, which a killed run may cut) ended the
    doctor with that one error after its live match: the whole report was lost."""
    folder = make_drafter(work / "badlog9", target, TRUE)
    row = json.dumps({"step": 10, "cond_acc": [0.5], "accept_length": 1.5})
    (folder / "train_log.jsonl").write_text("{not json\n" + row + "\n")
    rep = doctor(drafter=folder, target=str(target_dir), run=True, prompts=1, max_new=2)
    (f,) = [f for f in rep.findings if f.check == "behaviour"]
    assert f.severity == "warning" and "line 1 is not a JSON row" in f.what
    assert rep.behaviour["runs"] and rep.passed


def test_json_says_the_exit_code_strict_gives(monkeypatch):
    """Under --strict a warning exits 1 while the JSON said only "ok": true."""
    rep = Report([Finding("warning", "vocab", "w", "d")])
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: rep)
    for args, code in (([], 0), (["--strict"], 1)):
        res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--json", "--no-run",
                                          *args])
        out = _strict(res.output)
        assert res.exit_code == code and out["exit_code"] == code and out["ok"] is True
