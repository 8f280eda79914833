"""Review 4 of `draftsmith demo`: its report says when the benchmark ran on a busy machine (a
2-core user read 0.35x with other work running, 0.71x on a quiet rerun), and the baseline no
longer meets every prompt's first prefill cold while the speculative runs meet none."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from draftsmith import demo as demo_mod
from draftsmith.bench import load
from draftsmith.bench.load import Mark

BENCH = {"device": "cpu", "batch": 1, "steps": 3, "baseline_tok_s": 20.0,
         "speculative_tok_s": 7.0, "speedup": 0.35, "accept_length": 1.5,
         "accept_hist": [0, 1, 1], "position_acceptance": [0.5, None, None],
         "phases_ms": {}, "phases_pct": {}}


def fake_benchmark(*_a) -> dict:
    with load.timed():  # the timed runs
        return dict(BENCH)


def fake_stages(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo_mod, "make_data", lambda cfg, dtype: {
        "dir": tmp_path / "data", "summary": {"samples": 6, "tokens": 300}})
    monkeypatch.setattr(demo_mod, "train_drafter", lambda cfg, data: tmp_path / "drafter")
    monkeypatch.setattr(demo_mod, "run_doctor", lambda *a: {"exit_code": 0, "findings": 0})
    monkeypatch.setattr(demo_mod, "benchmark", fake_benchmark)
    monkeypatch.setattr(demo_mod, "export_all", lambda cfg, d: {})


def test_the_report_says_the_benchmark_ran_on_a_busy_machine(tmp_path, monkeypatch):
    fake_stages(monkeypatch, tmp_path)
    monkeypatch.setattr(load, "cores", lambda: 2)
    marks = iter([Mark(0.0, 0.0, 3.0, 100.0), Mark(10.0, 9.0, 3.2, 121.0)])  # others: 1.2
    monkeypatch.setattr(load, "mark", lambda: next(marks))
    cfg = demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu")
    report = demo_mod.run_demo(cfg)
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["bench"]["machine_load"] == {
        "cores": 2, "load_before": 3.0, "load_after": 3.2, "own_cores": 0.9,
        "other_cores": 1.2, "busy": True}
    monkeypatch.setattr(demo_mod, "console", shown := Console(width=300, record=True))
    demo_mod.show(report)
    text = shown.export_text()
    assert "BUSY: other work on 1.2 of 2 cores" in text
    assert ("timings taken while the machine was busy (load 3.2 on 2 cores, other work on 1.2 "
            "of them): rerun on a quiet machine") in text


def test_a_quiet_machine_is_said_so_and_an_old_report_still_shows(tmp_path, monkeypatch):
    report = {"target": "default", "data": {}, "doctor": {"exit_code": 0, "findings": 0},
              "artifacts": {}, "exports": {}, "seconds": {},
              "bench": {**BENCH, "machine_load": {"cores": 2, "load_before": 2.0,
                                                  "load_after": 2.1, "own_cores": 1.9,
                                                  "other_cores": 0.1, "busy": False}}}
    monkeypatch.setattr(demo_mod, "console", shown := Console(width=300, record=True))
    demo_mod.show(report)
    text = shown.export_text()
    assert "other work on 0.1 of 2 cores" in text and "busy" not in text.lower()
    demo_mod.show({**report, "bench": BENCH})  # a report.json from before the figure
    assert "machine while timing" in shown.export_text()


def test_every_prompt_is_warmed_before_the_baseline_is_timed(tiny_llama_dir, tmp_path,
                                                            monkeypatch):
    """Only the first prompt was warmed: the baseline, timed first, met each other prompt's
    first (cold) prefill and the speculative run after it on the same prompt met none."""
    import draftsmith.engine.generate as gen
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    t = load_target(str(tiny_llama_dir))
    torch.manual_seed(0)
    folder = save_drafter(Eagle3Drafter(Eagle3Config.for_target(t.cfg, t.cfg.vocab_size,
                                                                [0, 2, 4])), tmp_path / "d")
    calls: list[tuple[str, tuple[int, ...], int]] = []
    run_generation, generate = gen.run_generation, SpecDecoder.generate

    def base(rt, prompts, n, *a, **k):
        calls.append(("base", tuple(prompts[0]), n))
        return run_generation(rt, prompts, n, *a, **k)

    def spec(dec, prompts, n, *a, **k):
        calls.append(("spec", tuple(prompts[0]), n))
        return generate(dec, prompts, n, *a, **k)

    monkeypatch.setattr(gen, "run_generation", base)
    monkeypatch.setattr(SpecDecoder, "generate", spec)
    monkeypatch.setattr(demo_mod.console, "print", lambda *a, **k: None)
    monkeypatch.setattr(demo_mod, "EVAL_PROMPTS", demo_mod.EVAL_PROMPTS[:3])
    cfg = replace(demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu"),
                  target=str(tiny_llama_dir), eval_tokens=3, steps=1)
    with load.watching() as machine:
        demo_mod.benchmark(cfg, folder, torch.float32)
    assert machine.spans == 2 * 3  # the timed runs and the profiled ones, no warm-up
    timed = [i for i, c in enumerate(calls) if c[2] == cfg.eval_tokens]
    warmed = {(kind, p) for kind, p, n in calls[:timed[0]]}
    prompts = {p for _, p, _ in calls}
    assert len(prompts) == len(demo_mod.EVAL_PROMPTS)
    assert warmed == {(kind, p) for kind in ("base", "spec") for p in prompts}
