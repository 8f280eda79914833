"""The README's main job end to end, on a tiny target so it fits the default suite."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import write_tiny_folder


def test_demo_runs_every_stage_and_reuses_them(tmp_path, monkeypatch):
    from draftsmith.demo import DemoConfig, run_demo, show

    target = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=8)
    cfg = replace(DemoConfig.for_device(tmp_path / "demo", "cpu"), target=str(target),
                  conversations=6, answer_tokens=16, epochs=1, draft_vocab=64, steps=2,
                  batch_size=16, eval_tokens=8, prompt_tokens=48, train_len=64)
    report = run_demo(cfg)
    from rich.console import Console

    import draftsmith.demo as demo_mod

    monkeypatch.setattr(demo_mod, "console", wide := Console(width=400, record=True))
    show(report | {"artifacts": {**report["artifacts"], "data": "runs/exp[v2]/data"}})
    assert "runs/exp[v2]/data" in wide.export_text()  # a path, not rich markup
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["doctor"]["exit_code"] == 0  # the data and the drafter agree
    bench = saved["bench"]
    assert bench["baseline_tok_s"] > 0 and bench["speculative_tok_s"] > 0
    assert bench["accept_length"] >= 1 and len(bench["position_acceptance"]) == 2
    assert set(bench["phases_ms"]) == {"draft", "verify", "accept", "extend"}
    for fmt in ("sglang", "speculators"):
        assert (tmp_path / "demo" / f"export-{fmt}" / "config.json").is_file()
    meta = json.loads((tmp_path / "demo" / "drafter" / "draftsmith.json").read_text())
    assert meta["training"]["config"]["vocab"].endswith("dataset/vocab.safetensors")  # data's
    stamp = (tmp_path / "demo" / "drafter" / "draftsmith.json").stat().st_mtime_ns
    again = run_demo(cfg)  # a rerun reuses the data and the trained drafter
    assert again["seconds"]["train"] < 5 and again["data"] == report["data"]
    assert (tmp_path / "demo" / "drafter" / "draftsmith.json").stat().st_mtime_ns == stamp


def test_demo_phases_are_means_over_cycles_not_over_prompts():
    """A 10-cycle prompt at 4 ms a verify and a 90-cycle one at 2 ms: 2.2 ms a cycle."""
    from draftsmith.demo import DemoConfig, summarize
    from draftsmith.engine.profiler import PhaseSummary
    from draftsmith.engine.spec_state import SpecResult

    def run(cycles: int, verify: float) -> SpecResult:
        ms = {"draft": 1.0, "verify": verify}
        r = SpecResult([[1] * cycles], 0.1, 1.0, cycles, 2, [0, cycles, 0, 0], [cycles, 0],
                       [0, 0])
        r.phases = PhaseSummary(cycles, ms, {}, sum(ms.values()))
        return r

    runs = [run(10, 4.0), run(90, 2.0)]
    out = summarize(DemoConfig.for_device(Path("unused"), "cpu"), 100.0, runs, runs)
    assert out["phases_ms"]["verify"] == pytest.approx(2.2)
    assert out["phases_pct"]["verify"] == pytest.approx(100 * 2.2 / 3.2)


@pytest.mark.parametrize("flag, value, message", [
    ("conversations", 0, "--conversations must be >= 1, got 0"),
    ("epochs", 0, "--epochs must be >= 1, got 0"),
    ("steps", -1, "--steps must be >= 1, got -1"),
    ("device", "gpu", "--device gpu: use cpu, cuda, cuda:N or auto"),
    ("out", "a-file", "is a file, not a folder"),
    ("out", "a-file/demo", "lies under the file"),
])
def test_demo_refuses_a_bad_option_before_any_work(tmp_path, monkeypatch, flag, value, message):
    """One line naming the flag, not a traceback (--device, --out) nor one naming another
    stage's flag (--n) after minutes of data making (--epochs and --steps were found late)."""
    from draftsmith import demo as demo_mod
    from draftsmith.errors import DraftsmithError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(demo_mod, "run_demo", lambda cfg: pytest.fail(f"ran with {cfg}"))
    args = dict(out=Path("runs/demo"), device="cpu", conversations=None, epochs=None,
                steps=None, target="default")
    args[flag] = Path(value) if flag == "out" else value
    with pytest.raises(DraftsmithError, match=message):
        demo_mod.demo(**args)


