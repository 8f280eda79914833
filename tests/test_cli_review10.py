"""Command-line review, tenth pass: help texts that say what the option really does."""

from __future__ import annotations

import pytest
from test_cli_review import run_main
from test_cli_review2 import error_of
from test_cli_review4 import _root

from draftsmith.errors import DraftsmithError


def _param(command: str, flag: str):
    """The click parameter of `draftsmith COMMAND` spelled `flag`."""
    cmd = _root()
    for name in command.split():
        cmd = cmd.commands[name]
    return next(p for p in cmd.params if flag in p.opts)


def test_allreduce_dtype_defaults_to_the_auto_its_help_describes(monkeypatch, capsys):
    """The help read "auto (bfloat16 on GPU, float32 on CPU)" but the default was bf16: a CPU
    run timed bfloat16."""
    from draftsmith.bench import allreduce

    assert _param("bench-allreduce", "--dtype").default == "auto"
    ran = []
    monkeypatch.setattr(allreduce, "launch_tp", lambda fn, size, opts, device: ran.append(opts))
    monkeypatch.setattr(allreduce, "print_result", lambda res: None)
    code, _, err = run_main(monkeypatch, capsys, "bench-allreduce", "--device", "cpu", "--tp",
                            "1", "--hidden", "8", "--layers", "2")
    assert code == 0, err
    assert ran[0]["dtype"] == "fp32"  # auto on the CPU, as the help says


@pytest.mark.parametrize("given, dtype", [("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
                                          ("float16", "float16"), ("fp32", "float32"),
                                          ("float32", "float32"), ("keep", None)])
def test_export_dtype_takes_both_spellings(monkeypatch, capsys, given, dtype):
    """export spelled bf16/fp16/fp32 where every other command takes bfloat16/float16/float32."""
    import torch

    from draftsmith import export

    def stop(drafter, fmt, out, target, dt, *rest):
        raise DraftsmithError(f"dtype {dt}")

    monkeypatch.setattr(export, "export_served", stop)
    want = None if dtype is None else getattr(torch, dtype)
    assert error_of(monkeypatch, capsys, "export", "d", "-f", "sglang", "-o", "o", "--dtype",
                    given) == f"dtype {want}"


def test_export_dtype_help_and_refusal_list_both_spellings(monkeypatch, capsys):
    words = ("keep", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
    helptext = _param("export", "--dtype").help
    assert all(w in helptext for w in words), helptext
    said = error_of(monkeypatch, capsys, "export", "d", "-f", "sglang", "-o", "o", "--dtype",
                    "half")
    assert said.startswith("--dtype 'half': use one of") and all(w in said for w in words)


def test_bench_drafter_help_says_required_as_the_run_enforces_it(monkeypatch, capsys,
                                                                 tmp_path):
    """The help ended "; required" beside a typer option with a default: it is the run's own
    check (naming 'random' too) that refuses, so the help leads with it and shows no default."""
    drafter = _param("bench", "--drafter")
    assert drafter.help.startswith("required (bench refuses to start without it): ")
    assert not drafter.show_default
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, "bench", "--target", "t", "--device", "cpu") == (
        "give --drafter DIR (a draftsmith drafter folder) or 'random'")


def test_train_data_help_names_both_dataset_folders():
    """It named `data capture` alone; the README's path is `data make`'s OUT/dataset."""
    assert _param("train", "--data").help == (
        "Dataset folder: `data make`'s OUT/dataset or `data capture`'s --out (offline)")
