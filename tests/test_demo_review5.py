"""Review 5 of `draftsmith demo`, read as a first-time user of `make demo` reads its report:
a ctrl-C in training is resumed by the rerun, an --out holding something else is refused
before any stage, the deploy rows are whole launch commands, and a slowdown is explained."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from rich.console import Console

from draftsmith import demo as demo_mod
from draftsmith.errors import DraftsmithError


def tiny_cfg(tmp_path: Path) -> demo_mod.DemoConfig:
    target = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=8)
    return replace(demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu"), target=str(target),
                   conversations=6, answer_tokens=16, epochs=1, draft_vocab=64, steps=2,
                   batch_size=16, eval_tokens=8, prompt_tokens=48, train_len=64)


def test_a_ctrl_c_in_training_is_resumed_by_the_rerun(tmp_path, monkeypatch, capsys):
    """A ctrl-C leaves a checkpoint and no drafter; the rerun called train without --resume,
    which refuses a folder holding a run ("pass --resume"), a flag the demo does not have."""
    from draftsmith.train.loop import Trainer

    cfg = tiny_cfg(tmp_path)
    data = demo_mod.make_data(cfg, torch.float32)
    step = Trainer.train_step

    def ctrl_c_at_step_3(self) -> None:
        step(self)
        if self.step == 2:  # counted after this call: the third step is in flight
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        demo_mod.train_drafter(cfg, data)
    monkeypatch.setattr(Trainer, "train_step", step)
    assert not (cfg.out / "drafter" / "draftsmith.json").exists()
    said = capsys.readouterr()
    assert "the same `draftsmith demo` command resumes the training" in said.out + said.err
    demo_mod.train_drafter(cfg, data)
    out = capsys.readouterr()
    assert (cfg.out / "drafter" / "draftsmith.json").is_file()
    assert "stopped at step-00000003: resumed" in out.out + out.err


@pytest.mark.parametrize("held", ["notes.txt", ".git", "model"])
def test_an_out_holding_something_else_is_refused_before_any_stage(tmp_path, monkeypatch,
                                                                    held):
    """`--out ~/project` wrote data/, drafter/ and export-*/ among the user's own files."""
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: pytest.fail("a stage ran"))
    out = tmp_path / "mine"
    out.mkdir()
    (out / held).mkdir() if "." not in held or held.startswith(".") else (out / held).touch()
    with pytest.raises(DraftsmithError, match=f"--out {out}: holds {held}, not a demo's"):
        demo_mod.demo(out=out, device="cpu", conversations=None, epochs=None, steps=None,
                      target="default")


def test_an_out_holding_a_demo_or_its_leftovers_is_taken(tmp_path, monkeypatch):
    """A finished or interrupted demo (an export's tmp folder, kept by a kill) is resumed."""
    ran = []
    monkeypatch.setattr(demo_mod, "run_demo", ran.append)
    monkeypatch.setattr(demo_mod, "show", lambda report: None)
    out = tmp_path / "demo"
    for name in ("data", "drafter", "export-sglang", ".export-sglang.tmp-123"):
        (out / name).mkdir(parents=True)
    for name in ("report.json", "doctor.json"):
        (out / name).write_text("{}")
    demo_mod.demo(out=out, device="cpu", conversations=None, epochs=None, steps=None,
                  target="default")
    assert len(ran) == 1


def test_the_deploy_rows_are_whole_launch_commands_for_each_engine(tmp_path, monkeypatch):
    """The rows read "deploy with speculators: --speculative-config ...": no engine a user
    knows by that name, no command, no target model to serve beside the drafter."""
    from test_drafter import random_drafter

    from draftsmith.models.eagle3 import Eagle3Config, save_drafter
    from draftsmith.targets import load_target

    cfg = replace(tiny_cfg(tmp_path), steps=2)
    t = load_target(cfg.target)
    dcfg = Eagle3Config.for_target(t.cfg, 40, [0, 2, 4], target_fingerprint=t.fingerprint)
    drafter = save_drafter(random_drafter(dcfg), tmp_path / "d", training={"steps": 0})
    exports = demo_mod.export_all(cfg, drafter)
    report = {"target": cfg.target, "data": {}, "doctor": {"exit_code": 0, "findings": 0},
              "artifacts": {}, "exports": exports, "seconds": {},
              "bench": {"device": "cpu", "batch": 1, "steps": 2, "baseline_tok_s": 20.0,
                        "speculative_tok_s": 22.0, "speedup": 1.1, "accept_length": 1.5,
                        "accept_hist": [], "position_acceptance": [0.5, 0.2],
                        "phases_ms": {}, "phases_pct": {}}}
    monkeypatch.setattr(demo_mod, "console", shown := Console(width=80, record=True))
    demo_mod.show(report)
    text = shown.export_text()
    rows = [" ".join(line.split()) for line in text.splitlines()]
    assert "│ serve with vLLM │ the command under this table │" in rows
    sg, vl = cfg.out / "export-sglang", cfg.out / "export-speculators"
    assert (f"\nserve with SGLang: python -m sglang.launch_server --model-path {cfg.target} "
            "--speculative-algorithm EAGLE3 --speculative-num-steps 2 --speculative-eagle-topk "
            f"1 --speculative-num-draft-tokens 3 --speculative-draft-model-path {sg}") in text
    assert (f"\nserve with vLLM: vllm serve {cfg.target} --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{vl}\", \"num_speculative_tokens\": 2}}'\n"
            ) in text  # one line each, whole at 80 columns: to copy into a shell
    assert "deploy with" not in text


