"""compare, seventh review: tok/s timed on a busy machine said nothing of it (0.76 vs 1.18 tok/s
for identical accept histograms); acceptance flags demanded --target although every drafter
records its target; `accept_rate` was undocumented (accept length / (steps + 1), easily read as
per draft token); a rerun replaced compare.json without a word."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.bench import load
from draftsmith.compare import CompareOptions, run_compare
from draftsmith.compare.report import markdown, sections
from draftsmith.errors import DraftsmithError

BUSY = {"cores": 2, "load_before": 2.1, "load_after": 2.3, "own_cores": 0.9,
        "other_cores": 1.4, "busy": True}
QUICK = {"num_prompts": 1, "max_new": 3, "steps": 2}


def _edit(folder, edit) -> None:
    path = folder / "draftsmith.json"
    data = json.loads(path.read_text())
    data.pop("target_source", None)  # the copy beside the config: the config's is read
    edit(data["config"])
    path.write_text(json.dumps(data))


def test_acceptance_flags_take_the_target_every_drafter_records(drafters, target, capsys):  # noqa: F811
    paths = [str(drafters["A"]), str(drafters["B"])]
    opts = CompareOptions(paths, **QUICK)
    assert opts.target == str(target.folder) and opts.recorded
    res = run_compare(opts)
    assert res["speed"]["drafters"] and res["context"]["target_from"] == "the drafters' records"
    assert (f"no --target given; measuring acceptance on the target every drafter records, "
            f"{target.folder}") in capsys.readouterr().err
    described = run_compare(CompareOptions(paths))  # no acceptance flag: described only
    assert "speed" not in described and described["context"]["target"] is None


def test_targets_that_differ_or_none_recorded_are_refused_by_name(drafters, tmp_path):  # noqa: F811
    other = tmp_path / "other"
    shutil.copytree(drafters["B"], other)
    _edit(other, lambda c: c.update(target_source=str(tmp_path)))
    with pytest.raises(DraftsmithError, match=r"--steps set how acceptance is measured, "
                       r"which needs --target: the drafters record different targets "
                       r"\(small: .*, other: .*\); give --target"):
        CompareOptions([str(drafters["A"]), str(other)], **QUICK)
    _edit(other, lambda c: c.pop("target_source"))
    with pytest.raises(DraftsmithError, match="needs --target: drafter other records no target"):
        CompareOptions([str(drafters["A"]), str(other)], **QUICK)


def test_the_default_by_its_names_is_one_target(drafters, tmp_path):  # noqa: F811
    from draftsmith.compare import recorded_target
    from draftsmith.targets import DEFAULT_NAME

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(drafters["A"], a)
    shutil.copytree(drafters["B"], b)
    _edit(a, lambda c: c.update(target_source="default"))
    _edit(b, lambda c: c.update(target_source=DEFAULT_NAME))
    assert recorded_target([str(a), str(b)]) == ("default", "")


def test_the_load_over_the_timed_runs_is_recorded_and_a_busy_one_flagged(drafters, target,  # noqa: F811
                                                                         monkeypatch, tmp_path):
    spans = []
    monkeypatch.setattr(load.Tally, "result", lambda self: spans.append(self.spans) or BUSY)
    res = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                     target=str(target.folder), out=tmp_path, **QUICK))
    assert spans == [3]  # the baseline and both drafters on the one prompt, warm-ups left out
    assert res["speed"]["machine_load"] == BUSY
    noted = [n for n in res["notes"] if "machine was busy" in n]
    assert len(noted) == 1 and "tokens/s and speedups are skewed" in noted[0]
    title = [t for t, _, _ in sections(res) if t.startswith("Acceptance")][0]
    assert title.endswith("BUSY MACHINE (see the notes)")
    assert noted[0] in (tmp_path / "compare.md").read_text()
    assert json.loads((tmp_path / "compare.json").read_text())["speed"]["machine_load"] == BUSY


def test_accept_rate_is_defined_in_the_json_and_the_table(drafters, target):  # noqa: F811
    res = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                     target=str(target.folder), **QUICK))
    sp = res["speed"]
    assert sp["definitions"]["accept_rate"].startswith("mean_accept_length / (steps + 1)")
    for run in sp["drafters"].values():
        assert run["accept_rate"] == pytest.approx(run["mean_accept_length"] / 3)
    rows = [t for t in sections(res) if t[0].startswith("Acceptance")][0][2]
    rate = [r for r in rows if r[0].startswith("accept rate")][0]
    assert rate[0] == "accept rate (accept length / 3, steps + 1; not per draft token)"
    assert rate[1] == f"{sp['drafters']['small']['accept_rate']:.3f}"
    assert "accept rate (accept length / 3" in markdown(res, None)


def test_a_rerun_says_it_replaces_the_earlier_report(drafters, tmp_path, capsys):  # noqa: F811
    paths = [str(drafters["A"]), str(drafters["B"])]
    run_compare(CompareOptions(paths, out=tmp_path))
    assert "replacing" not in capsys.readouterr().err
    past = time.time() - 3600
    os.utime(tmp_path / "compare.json", (past, past))
    run_compare(CompareOptions(paths, out=tmp_path))
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(past))
    assert (f"compare: replacing the earlier report {tmp_path / 'compare.json'} (written {when}"
            in capsys.readouterr().err)


def test_the_cli_takes_device_with_an_acceptance_flag_on_the_recorded_target(drafters):  # noqa: F811
    import typer
    from typer.testing import CliRunner

    from draftsmith.compare import compare

    app = typer.Typer()
    app.command()(compare)
    app.command("other")(lambda: None)
    args = ["compare", str(drafters["A"]), str(drafters["B"]), "--device", "cpu", "--json"]
    r = CliRunner().invoke(app, [*args, "--num-prompts", "1", "-n", "2", "--steps", "1"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout)["speed"]["device"] == "cpu"
    r = CliRunner().invoke(app, args)  # nothing measured: --device alone is still refused
    assert "--device set where acceptance is measured" in str(r.exception)
