"""compare, twelfth review: the report's files moved in as one (a move refused midway puts the
earlier report back), tokens/s named with the device and dtype it was timed on, and the PNG
naming the target its acceptance was measured on, as the table does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)
from test_compare_review10 import measured  # noqa: F401  (the same measured run)

from draftsmith.compare import Unwritten, write
from draftsmith.compare.report import plot, sections


def test_a_move_refused_midway_puts_the_earlier_report_back(measured, tmp_path,  # noqa: F811
                                                            monkeypatch):
    """Staging kept the earlier report whole while files were written, but a rename refused
    midway (another user's compare.json in a sticky /tmp folder: EPERM) left the new plot and
    compare.md beside the earlier compare.json: two runs in one folder."""
    res, _ = measured
    out = tmp_path / "out"
    write({**res, "notes": [*res["notes"], "the earlier run"]}, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def refused(src, dst):
        names = Path(src).name, Path(dst).name  # another user's compare.json: never moved
        if "compare.json" in names and ".old." not in names[0]:
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(Unwritten, match="Operation not permitted"):
        run_compare_write(res, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no half, no tmp


def run_compare_write(res: dict, out: Path) -> None:
    """run_compare's write and its error, without measuring again."""
    try:
        write(res, out)
    except OSError as e:
        raise Unwritten(res, f"--out {out}: cannot write the report ({e.strerror})") from None


def test_a_moved_in_report_leaves_no_tmp_behind(measured, tmp_path):  # noqa: F811
    res, _ = measured
    out = tmp_path / "out"
    write(res, out)
    write(res, out)
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.png", "compare.json",
                                                    "compare.md"]


def test_tokens_per_s_names_the_device_and_dtype_it_was_timed_on(measured):  # noqa: F811
    """compare.md's tokens/s and speedup said nothing of where they were timed (a CPU float32
    run's 19 tok/s read as a GPU's): the row names the device, dtype and new tokens."""
    res, out = measured
    (rows,) = [r for t, _, r in sections(res) if t.startswith("Acceptance")]
    label = "tokens/s (cpu, float32, at most 6 new tokens a prompt)"
    assert [r[0] for r in rows].count(label) == 1
    assert f"| {label} |" in (out / "compare.md").read_text()


def test_the_plot_names_the_target_measured_on(measured, tmp_path, monkeypatch):  # noqa: F811
    """The acceptance table names the target; the PNG, shared alone, did not."""
    from matplotlib.figure import Figure

    res, _ = measured
    titles: list[str] = []
    real = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda fig, t, **k: titles.append(t)
                        or real(fig, t, **k))
    plot(res, tmp_path / "a.png")
    assert f"target {res['context']['target']}" in titles[0]


def test_a_report_of_an_older_run_without_device_still_renders(measured):  # noqa: F811
    res, _ = measured
    speed = {k: v for k, v in res["speed"].items() if k not in ("device", "dtype")}
    (rows,) = [r for t, _, r in sections({**res, "speed": speed}) if t.startswith("Accept")]
    assert any(r[0].startswith("tokens/s") for r in rows)



def test_a_ctrl_c_between_the_moves_puts_the_earlier_report_back(measured, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """A ctrl-C after the new plot had been moved in left it beside the earlier compare.md."""
    res, _ = measured
    out = tmp_path / "out"
    write({**res, "speed": {**res["speed"], "suite": "earlier"}}, out)  # another plot too
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def interrupted(src, dst):
        if Path(dst).name == "compare.md" and ".old." not in Path(src).name:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write(res, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_rerun_measuring_nothing_drops_the_plot_with_the_report(measured, drafters,  # noqa: F811
                                                                  tmp_path, monkeypatch):
    """The earlier plot was removed after the new report was in, outside the staged moves: a
    refused move kept the earlier report but not its plot."""
    from draftsmith.compare import CompareOptions, run_compare

    res, _ = measured
    out = tmp_path / "out"
    write(res, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def refused(src, dst):
        if Path(dst).name == "compare.json" and ".old." not in Path(src).name:
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(Unwritten):
        run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])], out=out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.setattr(os, "replace", real)
    run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])], out=out))
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md"]
