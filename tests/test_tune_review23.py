"""Tune, twenty-third review: a setting that failed in the sweep is not drawn on the PNG's
predicted curve as if it were comparable, but marked apart."""

from __future__ import annotations

from draftsmith.tune.cost_model import Measurement, Prediction, SpecSetting


def _pred(s: SpecSetting, batch: int, tps: float) -> Prediction:
    return Prediction(s, batch, 1.0, 1.0, tps, {})


def test_a_failed_setting_is_left_off_the_predicted_curve_and_marked_apart() -> None:
    """The predicted chain at steps 3 failed at batch 2 (out of memory): the PNG's predicted
    curve still ran through its 300 tok/s, a point the sweep never measured."""
    from draftsmith.tune.cli import plot_series

    chain3, tree3 = SpecSetting(3), SpecSetting(3, 2, 6)
    preds = [_pred(SpecSetting(0), 2, 100.0), _pred(SpecSetting(2), 2, 200.0),
             _pred(chain3, 2, 300.0), _pred(tree3, 2, 350.0), _pred(SpecSetting(3, 2, 8), 2, 340.0),
             _pred(chain3, 1, 150.0)]
    meas = [Measurement(SpecSetting(0), 2, 90.0), Measurement(SpecSetting(2), 2, 190.0),
            Measurement(SpecSetting(3, 2, 8), 2, 330.0), Measurement(chain3, 1, 140.0)]
    failed = [(2, chain3, "OutOfMemoryError: CUDA out of memory", RuntimeError()),
              (2, tree3, "OutOfMemoryError: CUDA out of memory", RuntimeError())]
    series = plot_series(preds, meas, [1, 2], failed)
    chains, trees = series[2]["chains"], series[2]["trees"]
    assert chains["predicted"] == [(0, 100.0), (2, 200.0)]
    assert chains["failed"] == [(3, 300.0)]
    assert trees["predicted"] == [(0, 100.0), (3, 340.0)]  # the budget that ran, not 350
    assert trees["failed"] == [(3, 350.0)]
    # the same setting at a batch where it ran stays on that batch's curve
    assert series[1]["chains"]["predicted"] == [(3, 150.0)]
    assert series[1]["chains"]["failed"] == []


def test_the_plot_marks_failed_settings_apart(tmp_path, monkeypatch) -> None:
    """Failed settings drawn as their own markers, no line, labelled as failed."""
    from matplotlib.axes import Axes

    from draftsmith.tune.cli import plot

    drawn: list[tuple[list, str]] = []
    real = Axes.plot

    def spy(self, xs, ys, *a, **k):
        drawn.append((list(zip(xs, ys, strict=True)), k.get("label", "")))
        return real(self, xs, ys, *a, **k)

    monkeypatch.setattr(Axes, "plot", spy)

    series = {2: {"chains": {"predicted": [(0, 100.0)], "measured": [(0, 90.0)],
                             "failed": [(3, 300.0)]},
                  "trees": {"predicted": [], "measured": [], "failed": [(3, 350.0)]}}}
    plot(tmp_path / "tune.png", series)
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"
    failed = [(pts, label) for pts, label in drawn if "failed" in label]
    assert [pts for pts, _ in failed] == [[(3, 300.0)], [(3, 350.0)]]
    assert not any((3, 300.0) in pts or (3, 350.0) in pts for pts, label in drawn
                   if "failed" not in label)


def test_a_batch_where_nothing_ran_is_said_in_its_place_among_the_batches(tmp_path,
                                                                          monkeypatch):
    """batch 2's "no setting ran" came after batch 8's recommendation in the terminal and
    tune.md: the batches read out of order."""
    import torch
    from test_tune_cli import _tiny_pair
    from test_tune_review21 import _fakes
    from test_tune_review22 import COSTS, _oom_at_batch_2

    from draftsmith.tune import measure
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, _oom_at_batch_2)
    monkeypatch.setattr(measure, "cost_table", lambda *a, **k: COSTS)
    out = tmp_path / "tune"
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2, 8], 2, 8, 1, "cpu",
                      torch.float32, False, out, max_topk=1)
    heads = [t.split(":")[0] for t in report["texts"] if t.startswith("batch ")]
    assert heads == ["batch 1", "batch 2", "batch 8"]
    md = (out / "tune.md").read_text()
    assert md.index("batch 1:") < md.index("batch 2: no setting ran") < md.index("batch 8:")
