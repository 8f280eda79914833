"""Review 6 of `make demo`, read as a new user on a fresh machine: a --target that is no
checkpoint and an --out that cannot be made are one line naming the flag before any stage, the
CPU demo's 256-token rows cut no sample it trains on, and a rerun of set-up says what it reuses."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_setup_script import run_setup

from draftsmith import demo as demo_mod
from draftsmith.errors import DraftsmithError


def run(monkeypatch, tmp_path: Path, **kw) -> None:
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: pytest.fail("a stage ran"))
    args = dict(out=tmp_path / "demo", device="cpu", conversations=None, epochs=None,
                steps=None, target="default") | kw
    demo_mod.demo(**args)


@pytest.mark.parametrize("kind", ["notes.txt", "empty-folder"])
def test_a_target_that_is_no_checkpoint_is_refused_by_flag_before_out_is_made(
        tmp_path, monkeypatch, kind):
    """It was refused by the data stage, after --out was made, in a line naming no flag."""
    target = tmp_path / kind
    target.mkdir() if kind == "empty-folder" else target.write_text("hi")
    with pytest.raises(DraftsmithError, match=f"^--target {target}: .*; give an HF folder, a "
                                              r"\.gguf file or 'default'$"):
        run(monkeypatch, tmp_path, target=str(target))
    assert not (tmp_path / "demo").exists()


def test_an_out_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    out = Path("/proc/draftsmith-no-such/demo")  # not made, even by root
    with pytest.raises(DraftsmithError, match=f"^--out {out}: cannot be made"):
        run(monkeypatch, tmp_path, out=out)


def dataset(folder: Path, lengths: list[int]) -> dict:
    from draftsmith.data.shards import FORMAT, FORMAT_VERSION, MANIFEST

    folder.mkdir(parents=True)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    save_file({"offsets": offsets}, str(folder / "shard-00000.safetensors"))
    shard = {"index": 0, "file": "shard-00000.safetensors", "samples": len(lengths),
             "tokens": sum(lengths), "loss_tokens": 1, "bytes": 1, "sha256": "a" * 64}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version":
                                               FORMAT_VERSION, "shards": [shard]}))
    return {"dir": folder, "summary": {"samples": len(lengths), "tokens": sum(lengths)}}


@pytest.mark.parametrize("longest, trained_len", [(151, 256), (300, 300)])
def test_no_sample_the_cpu_demo_trains_on_is_cut_by_its_rows(tmp_path, monkeypatch, longest,
                                                            trained_len):
    """Rows of 256 tokens cut a longer sample's tail, untrained and unsaid (a target whose
    template adds a long system prompt); the default target's longest, 151, keeps 256."""
    import draftsmith.train as train_mod

    runs = []

    def fake_train(tc) -> None:
        runs.append(tc)
        Path(tc.out).mkdir(parents=True)
        (Path(tc.out) / "draftsmith.json").write_text(json.dumps(
            {"training": {"config": asdict(tc)}}, default=str))

    monkeypatch.setattr(train_mod, "train", fake_train)
    cfg = demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu")
    data = dataset(tmp_path / "demo" / "data" / "dataset", [120, longest, 90])
    demo_mod.train_drafter(cfg, data)
    demo_mod.train_drafter(cfg, data)  # the rerun reuses it
    assert [tc.max_len for tc in runs] == [trained_len]


def test_a_rerun_of_set_up_says_what_it_reuses(tmp_path):
    """It returned silently: `make demo`'s second run showed nothing of set-up at all."""
    python = tmp_path / "bin" / "fakepython"
    calls, r = run_setup(tmp_path, torch="2.5.0", stamp=f"{python}\n", FAKE_READY="1")
    assert calls == []
    assert r.stdout == (f"setup.sh: set-up already done for {python}: nothing installed "
                        "(delete .setup-done to redo it)\n")
