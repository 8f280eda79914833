"""Doctor review 25: a --samples past what the dataset holds compared all it holds and said
nothing; it is an info finding naming both counts, as a --num-prompts past the data's is."""

from __future__ import annotations

import json

import test_doctor as td
import typer
from typer.testing import CliRunner

from draftsmith.doctor import doctor as command

# test_doctor's module fixtures: its tiny 8-layer target, 6 samples on layers 1, 3, 5
target_dir, target, data_dir = td.target_dir, td.target, td.data_dir


def _fewer(rep) -> list:
    return [f for f in rep.findings if "--samples" in f.what]


def test_samples_past_the_dataset_are_said_not_dropped_silently(data_dir, target_dir):
    rep = td.doctor(data=data_dir, target=str(target_dir), samples=20)
    (f,) = _fewer(rep)
    assert (f.severity, f.check, f.where) == ("info", "wiring", str(data_dir))
    assert f.what == ("the live match compared 6 samples, not the 20 --samples asks for: "
                      "the dataset holds 6")
    assert "\n" not in f.what and "--samples 6" in f.fix
    assert rep.wiring["samples"] == list(range(6)) and rep.exit_code(strict=True) == 0


def test_samples_the_dataset_holds_say_nothing(data_dir, target_dir):
    assert not _fewer(td.doctor(data=data_dir, target=str(target_dir), samples=6))


def test_the_cli_json_carries_it(data_dir, target_dir):
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    out = CliRunner().invoke(app, ["doctor", "--data", str(data_dir), "--target",
                                   str(target_dir), "--json", "--no-run", "--samples", "9"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    (f,) = [f for f in rep["findings"] if "--samples" in f["what"]]
    assert f["severity"] == "info" and "not the 9 --samples asks for" in f["what"]
