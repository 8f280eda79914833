"""Command-line review, fifth pass: help readable at 80 columns, `generate --drafter`, the text
generate prints, and a resumed training run's commands."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_cli_review import run_main

FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


@pytest.fixture(scope="module")
def root():
    """The whole command tree, built once (each `main()` registers the commands again)."""
    import typer

    from draftsmith.cli import _register, app

    _register()
    return typer.main.get_command(app)


def _help(root, capsys, name: str) -> str:
    try:
        root.main([*name.split()[1:], "--help"], prog_name="draftsmith", standalone_mode=False)
    except SystemExit as e:
        assert not e.code, name
    return capsys.readouterr().out


def _leaves(cmd, name="draftsmith"):
    subs = getattr(cmd, "commands", None)
    if not subs:
        return [(name, cmd)]
    return [x for n, c in subs.items() for x in _leaves(c, f"{name} {n}")]


def test_every_help_shows_whole_option_names_at_80_columns(monkeypatch, capsys, root):
    """rich's panel shrank the option column to fit 80 columns: `--intermediate-si…`,
    `--norm-before-res…` (train), `DRAFTSMITH_SAMPLED_DRAFT…` (serve's help text)."""
    monkeypatch.setenv("COLUMNS", "80")
    for name, cmd in _leaves(root):
        out = _help(root, capsys, name)
        assert "…" not in out, name
        shown = set(FLAG.findall(out))
        for p in cmd.params:
            names = [n for n in (*p.opts, *p.secondary_opts) if n.startswith("--")]
            assert not set(names) - shown, (name, names)


def test_every_group_lists_each_commands_line_whole(monkeypatch, capsys, root):
    """click cut a command's line to one row mid-sentence: `compare  Compare drafters:
    architecture, parameters by...`."""
    from draftsmith.cli import first_paragraph

    monkeypatch.setenv("COLUMNS", "80")
    groups = [("draftsmith", root)]
    groups += [(f"draftsmith {n}", c) for n, c in root.commands.items() if hasattr(c, "commands")]
    assert len(groups) == 3  # the root, data and targets
    for name, group in groups:
        out = " ".join(_help(root, capsys, name).split())
        for sub, cmd in group.commands.items():
            assert f"{sub} {first_paragraph(cmd.help)}" in out, (name, sub)


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama_dir, tmp_path_factory):
    """A drafter that always drafts the token the tiny target repeats most ('1'): chains and
    trees of it have drafts accepted and drafts rejected."""
    from draftsmith.bench.drafters import random_drafter
    from draftsmith.models.eagle3 import save_drafter
    from draftsmith.targets import load_target

    t = load_target(tiny_llama_dir)
    one = t.tokenizer.encode("1", add_special_tokens=False)[-1]
    d = random_drafter(t.cfg, torch.device("cpu"), torch.float32, seed=3)
    with torch.no_grad():
        d.lm_head.weight.zero_()  # every draft is draft id 0, which d2t maps to '1'
        d2t = torch.zeros(d.cfg.draft_vocab_size, dtype=torch.long)
        d2t[0] = one
        t2d = torch.zeros(t.cfg.vocab_size, dtype=torch.bool)
        t2d[: d.cfg.draft_vocab_size] = True
        d.set_vocab(d2t, t2d)
    d.cfg.target_fingerprint = t.fingerprint
    return save_drafter(d, tmp_path_factory.mktemp("drafter") / "d")


PROMPTS = ["-p", "hello there", "-p", "abc x", "-p", "zzz"]


def _generate(monkeypatch, capsys, target, *extra: str) -> tuple[list[dict], str]:
    code, out, err = run_main(monkeypatch, capsys, "generate", *PROMPTS, "--target",
                              str(target), "--device", "cpu", "-n", "20", "--json",
                              "--batch-size", "2", *extra)
    assert code == 0, err
    return [json.loads(x) for x in out.splitlines()], err


@pytest.mark.parametrize("drafting", [["--steps", "3"],
                                      ["--steps", "3", "--topk", "2", "--num-draft-tokens", "5"]])
