"""Messages review 1: serve's startup counts read right for 0, 1 and N, and train's
"more data" advice names the command that made the data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from draftsmith.train import TrainConfig
from draftsmith.train.loop import Trainer


def startup(monkeypatch, *args: str) -> str:
    """serve's stderr up to the serving line, the engine, socket and server faked."""
    import draftsmith.serve.app as app_mod
    import draftsmith.serve.cli as serve_cli
    import draftsmith.serve.engine as engine_mod
    import draftsmith.serve.frontends as frontends_mod
    from draftsmith.cli import _register, app

    _register()  # adds each command once
    fake = SimpleNamespace(warmup=lambda kinds: None,
                           warmed_kinds=lambda kinds: tuple(dict.fromkeys(("greedy", *kinds))))
    sock = SimpleNamespace(getsockname=lambda: ("127.0.0.1", 8123), close=lambda: None)
    monkeypatch.setattr(engine_mod, "load_engine", lambda *a, **k: fake)
    monkeypatch.setattr(frontends_mod, "listen", lambda host, port: sock)
    monkeypatch.setattr(serve_cli, "server_config",
                        lambda *a, **k: SimpleNamespace(model_name="tiny"))
    monkeypatch.setattr(app_mod, "run_server", lambda *a, **k: None)
    res = CliRunner().invoke(app, ["serve", "--device", "cpu", *args])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize(("frontends", "said"), [
    ("1", "cpu, float32, 1 HTTP process)"), ("3", "cpu, float32, 3 HTTP processes)"),
    ("0", "cpu, float32)")])
def test_serve_startup_counts_http_processes_in_the_right_number(monkeypatch, frontends, said):
    """`--frontends 1` printed "1 HTTP processes" (and the dtype as "torch.float32")."""
    out = startup(monkeypatch, "--frontends", frontends, "--dtype", "fp32")
    assert said in out and "HTTP processes)" not in out.replace(said, ""), out


@pytest.mark.parametrize(("args", "said"), [
    (["--max-batch", "1", "--warm-sampling", "none"],
     "warming up a batch of 1 row (greedy sampling)"),
    (["--max-batch", "1", "--warm-sampling", "temperature"],
     "warming up batches of 1 row (greedy, temperature sampling)"),
    (["--max-batch", "3", "--warm-sampling", "none"],
     "warming up batches of 1, 2 and 3 rows (greedy sampling)"),
    (["--max-batch", "8"], "warming up batches of 1, 2, 4 and 8 rows (greedy, temperature "
                           "sampling)"),
    (["--max-batch", "4", "--fixed-rows", "--warm-sampling", "none"],
     "warming up a batch of 4 rows (greedy sampling)")])
def test_serve_warmup_line_lists_the_batch_sizes_in_the_right_number(monkeypatch, args, said):
    """--max-batch 1 printed "batches of up to 1 (powers of two) rows", 3 "up to 3 (powers of
    two)" (3 is none), and --fixed-rows 1 "batches of 1 rows"."""
    out = startup(monkeypatch, "--warmup", "--frontends", "0", *args)
    assert said in out and "1 rows" not in out and "powers of two" not in out, out


def advice(data: SimpleNamespace, folder: str | None = "d") -> str:
    """train's message where the draft vocab holds every data token already."""
    cfg = TrainConfig(out="o", data=folder, prompts=None if folder else "p.jsonl")
    me = SimpleNamespace(cfg=cfg, data=data,
                         drafter=SimpleNamespace(cfg=SimpleNamespace(draft_vocab_size=100)))
    msg = Trainer._data_too_small(me)
    assert "\n" not in msg and "train on more data (" in msg, msg
    return msg


def offline(*commands: str) -> SimpleNamespace:
    return SimpleNamespace(online=False, manifest={"commands": list(commands)})


def test_captured_data_is_told_to_capture_more_not_data_make():
    """Data from `data regenerate` + `data capture` was told "a larger `draftsmith data make
    --n`", a command that never made it."""
    msg = advice(offline("draftsmith data capture answers.jsonl --out d"))
    assert "data make" not in msg, msg
    assert "more conversations captured" in msg and "`draftsmith data regenerate`" in msg
    assert "`data regenerate --temperature 0`" in msg


def test_data_make_and_demo_data_name_their_own_command():
    msg = advice(offline("draftsmith data make --out runs/a --n 200"))
    assert "a larger `draftsmith data make --n`" in msg and "data capture" not in msg
    assert "`data make --temperature 0`" in msg
    assert "a larger `draftsmith demo --conversations`" in advice(offline("draftsmith demo"))
    # the last command that made data counts: a data make folder captured again
    later = offline("draftsmith data make --out r --n 5", "draftsmith data capture a.jsonl")
    assert "more conversations captured" in advice(later)


def test_make_json_beside_the_dataset_or_nothing_known(tmp_path: Path):
    (tmp_path / "make.json").write_text("{}")
    unknown = SimpleNamespace(online=False, manifest={})
    assert "a larger `draftsmith data make --n`)" in advice(unknown, str(tmp_path / "dataset"))
    msg = advice(SimpleNamespace(online=False, manifest={"commands": "bad"}),
                 str(tmp_path / "elsewhere" / "dataset"))
    assert "`draftsmith data make --n`, or more conversations through" in msg, msg


def test_online_prompts_are_told_to_add_answered_conversations():
    msg = advice(SimpleNamespace(online=True, manifest=None), None)
    assert "more answered conversations in --prompts" in msg and "data make" not in msg, msg
