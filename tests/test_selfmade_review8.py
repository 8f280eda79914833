"""Self-made prompts, review 8: an --out named like a text, CSV, Parquet or gzip file was
written as plain JSON Lines all the same, so `data regenerate prompts.txt` answered the
records' JSON text as the questions (or the file could not be read back at all); a ctrl-C in
the first round of a grown run whose last round was cut said the file was not kept (or kept
fewer prompts) while it held them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.errors import DraftsmithError

SMALL = MagpieConfig(n=1, batch_size=4, max_new_tokens=64)


def _scripted(monkeypatch, target, rows: list[str]) -> None:
    """Every round decodes `rows`."""
    from draftsmith.engine import generate

    toks = [target.tokenizer(r, add_special_tokens=False)["input_ids"] for r in rows]

    def run(rt, prompts, max_new_tokens, params, stops, on_step=None):
        return generate.Generation([list(t) for t in toks], 0.0, 0.0)

    monkeypatch.setattr(generate, "run_generation", run)


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl.gz", "p.csv", "p.TSV", "p.parquet"])
def test_an_out_read_back_as_another_format_is_refused(target, model, tmp_path: Path,
                                                       monkeypatch, name: str) -> None:
    _scripted(monkeypatch, target, ["What is two plus two?"] * 4)
    out = tmp_path / name
    with pytest.raises(DraftsmithError) as e:
        self_made_prompts(target, out, SMALL, model, progress=False, log=lambda s: None)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"{out}: ") and ".jsonl" in said
    assert not out.exists()


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "prompts"])
def test_an_out_read_back_as_json_lines_is_written(target, model, tmp_path: Path, monkeypatch,
                                                   name: str) -> None:
    from draftsmith.data.prompts import load_prompts

    _scripted(monkeypatch, target, ["What is two plus two?"] * 4)
    out = tmp_path / name
    assert self_made_prompts(target, out, SMALL, model, progress=False)["kept"] == 1
    assert [c.first_user() for c in load_prompts(out).conversations] == ["What is two plus two?"]


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def test_ctrl_c_after_a_cut_round_tells_the_prompts_the_file_keeps(target, model, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from draftsmith.engine import generate

    # round 0 keeps 2 of its rows, 1 wanted: it is cut, and a grown run makes it again first
    _scripted(monkeypatch, target, ["What is two plus two?", "Why is the sky blue?", "hi", "hi"])
    out = tmp_path / "p.jsonl"
    self_made_prompts(target, out, SMALL, model, progress=False)
    before = out.read_bytes()
    assert [json.loads(x)["meta"].get("cut") for x in before.splitlines()] == [True]
    monkeypatch.setattr(generate, "run_generation", _interrupt)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        self_made_prompts(target, out, MagpieConfig(n=3, batch_size=4, max_new_tokens=64),
                          model, progress=False, log=said.append)
    assert out.read_bytes() == before
    assert said == [f"prompts: stopped (ctrl-C): {out} keeps the 1 prompts made before; a rerun "
                    "of the same command resumes after them"]


def test_a_negative_max_batches_is_refused() -> None:
    with pytest.raises(DraftsmithError, match=r"max_batches \(-1\) must be >= 0"):
        MagpieConfig(n=2, max_batches=-1)
    assert MagpieConfig(n=2, max_batches=0).max_batches == 0