def test_generate_with_a_drafter_prints_the_plain_greedy_text(monkeypatch, capsys,
                                                              tiny_llama_dir, drafter_dir,
                                                              drafting):
    """generate had no --drafter: speculative text was reachable through serve alone."""
    plain, err = _generate(monkeypatch, capsys, tiny_llama_dir)
    assert "accept length" not in err
    spec, err = _generate(monkeypatch, capsys, tiny_llama_dir, "--drafter", str(drafter_dir),
                          *drafting)
    assert spec == plain
    said = re.search(r"accept length (\d+\.\d+) tokens per target pass", err)
    assert said and 1.0 < float(said.group(1)) <= 4.0, err


@pytest.mark.parametrize(("args", "says"), [
    (["--steps", "2"], "--steps applies only with --drafter"),
    (["--topk", "2", "--num-draft-tokens", "4"],
     "--topk, --num-draft-tokens apply only with --drafter"),
    (["--drafter", "{d}", "--topk", "2"], "--topk > 1 (a tree) needs --num-draft-tokens: a "
                                          "tree of --topk 2 and --steps 3 verifies 2 to 11 tokens"),
    (["--drafter", "{d}", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--drafter", "{d}", "--topk", "600", "--num-draft-tokens", "4"],
     "--topk 600 exceeds the drafter's draft vocabulary"),
    (["--drafter", "{d}/nothing"], "no such folder"),
])
def test_generate_refuses_a_bad_drafting_before_loading(monkeypatch, capsys, drafter_dir, args,
                                                        says):
    from draftsmith import targets

    monkeypatch.setattr(targets, "load_target", lambda *a: pytest.fail("loaded the target"))
    args = [a.format(d=drafter_dir) for a in args]
    code, _, err = run_main(monkeypatch, capsys, "generate", "-p", "hi", "--device", "cpu", *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_generate_prints_brackets_as_typed(monkeypatch, capsys, tiny_llama_dir):
    """The text went through rich markup: `a[i]` lost its `[i]`, and `[/INST]` was a
    MarkupError traceback."""
    code, out, err = run_main(monkeypatch, capsys, "generate", "-p", "a[i] [/INST] :smile:",
                              "--target", str(tiny_llama_dir), "--device", "cpu", "-n", "2")
    assert code == 0, err
    assert out.splitlines()[0] == "> a[i] [/INST] :smile:"


def test_a_resumed_training_run_keeps_every_command(monkeypatch, capsys, train_root):
    """draftsmith.json kept only the --resume command, not the one that started the run."""
    out = train_root / "resumed"
    args = ["train", "--out", str(out), "--data", str(train_root / "data"), "--target",
            str(train_root / "target"), "--max-steps", "2", "--batch-size", "1", "--max-len",
            "32", "--ttt-steps", "2", "--draft-vocab-size", "64", "--no-progress",
            "--log-every", "1", "--loader-workers", "0"]
    code, _, err = run_main(monkeypatch, capsys, *args, "--time-limit", "0")
    assert code == 0 and not (out / "draftsmith.json").exists(), err  # stopped at step 1
    code, _, err = run_main(monkeypatch, capsys, *args, "--resume")
    assert code == 0, err
    extra = json.loads((out / "draftsmith.json").read_text())["training"]["config"]["extra"]
    first = "draftsmith " + " ".join([*args, "--time-limit", "0"])
    assert extra["commands"] == [first, "draftsmith " + " ".join([*args, "--resume"])]
    assert extra["command"] == extra["commands"][-1]  # what readers of "command" read


def test_targets_show_prints_a_bracketed_source_whole(monkeypatch, capsys, tiny_llama_dir,
                                                      tmp_path):
    """The table read each value as rich markup: a folder `tiny[v2]` was shown as `tiny`."""
    monkeypatch.setenv("COLUMNS", "250")
    folder = tmp_path / "tiny[v2]"
    folder.symlink_to(tiny_llama_dir)
    code, out, err = run_main(monkeypatch, capsys, "targets", "show", str(folder))
    assert code == 0, err
    assert "tiny[v2]" in out
