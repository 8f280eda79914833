"""Command line, thirteenth review: `bench-allreduce --nccl` pairs refused by the flag."""

from __future__ import annotations

import pytest
from test_cli_review2 import error_of

import draftsmith.bench.allreduce as allreduce


@pytest.fixture
def never_launched(monkeypatch):
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("ranks started")))


@pytest.mark.parametrize("pair", ["=1", "NCCL_DEBUG=", "nccl_algo=Ring", "NCCL_algo=Ring"])
def test_a_pair_without_an_nccl_name_or_value_is_refused_by_the_flag(monkeypatch, capsys,
                                                                      never_launched, pair):
    """`--nccl =1` said "extra NCCL setting ''", naming no flag; `NCCL_DEBUG=` exported an empty
    variable, and `NCCL_algo=Ring` one NCCL never reads, both without a word."""
    said = error_of(monkeypatch, capsys, "bench-allreduce", "--device", "cpu", "--tp", "1",
                    "--nccl", pair)
    assert said == f"--nccl {pair!r}: expected NCCL_NAME=VALUE (NCCL's upper-case name and a value)"


@pytest.mark.parametrize("args,said", [
    (["--nccl", "NCCL_ALGO=Ring", "--nccl-algo", "Tree"],
     "--nccl 'NCCL_ALGO=Ring': --nccl-algo Tree sets NCCL_ALGO too; give it once"),
    (["--nccl", "NCCL_PROTO=LL", "--nccl", "NCCL_PROTO=Simple"],
     "--nccl 'NCCL_PROTO=Simple': --nccl NCCL_PROTO=LL sets NCCL_PROTO too; give it once"),
])
def test_a_variable_set_twice_is_refused_not_one_value_dropped(monkeypatch, capsys,
                                                                never_launched, args, said):
    """`--nccl NCCL_ALGO=Ring --nccl-algo Tree` timed Tree, and a second `--nccl` of a name
    replaced the first, without a word: the record named one setting of two asked for."""
    assert error_of(monkeypatch, capsys, "bench-allreduce", "--device", "cpu", "--tp", "1",
                    *args) == said


def test_good_pairs_still_pass_beside_other_named_flags():
    got = allreduce._extra([" NCCL_DEBUG = INFO", "NCCL_ALGO=Ring"],
                           {"NCCL_PROTO": "LL", "NCCL_ALGO": None})
    assert got == {"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring"}


def test_generate_help_names_every_source_its_prompts_flag_reads(monkeypatch, capsys):
    """`--prompts` read text files, `datasets` folders and the bundled humaneval, but its help
    named JSONL, JSON and parquet only."""
    from test_cli_review import run_main

    code, out, _ = run_main(monkeypatch, capsys, "generate", "--help")
    said = " ".join(out.split("--prompts ", 1)[1].split("--target")[0].split())
    assert code == 0 and all(w in said for w in (".txt", "folder", "humaneval")), said


@pytest.mark.parametrize("command", [["serve"], ["data", "prompts"], ["data", "make"]])
def test_help_never_wraps_a_flag_at_its_hyphen(command):
    """click broke lines at hyphens: serve's help read `--max-` over `batch`, data make's
    `--batch-` over `size`, a flag no command has."""
    from typer.testing import CliRunner

    from draftsmith.cli import _register, app

    _register()
    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}).output
    cut = [ln for ln in out.splitlines() if ln.rstrip()[-2:-1].isalnum() and ln.endswith("-")]
    assert out.startswith("Usage:") and not cut and "\u2011" not in out, cut
