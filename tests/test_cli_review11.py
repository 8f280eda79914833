"""The help a user reads of today's flags (bench --repeats, bench's --out, demo's --out) and of
the flags commands share: said alike, and saying what the command does with them."""

from __future__ import annotations

import pytest
from test_cli_review import _commands, run_main

from draftsmith.errors import DraftsmithError

# flags several commands take, each described in prose ("Folder for ...", "With --temperature:
# ...") rather than by a list of values, and so by a sentence on every command
PROSE = ("--out", "--seed", "--steps", "--num-draft-tokens", "--max-new-tokens", "--num-prompts",
         "--top-p", "--top-k", "--batch-size", "--refill", "--refill-every", "--repeats",
         "--profile")


def _help(command: str, flag: str) -> str:
    cmd = dict(_commands())[f"draftsmith {command}"]
    return next(p.help for p in cmd.params if flag in p.opts)


def test_shared_flags_read_as_sentences_on_every_command():
    """bench alone wrote them lowercase (`folder for bench.json/.png`, `new tokens per prompt`)
    where generate, tune, serve and compare write `Folder for ...`, `New tokens per prompt`."""
    odd = [f"{name} {p.opts[0]}: {p.help[:30]}" for name, cmd in _commands() for p in cmd.params
           if p.param_type_name == "option" and set(p.opts) & set(PROSE) and p.help
           and not p.help[0].isupper()]
    assert not odd


def test_bench_lists_read_like_the_single_values_of_serve():
    """bench's --steps said `draft steps, e.g. 1,3,5` (per what?), its --topk not that a tree is
    EAGLE-2's, and its --num-draft-tokens not that a tree needs it (bench refuses a tree
    without it) as serve's and generate's say."""
    steps, topk, tokens = (_help("bench", f) for f in ("--steps", "--topk", "--num-draft-tokens"))
    assert "per cycle" in steps and "comma-separated" in steps
    assert "EAGLE-2 tree" in topk and "Comma-separated" in topk
    assert "per cycle" in tokens and "a tree needs" in tokens
    assert "comma-separated" in _help("bench", "--batch-size")


def test_bench_repeats_help_says_rotation_and_what_the_table_shows():
    said = _help("bench", "--repeats")
    assert "rotated" in said and "median" in said and "range" in said


def test_tune_drafter_help_reads_as_generates_and_serves():
    assert _help("tune", "--drafter").startswith("A draftsmith drafter folder")


def test_demo_out_help_says_what_the_folder_may_hold(tmp_path):
    """demo refuses an --out holding files it does not write (its stages replace their
    folders); the help said only `Folder for every artifact`."""
    from draftsmith.demo import check_demo_folder

    assert "an earlier demo's" in _help("demo", "--out")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="an earlier demo's"):
        check_demo_folder(tmp_path)


@pytest.mark.parametrize(("value", "says"), [
    ("0", "--repeats must be >= 1, got 0"),
    ("-1", "--repeats must be >= 1, got -1"),
    ("1.5", "Invalid value for '--repeats'"),
    ("abc", "Invalid value for '--repeats'"),
])
def test_bench_refuses_bad_repeats_by_name_before_loading(monkeypatch, capsys, tmp_path, value,
                                                          says):
    import draftsmith.bench.run as run
    import draftsmith.models.eagle3 as eagle3

    monkeypatch.setattr(run, "run_bench", lambda *a, **k: pytest.fail("bench ran"))
    monkeypatch.setattr(eagle3, "check_drafter", lambda *a: pytest.fail("drafter read"))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "bench", "--drafter", "d", "--device", "cpu",
                              "--repeats", value)
    assert code == 2 and says in err and not out
    assert not (tmp_path / "runs").exists()
