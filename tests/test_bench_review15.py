"""`draftsmith bench`, fifteenth review: a drafter for another target's sizes and a batch wider
than its suite refused before the target's weights load, a suite of malformed records named as
such, and the report saying in what order its runs were timed."""

from __future__ import annotations

import json

import pytest
from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)

import draftsmith.targets
from draftsmith.errors import DraftsmithError

ARGS = ("--max-new-tokens", "2", "--steps", "1", "--device", "cpu")


@pytest.fixture
def never_loaded(monkeypatch):
    """load_target reads every weight of the target (minutes for an 8B): a refusal after it
    came that much too late."""
    def load(*_a, **_k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(draftsmith.targets, "load_target", load)


def one_line_error(res, *parts: str) -> str:
    said = str(res.exception)
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "\n" not in said and all(p in said for p in parts), said
    return said


def test_a_drafter_for_another_targets_sizes_is_refused_before_the_target_loads(
        drafter_dir, tmp_path, never_loaded):  # noqa: F811
    from conftest import write_tiny_folder

    wider = write_tiny_folder(tmp_path / "wider", hidden_size=96)
    res = invoke("--target", str(wider), "--drafter", str(drafter_dir), "--num-prompts", "1",
                 *ARGS, "--out", str(tmp_path / "out"))
    one_line_error(res, "hidden 64", "hidden 96")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, said", [
    ("{not json\n", "1 record could not be read"),
    ('{"foo": 1}\n[1, 2]\n', "2 records could not be read"),
    ("", "it holds no record"),
])
def test_a_suite_with_no_usable_record_says_why(drafter_dir, tmp_path, never_loaded,  # noqa: F811
                                               text, said):
    """Every record malformed read "no prompt with a user turn", as if the file held only
    system turns, and the records' problems were never shown."""
    (suite := tmp_path / "s.jsonl").write_text(text)
    res = invoke("--target", "t", "--drafter", str(drafter_dir), "--suite", str(suite), *ARGS,
                 "--out", str(tmp_path / "out"))
    line = one_line_error(res, "no prompt with a user turn", said)
    if text.startswith("{not"):
        assert "not valid JSON" in line  # the first record's problem, as the reader put it


def test_the_report_says_in_what_order_its_runs_were_timed(tiny_llama_dir,
                                                           drafter_dir, tmp_path):  # noqa: F811
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir),
                 "--num-prompts", "1", *ARGS, "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "o" / "bench.json").read_text())["meta"]
    assert "baseline first" in meta["timing"] and "once" in meta["timing"]
    assert "timed in this order" in res.output
