"""compare: what was not measured reads as not measured, exported folders keep their target,
drafters of different targets are said to be so, and DRAFTSMITH_PROFILE stays out of the
timed runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

from conftest import write_tiny_folder
from test_compare import build, drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, differences, run_compare
from draftsmith.compare.describe import describe
from draftsmith.compare.report import _speed, plot
from draftsmith.compare.speed import _finish
from draftsmith.engine.spec_state import SpecResult
from draftsmith.models.eagle3 import save_drafter


def test_a_drafter_that_accepts_nothing_has_no_rate_at_positions_never_reached(tmp_path):
    """Position 1 is reached only after position 0 is accepted: its rate was shown as 0.0 %,
    as were the rates and accept length of a run of no cycle at all."""
    nothing = _finish([SpecResult([[1, 2, 3]], 0.1, 0.2, 3, 2, [0, 3, 0], [3, 0], [0, 0])])
    idle = _finish([SpecResult([[1]], 0.1, 0.0, 0, 2, [0, 0, 0], [0, 0], [0, 0])])
    assert nothing["position_rates"] == [0.0, None] and nothing["mean_accept_length"] == 1.0
    assert idle["position_rates"] == [None, None] and idle["mean_accept_length"] is None
    speed = {"suite": "chat", "prompts": 1, "steps": 2, "topk": 1, "num_draft_tokens": 3,
             "baseline_tokens_per_s": 10.0,
             "drafters": {"n": {**nothing, "speedup": 1.0}, "i": {**idle, "speedup": 1.0}}}
    res = {"drafters": [], "speed": speed}
    rows = {r[0]: r[1:] for r in _speed(speed, ["n", "i"])}
    assert rows["P(accept position 0 | reached)"] == ["0.0%", "-"]
    assert rows["P(accept position 1 | reached)"] == ["-", "-"]
    assert rows["mean accept length (tokens/cycle)"] == ["1.00", "-"]
    assert plot(res, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(speed, allow_nan=False)  # None, not NaN, in compare.json


def test_no_cycle_reads_as_unmeasured_end_to_end(drafters, tiny_llama_dir, tmp_path):  # noqa: F811
    paths = [str(drafters["A"]), str(drafters["B"])]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), num_prompts=1,
                                     max_new=1, steps=2, out=tmp_path))
    for r in res["speed"]["drafters"].values():
        assert r["position_rates"] == [None, None] and r["mean_accept_length"] is None
    md = (tmp_path / "compare.md").read_text()
    assert "| P(accept position 0 \\| reached) | - | - |" in md
    assert "0.0%" not in md and (tmp_path / "acceptance.png").is_file()


def test_an_exported_folder_trained_for_another_target_is_flagged(drafters, tmp_path):  # noqa: F811
    """An exported folder records its target in its `draftsmith` section, which compare did
    not read: its acceptance on another target went unflagged."""
    from draftsmith.compare import _other_target
    from draftsmith.export import export_drafter

    a = describe(drafters["A"], "A")
    fp = a.info.recorded("target_fingerprint")
    exported = export_drafter(drafters["A"], "speculators", tmp_path / "spec", overwrite=True)
    e = describe(exported, "E")
    assert e.info.layout == "speculators" and e.info.recorded("target_fingerprint") == fp
    other = SimpleNamespace(source="other", fingerprint="0" * 16)
    flagged = _other_target([a, e], other)
    assert [n.split(" ")[0] for n in flagged] == ["A", "E"]
    assert _other_target([a, e], SimpleNamespace(source="own", fingerprint=fp)) == []


def test_drafters_of_different_targets_are_said_to_be_so(drafters, target, tmp_path):  # noqa: F811
    """Same shapes, other weights: no architecture difference showed that the two drafters
    were trained for different targets."""
    from draftsmith.targets import load_target

    other = load_target(str(write_tiny_folder(tmp_path / "t", "llama", seed=1)))
    c = save_drafter(build(other, 128, 32, [0, 2, 4], 0), tmp_path / "c")
    a, b, cd = describe(drafters["A"], "a"), describe(drafters["B"], "b"), describe(c, "c")
    notes = differences([a, cd])
    assert any(n.startswith("a and c were trained for different targets (fingerprints "
                            f"{target.fingerprint} vs {other.fingerprint})") for n in notes)
    assert not any("different targets" in n for n in differences([a, b]))


def test_timed_runs_are_not_profiled_under_the_environment_switch(
        drafters, tiny_llama_dir, monkeypatch):  # noqa: F811
    """DRAFTSMITH_PROFILE=1 profiled compare's timed runs (a sync a cycle on a GPU), whose
    phases it never reports."""
    from draftsmith.engine import profiler

    made = []
    real = profiler.PhaseProfiler.__init__
    monkeypatch.setattr(profiler.PhaseProfiler, "__init__",
                        lambda self, *a: made.append(1) or real(self, *a))
    monkeypatch.setenv("DRAFTSMITH_PROFILE", "1")
    paths = [str(drafters["A"]), str(drafters["B"])]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), num_prompts=1,
                                     max_new=4, steps=1))
    assert res["speed"]["drafters"] and made == []


def test_folder_names_print_as_text_not_markup(drafters, tmp_path, capsys):  # noqa: F811
    """rich read a folder called exp[v2] as markup: the tables and notes said "exp"."""
    import shutil

    from draftsmith.compare import show

    a = shutil.copytree(drafters["A"], tmp_path / "exp[v2]")
    res = run_compare(CompareOptions([str(a), str(drafters["B"])]))
    show(res)
    out = capsys.readouterr().out
    assert "┃ exp[v2]" in out and "- exp[v2] vs big: architecture differs" in out
