"""`draftsmith tune`, sixth review: tune-nccl's target on CPU, a stopped NCCL sweep resumed from
nccl.partial.json, and a stopped tune resumed under other --batch-sizes."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_cli import _tiny_pair
from test_tune_review4 import _fake_measures

from draftsmith.errors import DraftsmithError
from draftsmith.tune import nccl

# ---- tune-nccl's default target -----------------------------------------------------------------


def test_tune_nccl_on_cpu_times_a_target_cpu_can_run(tmp_path, monkeypatch):
    """On CPU the default was random-8b: 4B parameters a rank, a second a forward, so every
    setting spent its --timeout and failed (gloo takes no NCCL setting anyway)."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune.cli import sweep_target, tune_nccl

    seen = []
    monkeypatch.setattr(nccl, "run_nccl_sweep", lambda tp, target, *a, **k: seen.append(target))
    monkeypatch.setattr(nccl, "print_report", lambda *a, **k: None)
    app = typer.Typer()
    app.command()(tune_nccl)
    for given, want in (([], "tiny"), (["--target", "default"], "default")):
        res = CliRunner().invoke(app, ["--device", "cpu", "--dtype", "fp32", *given, "--out",
                                       str(tmp_path / "n")])
        assert res.exit_code == 0, res.output
        assert seen[-1] == want
    assert "timing the tiny random target" in CliRunner().invoke(
        app, ["--device", "cpu", "--out", str(tmp_path / "n")]).output
    assert sweep_target("cuda") == "random-8b"


# ---- a stopped NCCL sweep resumes ---------------------------------------------------------------

LL, RING = nccl.NcclSetting("LL", proto="LL"), nccl.NcclSetting("Ring", algo="Ring")


def _fake_settings(monkeypatch, ran: list, stop_at: str | None = None) -> None:
    def run(setting, tp, job, device, rank_fn, timeout_s):
        ran.append(setting.name)
        if setting.name == stop_at:
            raise KeyboardInterrupt  # the sweep killed while this setting runs
        ms = {"defaults": 2.0, "LL": 1.5, "Ring": 1.9}[setting.name]
        return {"setting": setting.name, "status": "ok", "env": setting.env(), "backend": "gloo",
                "verify": [{"batch": 1, "tokens": 1, "ms": ms, "spread_pct": 0.5}],
                "allreduce": []}

    monkeypatch.setattr(nccl, "run_setting", run)


def test_a_stopped_nccl_sweep_resumes_from_its_partial_file(tmp_path, monkeypatch):
    """A sweep killed at its third setting lost the two it had timed (minutes each on a GPU):
    nccl.json is written only at the end."""
    kw = dict(target="tiny", settings=[nccl.DEFAULTS, LL, RING], shapes=[(1, 1)],
              device="cpu", dtype="fp32", iters=1, log=lambda _: None)
    ran: list = []
    _fake_settings(monkeypatch, ran)
    whole = nccl.run_nccl_sweep(2, **kw, out=tmp_path / "whole")
    ran.clear()
    _fake_settings(monkeypatch, ran, stop_at="Ring")
    out = tmp_path / "n"
    with pytest.raises(KeyboardInterrupt):
        nccl.run_nccl_sweep(2, **kw, out=out)
    kept = json.loads((out / nccl.PARTIAL).read_text())
    assert [r["setting"] for r in kept["results"]] == ["defaults", "LL"]
    with pytest.raises(DraftsmithError, match=r"another NCCL sweep timed before it stopped \(job "
                                              r".*delete the file or give another --out"):
        nccl.run_nccl_sweep(2, **{**kw, "iters": 2}, out=out)
    ran.clear()
    _fake_settings(monkeypatch, ran)
    rep = nccl.run_nccl_sweep(2, **kw, out=out)
    assert ran == ["Ring"]
    assert rep["results"] == whole["results"]
    assert rep["recommendation"] == whole["recommendation"]
    assert (out / "nccl.json").is_file() and not (out / nccl.PARTIAL).exists()


# ---- a stopped tune resumed under other --batch-sizes -------------------------------------------


def _tune(tmp_path, folder, prompts, out, batches):
    from draftsmith.tune.cli import run_tune

    return run_tune(tmp_path / "d", str(folder), prompts, batches, 2, 4, 1, "cpu",
                    torch.float32, False, out, max_topk=2, max_draft=5)


def test_a_stopped_tune_resumes_under_other_batch_sizes_measuring_only_whats_new(
        tmp_path, monkeypatch):
    """--batch-sizes 1 stopped in its sweep, rerun as 1,2: refused as another tune, so the
    acceptance, costs and sweep points it had measured were all measured again. Now the costs
    and points at 1 are kept, batch 2's measured, and the tree acceptance (its prompts decoded
    in batches of the largest size) again; the report equals an unstopped 1,2 run."""
    from draftsmith.tune import measure
    from draftsmith.tune.cli import PARTIAL

    folder, prompts = _tiny_pair(tmp_path)
    monkeypatch.setattr("draftsmith.tune.cli.plot", lambda *a: None)  # the PNG: not compared
    calls: list = []

    def noted(fail: str | None = None) -> None:
        _fake_measures(monkeypatch, calls, fail)
        costs = measure.cost_table
        monkeypatch.setattr(measure, "cost_table",
                            lambda eng, batches, *a, **k: calls.append(list(batches))
                            or costs(eng, batches, *a, **k))

    noted()
    _tune(tmp_path, folder, prompts, tmp_path / "whole", [1, 2])
    whole = json.loads((tmp_path / "whole" / "tune.json").read_text())
    calls.clear()
    noted("sweep")
    out = tmp_path / "stopped"
    with pytest.raises(DraftsmithError, match="resumes from it"):
        _tune(tmp_path, folder, prompts, out, [1])
    calls.clear()
    noted()
    _tune(tmp_path, folder, prompts, out, [1, 2])
    assert calls[:3] == ["tree", [2], "costs"] and "chain" not in calls
    assert json.loads((out / "tune.json").read_text()) == whole
    assert not (out / PARTIAL).exists()


def test_kept_costs_keep_the_asked_batches_and_refills_timed_for_the_same_rows():
    from draftsmith.tune.cost_model import CostTable
    from draftsmith.tune.partial import joined, kept_costs, missing

    table = CostTable(verify={1: {1: 1.0}, 2: {1: 2.0}}, draft_step={1: {1: 0.1}, 2: {1: 0.2}},
                      decode={1: 0.9, 2: 1.8}, refill={1: 5.0, 2: 6.0},
                      spec_refill={1: 6.0, 2: 7.0})
    was = {"run": {"batches": [1, 2]}, "costs": table.to_dict()}
    assert kept_costs(was, [1, 2], 2) == table
    got = kept_costs(was, [2, 8], 8)
    assert got is not None and dict(got.verify) == {2: {1: 2.0}} and not got.refill
    assert missing(got, [2, 8]) == [8] and kept_costs(was, [8], 8) is None
    new = CostTable(verify={8: {1: 8.0}}, draft_step={8: {1: 0.8}}, decode={8: 7.2})
    both = joined(got, new, [2, 8])
    assert list(both.verify) == [2, 8] and dict(both.decode) == {2: 1.8, 8: 7.2}
