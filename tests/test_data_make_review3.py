"""`data make --base-url` with credentials in the URL: the run uses them, the folder it writes
(make.json's server and commands, the answers, the dataset's manifest) and its output do not
hold them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from test_data_make_review2 import all_bytes, common, engine, live, make, tiny_dir  # noqa: E402

__all__ = ["engine", "tiny_dir"]  # fixtures


def test_url_credentials_are_never_written(engine, tiny_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with live(engine, str(tiny_dir)) as s:
        url = s["url"].replace("http://", "http://u:s3cret@")
        out = tmp_path / "d"
        r = make(out, *common(tiny_dir), "--base-url", url, "--concurrency", "2",
                 monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    assert b"s3cret" not in all_bytes(out) and "s3cret" not in r.output
    made = json.loads((out / "make.json").read_text())
    shown = s["url"].replace("http://", "http://u:***@")
    assert made["server"]["base_url"] == shown
    assert f"--base-url '{shown}'" in made["commands"][0], made["commands"]


def test_a_base_url_without_its_scheme_is_refused_before_the_target_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import draftsmith.targets as targets

    def no_load(*a, **k):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(targets, "load_target", no_load)
    r = make(tmp_path / "d", "--n", "2", "--base-url", "localhost:8000/v1")
    assert "--base-url 'localhost:8000/v1' is not an http:// or https:// URL" in \
        str(r.exception), r.output
    assert not (tmp_path / "d").exists()
