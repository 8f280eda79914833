"""Review 8 of `draftsmith demo`, read as a new user running `make demo` twice or after a
ctrl-C: a first demo killed before its data stage wrote data/make.json (during the prompts
stage) leaves self-made prompts of its device's settings; a rerun on another kind of device is
refused by the demo's one line, not by the data stage's "prompts made otherwise"."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from test_doctor_review23 import _demo as cpu_demo

from draftsmith import demo as demo_mod
from draftsmith.data import selfmade
from draftsmith.errors import DraftsmithError


def killed_in_prompts(monkeypatch, cfg: demo_mod.DemoConfig) -> None:
    """The data stage stopped (ctrl-C) once its prompts were written, before make.json was."""
    real = selfmade.self_made_prompts

    def then_stop(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(selfmade, "self_made_prompts", then_stop)
    with pytest.raises(KeyboardInterrupt):
        demo_mod.make_data(cfg, torch.float32)
    monkeypatch.setattr(selfmade, "self_made_prompts", real)


def test_a_gpu_demo_killed_before_make_json_is_refused_by_the_demos_line(tmp_path, monkeypatch):
    tiny = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=4)
    out = tmp_path / "demo"
    # the GPU demo's prompt settings; its bfloat16 recorded as the GPU demo records it
    gpu = replace(demo_mod.DemoConfig.for_device(out, "cuda"), device="cpu", target=str(tiny),
                  conversations=3, answer_tokens=8)
    monkeypatch.setattr(selfmade, "dtype_name", lambda dtype: "bfloat16")
    killed_in_prompts(monkeypatch, gpu)
    monkeypatch.undo()
    assert (out / "data" / "prompts.jsonl").is_file()
    assert not (out / "data" / "make.json").exists()
    said = (f"--out {out}: holds a demo run made on cuda (bfloat16), and a demo on cpu makes "
            "its data otherwise; pass another --out, or delete it to start again")
    with pytest.raises(DraftsmithError, match=f"^{re.escape(said)}$"):
        cpu_demo(monkeypatch, out, str(tiny))


def test_a_cpu_demo_killed_before_make_json_resumes_on_the_cpu(tmp_path, monkeypatch):
    tiny = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=4)
    out = tmp_path / "demo"
    cpu = replace(demo_mod.DemoConfig.for_device(out, "cpu"), target=str(tiny), conversations=3,
                  answer_tokens=8)
    killed_in_prompts(monkeypatch, cpu)
    assert not (out / "data" / "make.json").exists()
    assert len(cpu_demo(monkeypatch, out, str(tiny))) == 1


# ---- a stopped training: what the demo's line says the rerun does --------------------------

def stopped_training(monkeypatch, tmp_path: Path, stop: BaseException, checkpoint: bool):
    """train_drafter whose trainer stops as `stop`, a checkpoint written first or not."""
    import draftsmith.train as train_mod
    from draftsmith.train.checkpoint import STATE, checkpoint_dir

    cfg = replace(demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu"), target="t")
    data = {"dir": cfg.out / "data" / "dataset", "summary": {}}

    def train(tc) -> None:
        if checkpoint:
            (checkpoint_dir(Path(tc.out), 3)).mkdir(parents=True)
            (checkpoint_dir(Path(tc.out), 3) / STATE).write_bytes(b"")
        raise stop

    monkeypatch.setattr(train_mod, "train", train)
    monkeypatch.setattr(demo_mod, "row_len", lambda cfg, dataset: 256)
    monkeypatch.setattr(demo_mod, "data_identity", lambda data: {})
    with pytest.raises(type(stop)):
        demo_mod.train_drafter(cfg, data)


def test_a_sigterm_in_training_names_the_demo_not_a_resume_flag(tmp_path, monkeypatch,
                                                                capsys):
    """The trainer's line says "the same command with --resume continues", and `draftsmith
    demo` has no --resume: a ctrl-C had the demo's own line after it, a SIGTERM none."""
    from draftsmith.train.loop import Terminated

    stopped_training(monkeypatch, tmp_path, Terminated(), checkpoint=True)
    said = " ".join(capsys.readouterr().out.split())  # as one line, the console's wrap undone
    assert ("the same `draftsmith demo` command resumes the training from its last checkpoint "
            "(no --resume needed)") in said


def test_a_ctrl_c_before_any_checkpoint_says_the_rerun_starts_over(tmp_path, monkeypatch,
                                                                   capsys):
    """A ctrl-C while the trainer prepared (its shards' sha256, the target's load) leaves no
    checkpoint: the line said the rerun resumes from one."""
    stopped_training(monkeypatch, tmp_path, KeyboardInterrupt(), checkpoint=False)
    said = " ".join(capsys.readouterr().out.split())
    assert "resumes" not in said
    assert ("no checkpoint was written yet: the same `draftsmith demo` command starts the "
            "training over") in said


def test_a_demo_killed_before_make_json_then_another_target_is_refused_by_flag(tmp_path,
                                                                              monkeypatch):
    """`make demo` stopped in its prompts stage, then `draftsmith demo --target PATH` into the
    same --out: the data stage refused with "prompts.jsonl holds self-made prompts made
    otherwise (target '669d...' there, ...)", no demo flag named."""
    first = write_tiny_folder(tmp_path / "a", "llama", num_hidden_layers=4)
    other = write_tiny_folder(tmp_path / "b", "llama", num_hidden_layers=4, seed=1)
    out = tmp_path / "demo"
    cpu = replace(demo_mod.DemoConfig.for_device(out, "cpu"), target=str(first), conversations=3,
                  answer_tokens=8)
    killed_in_prompts(monkeypatch, cpu)
    said = (f"--out {out}: holds the demo of another target (its prompts were made by a target "
            f"of fingerprint {fingerprint_of(out)}); pass another --out for --target {other}, or "
            f"delete {out} to start again")
    with pytest.raises(DraftsmithError, match=f"^{re.escape(said)}$"):
        cpu_demo(monkeypatch, out, str(other))


def fingerprint_of(out: Path) -> str:
    import json

    with (out / "data" / "prompts.jsonl").open() as f:
        return json.loads(f.readline())["meta"]["target"]
