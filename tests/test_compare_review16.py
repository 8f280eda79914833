"""compare, sixteenth review: counts rounded into the next unit said in it (not "1e+03K"), and
folders recording no fingerprint whose verifiers are targets of other depths named as trained
for different targets, as `_other_target` names one measured on another depth."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import write_tiny_folder
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import differences
from draftsmith.compare.describe import describe
from draftsmith.compare.params import human


@pytest.mark.parametrize("n,said", [(999_500, "1M"), (999_999, "1M"), (999_600_000, "1B"),
                                    (999_499, "999K"), (12_345, "12.3K"), (999, "999"),
                                    (999.6, "1K"), (2.6e9, "2.6B")])
def test_a_count_rounding_into_the_next_unit_is_said_in_it(n, said):
    """999,600,000 parameters read "1e+03M" in the tables and claim lines."""
    assert human(n) == said


def _verifier(folder: Path, dest: Path, verifier: Path) -> Path:
    """A copy of a speculators folder whose verifier is `verifier`."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_verifiers_of_other_depths_are_different_targets(drafters, tmp_path):  # noqa: F811
    """Two speculators folders (no fingerprint) whose verifiers share vocab and width but not
    depth (Qwen3-14B and -32B): "the same architecture" was all compare said, though no one
    target measures both as trained."""
    deep = write_tiny_folder(tmp_path / "deep", num_hidden_layers=8, seed=3)
    sp = describe(drafters["B-speculators"], "sp")
    deeper = describe(_verifier(drafters["B-speculators"], tmp_path / "deeper", deep), "deeper")
    notes = differences([sp, deeper])
    assert [n for n in notes if "different targets" in n] == [
        "sp and deeper were trained for different targets (target layers 6 vs 8): no one "
        "target measures both as trained"]
    assert not any("different targets" in n for n in differences(
        [sp, describe(drafters["B-speculators"], "same")]))


def _cli(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> list[Any]:
    """`compare` through its CLI, the options it runs with kept (nothing measured)."""
    import typer
    from typer.testing import CliRunner

    import draftsmith.compare as cmp

    seen: list[Any] = []
    monkeypatch.setattr(cmp, "run_compare", lambda opts: seen.append(opts) or {})
    app = typer.Typer()
    app.command()(cmp.compare)
    app.command("other")(lambda: None)
    r = CliRunner().invoke(app, ["compare", *args, "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    return seen


@pytest.mark.parametrize("typed", [["--num-prompts", "8"], ["--steps", "4"],
                                   ["--prompts", "chat"], ["--device", "cpu", "--topk", "1"]])
def test_an_acceptance_flag_typed_at_its_default_still_measures(drafters, target,  # noqa: F811
                                                                monkeypatch, typed):
    """`--num-prompts 8` (the default) without --target was dropped without a word: nothing
    measured, where `--num-prompts 7` measured on the recorded target; with --device it was
    refused as if no acceptance flag were given."""
    seen = _cli(monkeypatch, [str(drafters["A"]), str(drafters["B"]), *typed])
    assert [(o.target, o.recorded) for o in seen] == [(str(target.folder), True)]
    assert _cli(monkeypatch, [str(drafters["A"]), str(drafters["B"])])[0].target is None


@pytest.mark.parametrize("value", ["1,5B", "2,6b", "1,20,000", "12,34"])
def test_a_comma_that_groups_no_thousands_is_refused(value):
    """A decimal comma ("1,5B", as much of Europe writes 1.5B) had its comma dropped: a claim
    of 15B set beside counts near 1.5B, its convention the nearest to a number never meant."""
    from draftsmith.compare import parse_claims
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match=f"--claimed 'A={value}': '{value}': not a number"):
        parse_claims([f"A={value}"])
    assert parse_claims(["A=1,200,000", "B=1,500.5K"]) == {"A": 1.2e6, "B": 1_500_500}
