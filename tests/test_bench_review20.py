"""Review of bench's suites and machine-load check: HumanEval named in any case is one suite,
openings that differ only in surrounding whitespace are one prompt, and a platform without
/proc/stat or a load average still gets a report."""

from __future__ import annotations

import json

from draftsmith.bench import load
from draftsmith.bench.suites import repeated_suites, suite_labels, suite_messages


def test_humaneval_named_in_another_case_is_the_same_suite_run_once():
    """The reader takes `HumanEval` for the bundled set (its check is case-blind), but the
    suites' key was not: `--suite humaneval --suite HumanEval` timed its 164 prompts twice,
    as two suites, without the note a repeated suite gets."""
    names = ["humaneval", "HumanEval"]
    assert suite_labels(names) == {"humaneval": "humaneval"}
    assert repeated_suites(names) == [
        "--suite humaneval named 2 times (also as HumanEval): run once"]
    assert suite_labels(["HumanEval"]) == {"HumanEval": "humaneval"}


def test_openings_differing_only_in_surrounding_whitespace_are_one_prompt(tmp_path):
    """The reader takes "hi" and "hi\\n" for one question (`repeat_key`), yet two
    conversations opening so, one with an answer after it, were both timed: the same
    question twice and another prompt left out by --num-prompts."""
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in (
        {"prompt": "hi"},
        {"messages": [{"role": "user", "content": "hi\n"},
                      {"role": "assistant", "content": "hello"}]},
        {"prompt": "yo"})) + "\n")
    assert suite_messages(str(p), 2) == [[{"role": "user", "content": "hi"}],
                                         [{"role": "user", "content": "yo"}]]


def test_no_proc_stat_and_no_load_average_is_a_report_not_a_crash(monkeypatch, tmp_path):
    """A platform lacking /proc/stat, the load average and CPU affinity: the load is None
    where unknown, never busy, and no note."""
    monkeypatch.setattr(load, "STAT", str(tmp_path / "no" / "stat"))
    monkeypatch.delattr(load.os, "getloadavg")
    monkeypatch.delattr(load.os, "sched_getaffinity")
    with load.watching() as tally, load.timed():
        pass
    got = tally.result()
    assert got is not None and got["other_cores"] is None and got["busy"] is False
    assert got["load_before"] is None and got["cores"] >= 1 and load.busy_note(got) is None
