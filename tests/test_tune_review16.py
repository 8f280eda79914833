"""Review 16 of `draftsmith tune`: `--refill`'s prompt passes were timed in silence and kept
only when all were done, so a tune killed there timed them all again; and the cost shapes'
total was counted by hand beside the loops that time them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_tune_cli import _tiny_pair
from test_tune_review15 import _fake

from draftsmith.tune import measure


def _fast(monkeypatch, timed: list[str], stop_at: int | None = None) -> None:
    """review 15's fakes, and the partial file written without its fsyncs (most of a faked
    tune's time)."""
    from draftsmith.data import atomic

    _fake(monkeypatch, timed, stop_at)
    monkeypatch.setattr(atomic, "atomic_write", lambda path, data, *a: path.write_bytes(data))


def _tune(tmp_path, folder, prompts, out):
    from draftsmith.tune.cli import run_tune

    return run_tune(tmp_path / "d", str(folder), prompts, [2], 2, 4, 1, "cpu", torch.float32,
                    False, out, max_topk=2, max_draft=4, refill=True)


def _lines(capsys, after: str) -> list[str]:
    out = capsys.readouterr().out.splitlines()
    return [s for s in out[out.index(after) + 1:] if s.startswith("cost ")] if after in out else []


def test_refill_passes_are_said_saved_and_taken_up_by_a_resumed_tune(tmp_path, monkeypatch,
                                                                      capsys):
    from draftsmith.tune.cli import PARTIAL

    folder, prompts = _tiny_pair(tmp_path)
    timed: list[str] = []
    _fast(monkeypatch, timed)
    whole = _tune(tmp_path, folder, prompts, tmp_path / "whole")
    passes = [k for k in timed if k.startswith("refill pass")]
    assert len(passes) == 4  # rows 1 and 2 of 2, baseline and speculative: the last timed
    assert timed[-4:] == passes
    lines = _lines(capsys, "measuring refills' prompt passes ...")
    assert [s.split(" (")[0] for s in lines] == [f"cost {i}/4: {k}"
                                                 for i, k in enumerate(passes, 1)]
    k, out = len(timed) - 3, tmp_path / "stopped"  # stopped at the second pass
    timed.clear()
    _fast(monkeypatch, timed, stop_at=k + 1)
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path, folder, prompts, out)
    shapes = json.loads((out / PARTIAL).read_text())["cost_shapes"]
    assert [s for s in shapes if s.startswith("refill pass")] == passes[:1]
    every = list(timed[:-1])
    timed.clear()
    capsys.readouterr()
    _fast(monkeypatch, timed)
    again = _tune(tmp_path, folder, prompts, out)
    assert timed == passes[1:] and every[-1] == passes[0]
    said = capsys.readouterr().out
    assert "measuring refills' prompt passes ... (1 timed before it stopped)" in said
    assert f"cost 2/4: {passes[1]}" in said and "measuring costs" not in said
    assert again["costs"] == whole["costs"]
    assert again["recommendations"] == whole["recommendations"]
    assert again["texts"] == whole["texts"]
    assert not (out / PARTIAL).exists()


def _engine() -> measure.Engine:
    """No runtime at all: every shape is taken through the log, never timed."""
    rt = SimpleNamespace(capture=lambda *a, **k: None)
    drafter = SimpleNamespace(cfg=SimpleNamespace(aux_layer_ids=(0, 2, 4)))
    return measure.Engine(rt, rt, drafter)


@pytest.mark.parametrize("limits", [(2, 1, 3), (3, 4, 11), (10, 8, 32)])
def test_cost_total_is_the_plan_the_loops_time(limits, monkeypatch):
    max_steps, max_topk, max_draft = limits
    taken: list[str] = []

    def take(self, key, fn):
        self.seen += 1
        taken.append(key)
        return {"draft": 1.0, "accept": 0.5} if key.startswith("phase") else 1.0

    monkeypatch.setattr(measure.CostLog, "take", take)
    eng = _engine()
    measure.cost_table(eng, [1, 4], [[1, 2, 3]], max_topk, max_steps, max_draft)
    plan = measure.cost_plan([1, 4], max_topk, max_steps,
                             measure.cost_width(max_steps, max_topk, max_draft))
    assert eng.costs.total == len(plan.shapes()) == len(taken) == len(set(taken))
    assert [len(kind) for kind in plan] == [
        sum(k.startswith(w) for k in taken) for w in ("drafter", "phase", "verify", "decode")]
