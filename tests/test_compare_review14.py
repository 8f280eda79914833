"""compare, fourteenth review: a folder name holding `|` keeping compare.md's tables whole, the
report's files named on stderr once written, and a damaged drafter named as such when an
acceptance flag would take the target the drafters record."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.errors import DraftsmithError


def _cells(line: str) -> int:
    """A Markdown table row's columns (an escaped `\\|` is text, not a border)."""
    return len(line.replace("\\|", "").strip().strip("|").split("|"))


def test_a_folder_name_holding_a_bar_keeps_the_tables_columns(drafters, tmp_path):  # noqa: F811
    """Rows escaped `|`, headers did not: a drafter folder `exp|v2` gave each table's header
    one column more than its rows, so the Markdown table broke."""
    barred = tmp_path / "exp|v2"
    shutil.copytree(drafters["B"], barred)
    out = tmp_path / "out"
    run_compare(CompareOptions([str(drafters["A"]), str(barred)], out=out))
    tables = [line for line in (out / "compare.md").read_text().splitlines()
              if line.startswith("|")]
    widths = {_cells(line) for line in tables if not line.startswith("|---")}
    assert widths == {3}, widths  # the row name and two drafters, header and rows alike
    assert "| exp\\|v2 |" in (out / "compare.md").read_text()


def test_the_files_written_are_named_on_stderr(drafters, tmp_path, capsys):  # noqa: F811
    """With --out compare printed its tables and said nothing of where compare.md (and the
    plot its table shows) went, where bench and tune say what they wrote."""
    out = tmp_path / "out"
    run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])], out=out))
    got = capsys.readouterr()
    assert got.out == ""  # stdout stays --json's
    assert f"compare: wrote {out / 'compare.md'}, compare.json" in got.err
    assert "acceptance.png" not in got.err  # nothing measured: no plot


def test_a_damaged_drafter_is_named_not_asked_for_a_target(drafters, tmp_path):  # noqa: F811
    """An acceptance flag without --target with a folder missing its weights said "needs
    --target: give one"; given one, the next run named the missing weights."""
    cut = tmp_path / "cut"
    shutil.copytree(drafters["B"], cut)
    (cut / "model.safetensors").unlink()
    with pytest.raises(DraftsmithError, match=r"cut: no \*\.safetensors .* weight file") as e:
        CompareOptions([str(drafters["A"]), str(cut)], num_prompts=2)
    assert "--target" not in str(e.value)
    with pytest.raises(DraftsmithError, match="needs --target: give one"):  # no folder at all
        CompareOptions([str(drafters["A"]), str(Path(tmp_path / "none"))], num_prompts=2)


def test_the_pooled_accept_length_follows_from_the_per_prompt_figures(drafters,  # noqa: F811
                                                                      tiny_llama_dir):
    """compare.json gave each prompt's accept length but not how many cycles each ran: the
    pooled figure (every cycle counted once) was no mean of them a reader could redo, and
    nothing said the histogram sums to the cycles."""
    res = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                     target=str(tiny_llama_dir), num_prompts=3, max_new=6,
                                     steps=2))
    speed = res["speed"]
    assert {"cycles", "per_prompt_cycles", "accept_hist"} <= set(speed["definitions"])
    for run in speed["drafters"].values():
        per, cycles = run["per_prompt_accept_length"], run["per_prompt_cycles"]
        assert len(cycles) == 3 and sum(cycles) == run["cycles"] == sum(run["accept_hist"])
        assert run["reached"][0] == run["cycles"]  # every cycle verifies position 0
        pooled = sum(a * c for a, c in zip(per, cycles, strict=True)) / sum(cycles)
        assert run["mean_accept_length"] == pytest.approx(pooled)
