"""Review 15 of `draftsmith tune`: `measuring costs ...` printed nothing for minutes and kept
nothing until its table was whole, so a tune killed there lost every cost it had timed; and
--prompts read `<path>` though it takes chat and humaneval, where bench says --suite."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_cli import _tiny_pair

from draftsmith.tune.cost_model import Acceptance, Measurement, PromptMix

ACC = Acceptance(chain=(0.8, 0.6), tree=((0.6, 0.2), (0.5, 0.2)))


def _fake(monkeypatch, timed: list[str], stop_at: int | None = None) -> None:
    """Acceptance and sweep faked; each cost shape 'timed' by a figure of its name alone,
    noted in `timed`; the `stop_at`th raises KeyboardInterrupt, as a kill there would."""
    from draftsmith.tune import cli, measure

    monkeypatch.undo()  # an earlier call's fakes: not wrapped in these
    mix = PromptMix((ACC,) * 3)
    monkeypatch.setattr(measure, "chain_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(measure, "tree_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(cli, "plot", lambda *a, **k: None)
    monkeypatch.setattr(measure, "run_setting",
                        lambda eng, s, ids, b, *a: Measurement(s, b, 100.0 + s.steps))
    take = measure.CostLog.take

    def figure(key: str):
        timed.append(key)
        if len(timed) == stop_at:
            raise KeyboardInterrupt
        ms = 1.0 + sum(map(ord, key)) % 17 / 10
        return {"draft": ms, "accept": ms / 4} if key.startswith("phase") else ms

    monkeypatch.setattr(measure.CostLog, "take",
                        lambda self, key, fn: take(self, key, lambda: figure(key)))


def _tune(tmp_path, folder, prompts, out):
    from draftsmith.tune.cli import run_tune

    return run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu", torch.float32,
                    False, out, max_topk=2, max_draft=4)


def test_a_tune_killed_while_timing_costs_keeps_the_shapes_it_timed(tmp_path, monkeypatch,
                                                                     capsys):
    from draftsmith.tune.cli import PARTIAL

    folder, prompts = _tiny_pair(tmp_path)
    timed: list[str] = []
    _fake(monkeypatch, timed)
    whole = _tune(tmp_path, folder, prompts, tmp_path / "whole")
    every, n = list(timed), len(timed)
    assert n > 10 and len(set(every)) == n
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("cost ")]
    assert len(lines) == n and lines[0].startswith(f"cost 1/{n}: {every[0]} (")
    assert "s left)" in lines[0] and lines[-1].startswith(f"cost {n}/{n}: ")
    k, out = 7, tmp_path / "stopped"
    timed.clear()
    _fake(monkeypatch, timed, stop_at=k + 1)
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path, folder, prompts, out)
    assert list(json.loads((out / PARTIAL).read_text())["cost_shapes"]) == every[:k]
    timed.clear()
    _fake(monkeypatch, timed)
    again = _tune(tmp_path, folder, prompts, out)
    assert timed == every[k:]
    assert again["costs"] == whole["costs"]
    assert f"cost {k + 1}/{n}: {every[k]}" in capsys.readouterr().out
    assert not (out / PARTIAL).exists()


def _stopped(tmp_path, monkeypatch):
    """A tune stopped (ctrl-C) at its third cost shape: (drafter, prompts, its --out)."""
    folder, prompts = _tiny_pair(tmp_path)
    _fake(monkeypatch, [], stop_at=3)
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path, folder, prompts, out)
    return folder, prompts, out


def test_kept_cost_shapes_of_another_tune_are_refused_naming_the_file(tmp_path, monkeypatch):
    from draftsmith.errors import DraftsmithError
    from draftsmith.tune.cli import PARTIAL, run_tune

    folder, prompts, out = _stopped(tmp_path, monkeypatch)
    with pytest.raises(DraftsmithError, match=f"{PARTIAL} holds what another tune.*max_draft"):
        run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu", torch.float32,
                 False, out, max_topk=2, max_draft=3)


def test_damaged_kept_cost_shapes_are_refused_before_loading(tmp_path, monkeypatch):
    from draftsmith.errors import DraftsmithError
    from draftsmith.tune.cli import PARTIAL

    folder, prompts, out = _stopped(tmp_path, monkeypatch)
    data = json.loads((out / PARTIAL).read_text())
    data["cost_shapes"] = {"verify batch 1, 1 tokens": "fast"}
    (out / PARTIAL).write_text(json.dumps(data))
    with pytest.raises(DraftsmithError, match="cannot be read"):
        _tune(tmp_path, folder, prompts, out)


def test_tune_takes_suite_as_bench_does_and_says_what_it_takes(capsys, monkeypatch):
    import typer

    from draftsmith.cli import _register, app
    from draftsmith.tune import cli

    _register()
    root = typer.main.get_command(app)
    monkeypatch.setenv("COLUMNS", "200")
    root.main(["tune", "--help"], prog_name="draftsmith", standalone_mode=False)
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--suite, --prompts <str>" in help_text
    assert "chat, humaneval, or a prompt file [default: chat]" in help_text
    seen = []
    monkeypatch.setattr(cli, "run_tune", lambda d, t, prompts, *a, **k: seen.append(prompts) or {})
    for flag in ("--suite", "--prompts"):
        root.main(["tune", "--drafter", "d", "--device", "cpu", flag, "humaneval"],
                  prog_name="draftsmith", standalone_mode=False)
    assert [str(p) for p in seen] == ["humaneval", "humaneval"]
