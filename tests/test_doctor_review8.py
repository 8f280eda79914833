"""Doctor review 8: a behaviour gap where the live wiring match passed is the drafter's (a
warning naming its likely causes), not an error blamed on wiring; the promised figure says which
log rows it averages; the run says why it drafted that many steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_doctor as td
from test_doctor import TRUE, doctor, errors, make_drafter

target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work

LOG = [{"step": s, "cond_acc": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], "accept_length": 3.0}
       for s in (10, 20, 30, 40, 50, 60)]


def _logged(folder: Path) -> Path:
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    return folder


@pytest.fixture(scope="module")
def runs(work, target, data_dir):
    """The same random-weight drafter (which accepts almost nothing) wired right and wrong,
    both with a log promising 90 % at position 0."""
    good = _logged(make_drafter(work / "good8", target, TRUE))
    bad = _logged(make_drafter(work / "bad8", target, [0, 2, 4], trained_on=None))
    return (doctor(data=data_dir, drafter=good, run=True, prompts=2, max_new=6),
            doctor(data=data_dir, drafter=bad, run=True, prompts=2, max_new=6))


def test_a_gap_where_the_live_wiring_passed_is_not_blamed_on_wiring(runs):
    """A tiny overfit drafter whose layers 1/14/26 matched the live target at cosine 1.000 got
    'a gap this large is usually wiring' as an error (exit 1) next to its passed wiring checks;
    where the wiring is wrong the gap stays an error."""
    good, bad = runs
    assert not errors(good), [f.what for f in errors(good)]
    (f,) = [f for f in good.findings if f.check == "behaviour"]
    assert f.severity == "warning" and "the live match passed" in f.what
    assert "not wiring" in f.what and "usually wiring" not in f.what
    for cause in ("overfit on little data", "greedy", "sampled at a temperature"):
        assert cause in f.what
    assert "nothing to rewire" in f.fix
    (g,) = errors(bad, "behaviour")
    assert "usually wiring" in g.what and errors(bad, "wiring")


def test_a_gap_unproven_by_a_live_match_stays_an_error():
    from draftsmith.doctor.behaviour import gap_findings

    run = {"as configured": {"position_rates": [0.0], "reached": [400], "accepted": [0],
                             "mean_accept_length": 1.0, "aux_layer_ids": TRUE}}
    promise = {"cond_acc": [0.5], "accept_length": 1.5}
    (f,) = gap_findings(run, promise, "d")
    assert f.severity == "error" and "usually wiring" in f.what
    (f,) = gap_findings(run, promise, "d", wired=True)
    assert f.severity == "warning" and "not wiring" in f.what


def test_the_promise_says_which_log_rows_it_averages(runs, work):
    """'promised 50.1%' matched no figure of the log (its last row said 66.6%): it is the mean
    of the last 5 rows' cond_acc, which the finding and the table now say."""
    from draftsmith.doctor.render import behaviour_table

    good, _ = runs
    (f,) = [f for f in good.findings if f.check == "behaviour"]
    log = work / "good8" / "train_log.jsonl"
    words = f"the mean of cond_acc per position over the last 5 rows of {log} (steps 20..60)"
    assert words in f.what
    assert "not the log's accept_length (all 7 positions)" in f.what
    assert words in behaviour_table(good.behaviour).caption


def test_the_run_says_why_it_drafts_that_many_steps(runs):
    """A drafter trained with 7 positions ran 5 draft steps without a word on why."""
    from draftsmith.doctor.render import behaviour_table
    from draftsmith.doctor.run import draft_steps

    good, _ = runs
    assert good.behaviour["draft_steps"] == 5
    why = "the log records 7 positions, a run drafts at most 5 unless --steps (--steps 7"
    assert why in good.behaviour["draft_steps_why"]
    (f,) = [f for f in good.findings if f.check == "behaviour"]
    assert f"5 draft steps: {why}" in f.what
    assert f"5 draft steps: {why}" in behaviour_table(good.behaviour).caption
    assert draft_steps(None, {"cond_acc": [0.5] * 3}) == (3, "the 3 positions the log records")
    assert draft_steps(None, None)[0] == 3 and "no training log" in draft_steps(None, None)[1]
    assert draft_steps(9, {"cond_acc": [0.5] * 7}) == (
        9, "--steps 9 (the log records 7 positions: the promise covers those)")
