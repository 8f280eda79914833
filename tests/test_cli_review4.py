"""Command-line review, fourth pass: what a new user types first (suite names, help texts)."""

from __future__ import annotations

import pytest

from draftsmith.bench.suites import suite_messages
from draftsmith.errors import DraftsmithError


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_bare_chat_suite_refused_beside_a_file_named_chat(monkeypatch, tmp_path, kind):
    """`--suite chat` read the built-in suite silently where ./chat (the user's prompts) is."""
    monkeypatch.chdir(tmp_path)
    if kind == "file":
        (tmp_path / "chat").write_text('{"prompt": "hello"}\n')
    else:
        (tmp_path / "chat").mkdir()
    with pytest.raises(DraftsmithError) as e:
        suite_messages("chat", 0)
    msg = str(e.value)
    assert "built-in chat suite" in msg and f"{kind} chat" in msg
    assert str(tmp_path / "chat") in msg and "\n" not in msg
    if kind == "file":  # the file is still read by a path that is not the bare name
        assert len(suite_messages("./chat", 0)) == 1


def test_bare_chat_suite_read_where_no_file_of_that_name(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert len(suite_messages("chat", 3)) == 3


def _root():
    import typer

    from draftsmith import cli

    cli._register()
    return typer.main.get_command(cli.app)


def test_top_level_help_says_what_draftsmith_does():
    """`draftsmith --help` opened with "a thin layer over the stage functions": nothing a new
    user can act on; and `targets` read "Inspect targets."."""
    root = _root()
    assert "EAGLE-3" in root.help and "thin layer" not in root.help
    assert "fingerprint" in root.commands["targets"].help


def test_bench_help_says_drafter_is_required():
    """bench's --drafter showed no default and no word that the run refuses to start without."""
    bench = _root().commands["bench"]
    drafter = next(p for p in bench.params if "--drafter" in p.opts)
    assert "required" in drafter.help


def test_demo_refuses_too_deep_steps_before_any_stage(monkeypatch, tmp_path):
    """`demo --steps 65` ran the data, training, doctor and bench stages (minutes) and then
    failed at the export's deploy flags, whose setting takes at most 64 steps."""
    from draftsmith import demo

    monkeypatch.setattr(demo, "run_demo", lambda cfg: pytest.fail("a stage ran"))
    with pytest.raises(DraftsmithError, match=r"--steps must be at most 64, got 65"):
        demo.demo(out=tmp_path / "d", device="cpu", conversations=None, epochs=None, steps=65,
                  target="default")


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _readme_row(start: str) -> str:
    rows = [r for r in (ROOT / "README.md").read_text().splitlines() if r.startswith(start)]
    assert len(rows) == 1, start
    return rows[0]


def test_readme_demo_gpu_row_quotes_the_newest_run():
    """The README's GPU demo row quoted 2026-11-29's 357 s and 1.29x; demo_gpu.md's newest
    entry (an H200, 280 s, 1.11x) was left out, so a reader expected a faster demo."""
    import re

    newest = (ROOT / "benchmarks/demo_gpu.md").read_text().split("\n## ")[1]
    wall = re.search(r"Wall time \*\*(\d+) s\*\*", newest).group(1)
    speedup = re.search(r"\(\*\*(\d\.\d+x)\*\*\)", newest).group(1)
    row = _readme_row("| `draftsmith demo` on")
    assert f"{wall} s" in row and speedup in row
    assert row.index(f"{wall} s") < row.index("357 s")  # the newest first


def test_readme_short_target_aux_ids_match_the_code():
    """The README said a shallow target takes [0, L//2-1, L-2] with repeats dropped (fewer than
    three ids on 2-3 layers); the code gives [-1, 0, 1] there and refuses one layer."""
    from draftsmith.layers import default_aux_layers

    text = " ".join((ROOT / "README.md").read_text().split())
    assert "repeats dropped" not in text
    assert default_aux_layers(3) == [-1, 0, 1] and "2-3 layers `[-1, 0, 1]`" in text
    assert default_aux_layers(6) == [0, 2, 4] and "4-6 layers" in text
