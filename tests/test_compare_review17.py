"""compare, seventeenth review: a ctrl-C part-way through acceptance kept nothing; now the
static sections and the prompts every drafter finished are written to --out, marked partial
(how many prompts of how many), said on stderr, and the CLI exits 130."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, run_compare


def _stop_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """The target alone raises KeyboardInterrupt at its `call`-th run (the warm-up is the
    first): with three prompts rotating [base, A, B], call 4 is prompt 3's second run."""
    import draftsmith.engine.generate as gen

    real, calls = gen.run_generation, [0]

    def run(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(gen, "run_generation", run)


def _opts(drafters: dict[str, Path], tiny_llama_dir: Path, out: Path) -> CompareOptions:  # noqa: F811
    return CompareOptions([str(drafters["A"]), str(drafters["B"])], target=str(tiny_llama_dir),
                          num_prompts=3, max_new=4, steps=2, out=out)


def test_a_ctrl_c_midway_writes_the_prompts_every_drafter_finished(
        drafters, tiny_llama_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Prompt 3 interrupted after drafter B ran it: prompts 1-2 are written, marked partial."""
    _stop_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        run_compare(_opts(drafters, tiny_llama_dir, tmp_path))
    res = json.loads((tmp_path / "compare.json").read_text())
    speed = res["speed"]
    assert speed["partial"] == {"prompts_finished": 2, "prompts": 3}
    assert speed["prompts"] == 2
    for run in speed["drafters"].values():
        assert len(run["per_prompt_accept_length"]) == 2
        assert sum(run["accept_hist"]) == run["cycles"] == sum(run["per_prompt_cycles"])
    assert [d["label"] for d in res["drafters"]] == ["small", "big"]  # the static sections
    md = (tmp_path / "compare.md").read_text()
    assert "## Acceptance on the same prompts (PARTIAL: 2 of 3 chat prompts" in md
    assert "## Architecture" in md and (tmp_path / "acceptance.png").exists()
    err = capsys.readouterr().err
    assert "compare: interrupted after 2 of 3 prompts" in err


def test_a_ctrl_c_before_any_prompt_finished_still_writes_the_static_sections(
        drafters, tiny_llama_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    _stop_at(monkeypatch, 1)  # the warm-up
    with pytest.raises(KeyboardInterrupt):
        run_compare(_opts(drafters, tiny_llama_dir, tmp_path))
    res = json.loads((tmp_path / "compare.json").read_text())
    assert "speed" not in res and not (tmp_path / "acceptance.png").exists()
    assert any("interrupted" in n and "0 of 3 prompts" in n for n in res["notes"])
    assert "## Architecture" in (tmp_path / "compare.md").read_text()
    assert "compare: interrupted after 0 of 3 prompts" in capsys.readouterr().err


def test_the_cli_exits_130_on_a_ctrl_c_midway(drafters, tiny_llama_dir, tmp_path,  # noqa: F811
                                             monkeypatch):
    import typer
    from typer.testing import CliRunner

    import draftsmith.compare as cmp

    _stop_at(monkeypatch, 4)
    app = typer.Typer()
    app.command()(cmp.compare)
    app.command("other")(lambda: None)
    r = CliRunner().invoke(app, ["compare", str(drafters["A"]), str(drafters["B"]), "--target",
                                 str(tiny_llama_dir), "--num-prompts", "3", "-n", "4",
                                 "--steps", "2", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 130, (r.output, r.exception)
    assert json.loads(r.stdout)["speed"]["partial"] == {"prompts_finished": 2, "prompts": 3}
    assert "compare: interrupted after 2 of 3 prompts: wrote what was complete to" in r.stderr
    assert json.loads((tmp_path / "compare.json").read_text())["speed"]["partial"] == {
        "prompts_finished": 2, "prompts": 3}
