"""The command-line surface as a whole: one spelling per concept, help on every option, bad
input refused as one line before any work, output printed once."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import typer

from draftsmith.cli import _register, app, main


def _commands():
    """(name, click command) of every leaf command."""
    _register()

    def walk(cmd, name):
        subs = getattr(cmd, "commands", None)
        if subs:
            for n, c in subs.items():
                yield from walk(c, f"{name} {n}")
        else:
            yield name, cmd

    return list(walk(typer.main.get_command(app), "draftsmith"))


def _flags(cmd) -> dict[str, set[str]]:
    """Each option's names, keyed by each of them."""
    out = {}
    for p in cmd.params:
        names = set(p.opts) | set(p.secondary_opts)
        for n in names:
            out[n] = names
    return out


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`draftsmith ARGS` through the real entry point: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["draftsmith", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    got = capsys.readouterr()
    return code, got.out, got.err


def test_one_spelling_per_concept_on_every_command():
    flags = {name: _flags(cmd) for name, cmd in _commands()}
    for name, f in flags.items():
        opts = Counter(n for p in dict(_commands())[name].params for n in (*p.opts,
                                                                           *p.secondary_opts))
        assert not [n for n, c in opts.items() if c > 1], name
        if "--out" in f:
            assert "-o" in f["--out"], name
        if "--max-new-tokens" in f and name != "draftsmith data make":  # there -n reads as --n
            assert "-n" in f["--max-new-tokens"], name
    for name in ("bench", "tune", "tune-nccl"):  # lists of batch sizes, either spelling
        assert {"--batch-size", "--batch-sizes"} <= flags[f"draftsmith {name}"]["--batch-size"]
    for name in ("bench", "compare", "doctor"):
        assert "--num-prompts" in flags[f"draftsmith {name}"], name
    assert "--suite" in flags["draftsmith compare"]["--prompts"]
    assert "--vocab-size" in flags["draftsmith data vocab"]["--size"]


def test_every_option_says_what_it_does():
    missing = [f"{name} {p.opts[0]}" for name, cmd in _commands() for p in cmd.params
               if p.param_type_name == "option" and not p.help]
    assert not missing


def test_a_bad_device_is_one_error_before_tune_nccl_spawns_anything(monkeypatch, capsys,
                                                                     tmp_path):
    """It was handed unread to every setting's processes: each failed, and the command wrote a
    report of failures and exited 0."""
    from draftsmith.tune import nccl

    ran = []
    monkeypatch.setattr(nccl, "run_nccl_sweep", lambda *a, **k: ran.append(a) or {})
    monkeypatch.setattr(nccl, "print_report", lambda *a, **k: None)
    code, out, err = run_main(monkeypatch, capsys, "tune-nccl", "--device", "gpu0",
                              "--out", str(tmp_path / "n"))
    assert (code, ran) == (2, [])
    assert err.strip().splitlines() == [
        "draftsmith: error: --device gpu0: use cpu, cuda, cuda:N or auto"]


def test_aliases_reach_the_same_option(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "compare", "a", "b", "--suite", "humaneval")
    assert (code, err.strip()) == (2, "draftsmith: error: --prompts set how acceptance is "
                                      "measured, which needs --target: give one, or leave them "
                                      "out")
    code, _, err = run_main(monkeypatch, capsys, "bench", "--drafter", "random", "--device",
                            "cpu", "--batch-sizes", "0", "-o", str(tmp_path / "b"))
    assert (code, err.strip()) == (2, "draftsmith: error: --batch-size must be whole numbers "
                                      ">= 1, got 0")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_generate_under_torchrun_prints_once(monkeypatch, capsys, tiny_llama_dir, rank):
    """Under torchrun every rank returns its own result: each printed every completion."""
    from draftsmith import dist
    from draftsmith.models.parallel import TP

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(dist, "launch_tp", lambda fn, size, *a, device: fn(TP(device=device), *a))
    code, out, err = run_main(monkeypatch, capsys, "generate", "-p", "hi", "--target",
                              str(tiny_llama_dir), "--device", "cpu", "-n", "2", "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == (1 if rank == "0" else 0)
    assert all(json.loads(x)["tokens"] == 2 for x in lines)
