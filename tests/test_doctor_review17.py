"""Doctor review 17: the long phases said on stderr (the short run per prompt, the live match),
never on stdout; --num-prompts the count's name (--prompts kept, hidden); --dtype's help names
float16, which it takes; --engine's help says what happens without it."""

from __future__ import annotations

import json
import threading
import time

import pytest
import test_doctor as td
import torch
import typer
from test_doctor import TRUE, make_drafter
from typer.testing import CliRunner

from draftsmith.doctor import DoctorOptions, Report, run_doctor
from draftsmith.doctor import doctor as command
from draftsmith.errors import DraftsmithError

target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    return app


def _help() -> list[str]:
    res = CliRunner().invoke(_app(), ["doctor", "--help"], env={"COLUMNS": "250"})
    return res.output.splitlines()


def test_the_short_run_is_announced_and_shown_per_prompt_on_stderr(work, target, target_dir,
                                                                   capsys, monkeypatch):
    """A 2-core CPU ran the README's command for minutes printing nothing."""
    monkeypatch.setattr("draftsmith.doctor.run.LATER_S", 0.0)  # the match said at once
    good = make_drafter(work / "good17", target, TRUE)
    rep = run_doctor(DoctorOptions(data=work / "data", drafter=good, target=str(target_dir),
                                   samples=1, run=True, prompts=2, max_new=3, progress=True))
    out, err = capsys.readouterr()
    assert out == "" and rep.behaviour["runs"]
    lines = err.splitlines()
    assert lines[0] == ("doctor: comparing the stored states of 1 sample with a live forward "
                        "of the target (--data)")
    runs = len(rep.behaviour["runs"])
    start = lines.index(f"doctor: short speculative run: 2 prompts x 3 new tokens, {runs} "
                        f"layer set{'s' if runs > 1 else ''} (--no-run skips it)")
    assert [x.split(",")[0] for x in lines[start + 1:]] == [
        f"doctor: {k}/{2 * runs} prompts" for k in range(1, 2 * runs + 1)]


def test_nothing_is_said_without_progress_or_without_a_run(work, target, target_dir, capsys):
    good = make_drafter(work / "quiet17", target, TRUE)
    run_doctor(DoctorOptions(drafter=good, target=str(target_dir), run=True, prompts=1,
                             max_new=2))
    run_doctor(DoctorOptions(drafter=good, target=str(target_dir), run=False, progress=True))
    assert capsys.readouterr() == ("", "")


def test_a_short_match_says_nothing_a_long_one_says_once(work, target_dir, capsys,
                                                         monkeypatch):
    """The live match of a tiny target is over at once: its line is for a long one."""
    run_doctor(DoctorOptions(data=work / "data", target=str(target_dir), samples=1,
                             progress=True))
    assert capsys.readouterr() == ("", "")
    from draftsmith.doctor import run as module

    monkeypatch.setattr(module, "LATER_S", 0.05)
    said, real = threading.Event(), module.say
    monkeypatch.setattr(module, "say", lambda line: (real(line), said.set()))
    with module.said_after("x", True):
        said.wait(10)  # a fixed 0.5 s raced the timer's thread on a loaded machine
    with module.said_after("y", False):
        time.sleep(0.2)
    assert capsys.readouterr() == ("", "doctor: x\n")


def test_json_stdout_stays_the_report_alone(work, target, target_dir):
    good = make_drafter(work / "json17", target, TRUE)
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", str(good), "--target",
                                      str(target_dir), "--json", "--num-prompts", "1", "-n", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["behaviour"]["runs"]
    assert "doctor: short speculative run: 1 prompt x 2 new tokens" in res.stderr


def test_help_names_num_prompts_float16_and_the_engine_default():
    lines = _help()
    count = next(x for x in lines if "--num-prompts" in x)
    assert "a count" in count and not any("--prompts " in x and "--num-prompts" not in x
                                          for x in lines)
    assert count.strip("│ ").startswith("--num-prompts")
    dtype = next(x for x in lines if "--dtype" in x)
    assert all(d in dtype for d in ("float32", "bfloat16", "float16", "auto"))
    at = next(i for i, x in enumerate(lines) if "--engine" in x)
    engine = " ".join(x.strip("│ ") for x in lines[at:at + 6])
    assert "without it" in engine and "layout" in engine


@pytest.mark.parametrize("flag", ["--num-prompts", "--prompts"])
def test_either_name_reaches_the_run_and_errors_name_it(monkeypatch, flag):
    seen = {}
    monkeypatch.setattr("draftsmith.doctor.run_doctor",
                        lambda opts: seen.update(n=opts.prompts, dt=opts.dtype) or Report())
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", flag, "7", "--dtype",
                                      "float16"])
    assert res.exit_code == 0, res.output
    assert seen == {"n": 7, "dt": torch.float16}
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", flag, "chat"])
    assert str(res.exception).startswith(f"{flag} takes a number of prompts for the short run")
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", flag, "0"])
    assert str(res.exception) == f"{flag} must be >= 1, got 0"
    res = CliRunner().invoke(_app(), ["doctor", "--data", "x", flag, "8"])
    assert str(res.exception).startswith(f"{flag} applies only with --drafter")


def test_both_names_at_once_refused(monkeypatch):
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: pytest.fail("ran"))
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--num-prompts", "3",
                                      "--prompts", "5"])
    assert isinstance(res.exception, DraftsmithError)
    assert str(res.exception) == ("--prompts is --num-prompts' old name: give --num-prompts "
                                  "alone")


def test_fewer_prompts_finding_names_the_flag_given(work, target, target_dir):
    good = make_drafter(work / "few17", target, TRUE)
    rep = run_doctor(DoctorOptions(drafter=good, target=str(target_dir), run=True, prompts=6,
                                   max_new=2, prompts_flag="--num-prompts"))
    (f,) = [f for f in rep.findings if f.check == "behaviour" and f.severity == "info"]
    assert "not the 6 --num-prompts asks for" in f.what and f.where == "--num-prompts"