def test_a_cpu_slowdown_is_explained_not_left_as_a_bare_figure(monkeypatch):
    """A first `make demo` on a CPU reads 0.70x with nothing saying why, as if it failed."""
    report = {"target": "default", "config": {"conversations": "48", "epochs": "3"},
              "data": {}, "doctor": {"exit_code": 0, "findings": 0}, "artifacts": {},
              "exports": {}, "seconds": {},
              "bench": {"device": "cpu", "batch": 1, "steps": 3, "baseline_tok_s": 16.7,
                        "speculative_tok_s": 11.7, "speedup": 0.70, "accept_length": 1.13,
                        "accept_hist": [], "position_acceptance": [0.1, 0.03, None],
                        "phases_ms": {"verify": 118.2}, "phases_pct": {"verify": 90.0}}}
    monkeypatch.setattr(demo_mod, "console", shown := Console(width=2000, record=True))
    demo_mod.show(report)
    text = " ".join(shown.export_text().split())
    assert ("speculative decoding was slower than plain decoding here (0.70x): each cycle the "
            "drafter guesses 3 tokens and the target checks 4 at once, but it kept only 1.13 "
            "tokens a cycle (plain decoding makes 1), too few to pay for the guessing and the "
            "wider check (checking 4 took 118 ms, 2.0 times one plain step's 60 ms)") in text
    assert "Expected of the CPU demo" in text and "(48 conversations, 3 epochs)" in text
    shown = Console(width=2000, record=True)
    monkeypatch.setattr(demo_mod, "console", shown)
    demo_mod.show({**report, "bench": {**report["bench"], "speedup": 1.2,
                                       "speculative_tok_s": 20.0}})
    assert "slower" not in shown.export_text()


def test_the_doctor_row_says_passed_and_names_its_report(tmp_path, monkeypatch):
    """"doctor: exit 0, 0 findings" left a new user to guess what exit 0 means, and the
    doctor.json the demo writes was in no artifact row."""
    monkeypatch.setattr(demo_mod, "make_data", lambda cfg, dtype: {
        "dir": tmp_path / "data", "summary": {"samples": 6, "tokens": 300}})
    monkeypatch.setattr(demo_mod, "train_drafter", lambda cfg, data: tmp_path / "drafter")
    monkeypatch.setattr(demo_mod, "run_doctor", lambda *a: {"exit_code": 0, "findings": 2})
    monkeypatch.setattr(demo_mod, "benchmark", lambda *a: {
        "device": "cpu", "batch": 1, "steps": 3, "baseline_tok_s": 20.0,
        "speculative_tok_s": 22.0, "speedup": 1.1, "accept_length": 1.5, "accept_hist": [],
        "position_acceptance": [0.5, None, None], "phases_ms": {}, "phases_pct": {}})
    monkeypatch.setattr(demo_mod, "export_all", lambda cfg, d: {})
    report = demo_mod.run_demo(demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu"))
    monkeypatch.setattr(demo_mod, "console", shown := Console(width=300, record=True))
    demo_mod.show(report)
    text = " ".join(shown.export_text().split())
    assert "doctor │ passed (exit 0), 2 findings" in text
    assert f"artifact: doctor report │ {tmp_path / 'demo' / 'doctor.json'}" in text
    demo_mod.show({**report, "doctor": {"exit_code": 1, "findings": 1}})
    assert "FAILED: see its report above (exit 1), 1 findings" in shown.export_text()