def test_a_rerun_with_other_epochs_or_more_data_trains_again(tmp_path, monkeypatch, capsys):
    """A kept drafter was reused whatever the rerun asked: `--epochs 2` (or more conversations,
    which grow the data) reported the new settings over a drafter of the old ones."""
    from dataclasses import asdict

    import draftsmith.train as train_mod
    from draftsmith.demo import DemoConfig, train_drafter

    runs = []

    def fake_train(tc) -> Path:
        runs.append(tc)
        out = Path(tc.out)
        out.mkdir(parents=True)
        (out / "draftsmith.json").write_text(json.dumps(
            {"training": {"config": asdict(tc)}}, default=str))
        return out

    monkeypatch.setattr(train_mod, "train", fake_train)
    cfg = DemoConfig.for_device(tmp_path / "demo", "cpu")
    data = {"dir": tmp_path / "demo" / "data" / "dataset", "summary": {"samples": 6,
                                                                     "tokens": 330}}
    _manifest(data["dir"], "a" * 64)
    train_drafter(cfg, data)
    train_drafter(cfg, data)
    assert len(runs) == 1 and "trained drafter found, reused" in capsys.readouterr().out
    train_drafter(replace(cfg, epochs=cfg.epochs + 1), data)
    assert len(runs) == 2 and runs[-1].epochs == cfg.epochs + 1
    assert "trained with other epochs: trained again" in capsys.readouterr().out
    train_drafter(replace(cfg, epochs=cfg.epochs + 1), {**data, "summary": {"samples": 10,
                                                                           "tokens": 558}})
    assert len(runs) == 3 and "trained with other data" in capsys.readouterr().out
    # captured again (another device or dtype): the same counts, other shards
    train_drafter(replace(cfg, epochs=cfg.epochs + 1), {**data, "summary": {"samples": 10,
                                                                           "tokens": 558}})
    assert len(runs) == 3
    _manifest(data["dir"], "b" * 64)
    train_drafter(replace(cfg, epochs=cfg.epochs + 1), {**data, "summary": {"samples": 10,
                                                                           "tokens": 558}})
    assert len(runs) == 4 and "trained with other data" in capsys.readouterr().out


def _manifest(folder: Path, sha: str) -> None:
    from draftsmith.data.shards import FORMAT, FORMAT_VERSION, MANIFEST

    folder.mkdir(parents=True, exist_ok=True)
    shard = {"index": 0, "file": "shard-00000.safetensors", "samples": 10, "tokens": 558,
             "loss_tokens": 300, "bytes": 1, "sha256": sha}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version":
                                               FORMAT_VERSION, "shards": [shard]}))


def test_the_timed_runs_are_not_profiled_under_the_environment_switch(tmp_path, monkeypatch):
    """DRAFTSMITH_PROFILE=1 profiled the timed speculative runs too (a sync a cycle on a GPU),
    though the report says the phases come from separate runs; and a draft position no cycle
    reached read as a measured 0.00."""
    import torch

    from draftsmith import demo as demo_mod
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    target = write_tiny_folder(tmp_path / "t", "llama")
    t = load_target(str(target))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.for_target(t.cfg, t.cfg.vocab_size, [0, 2, 4]))
    folder = save_drafter(drafter, tmp_path / "drafter")
    seen, summarize = {}, demo_mod.summarize
    monkeypatch.setattr(demo_mod, "summarize",
                        lambda cfg, base, runs, profiled: seen.update(runs=runs, prof=profiled))
    monkeypatch.setenv("DRAFTSMITH_PROFILE", "1")
    cfg = replace(demo_mod.DemoConfig.for_device(tmp_path / "demo", "cpu"), target=str(target),
                  eval_tokens=4, steps=2)
    said: list[str] = []
    monkeypatch.setattr(demo_mod.console, "print", lambda *a, **k: said.append(str(a[0])))
    demo_mod.benchmark(cfg, folder, torch.float32)
    n = 2 * len(demo_mod.EVAL_PROMPTS)  # its progress said (it printed nothing for minutes)
    assert any(line.startswith(f"bench: {n}/{n} runs") for line in said), said
    assert all(r.phases is None for r in seen["runs"])
    assert all(r.phases is not None for r in seen["prof"])
    out = summarize(cfg, 1.0, seen["runs"], seen["prof"])
    reached = [sum(x) for x in zip(*(r.reached for r in seen["runs"]), strict=True)]
    assert [p is None for p in out["position_acceptance"]] == [n == 0 for n in reached]
