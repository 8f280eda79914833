"""Flags given where they do nothing are refused by name, bad values are refused by the flag the
user typed (not a dataclass field's name), both before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_review import run_main

NEVER = "never-loaded"  # a --target that fails to load: a refusal must come before the load


def error_of(monkeypatch, capsys, *args: str) -> str:
    """The one error line `draftsmith ARGS` ends with (exit code 2)."""
    code, _, err = run_main(monkeypatch, capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("draftsmith: error: "), err
    return lines[0].removeprefix("draftsmith: error: ")


def prompts_file(path: Path, n: int, answered: bool = False) -> Path:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}?"}]
        msgs += [{"role": "assistant", "content": f"answer {i}."}] if answered else []
        rows.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("args, says", [
    (["generate", "-p", "hi", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["generate", "-p", "hi", "--temperature", "-1"], "--temperature must be a finite number"),
    (["bench", "--drafter", "random", "--temperature", "nan"], "--temperature must be a finite"),
    (["bench", "--drafter", "random", "--temperature", "0.5", "--top-k", "-1"],
     "--top-k must be >= 0"),
    (["data", "regenerate", "P", "-o", "a.jsonl", "--top-k", "-2"], "--top-k must be >= 0"),
    (["data", "prompts", "--self-made", "2", "-o", "x.jsonl", "--top-p", "1.5"],
     "--top-p must be in (0, 1]"),
    (["data", "prompts", "--self-made", "2", "-o", "x.jsonl", "--batch-size", "0"],
     "--batch-size must be >= 1, got 0"),
    (["data", "capture", "P", "-o", "ds", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["data", "capture", "P", "-o", "ds", "--shard-size", "0"], "--shard-size must be >= 1"),
    (["data", "capture", "P", "-o", "ds", "--too-long", "cut"],
     "--too-long 'cut': use truncate or skip"),
    (["serve", "--drafter", "d", "--num-draft-tokens", "9"],
     "--num-draft-tokens 9: a chain (--topk 1) verifies --steps + 1 = 4 tokens"),
    (["serve", "--drafter", "d", "--topk", "2", "--num-draft-tokens", "99"],
     "--num-draft-tokens 99: a tree of --topk 2 and --steps 3 verifies 2 to 11 tokens"),
    (["serve", "--frontends", "-1"], "--frontends must be >= 0"),
])
def test_bad_values_are_refused_by_the_flag_typed(monkeypatch, capsys, tmp_path, args, says):
    """They were named by SamplingParams', CaptureConfig's or the engine's fields (`top_p`,
    `batch_size`, `too_long`, `num_draft_tokens`), some only after the target loaded."""
    monkeypatch.chdir(tmp_path)
    prompts_file(tmp_path / "P", 2)
    args = [*args, "--target", NEVER, "--device", "cpu"]
    assert error_of(monkeypatch, capsys, *args).startswith(says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P"]  # nothing written


@pytest.mark.parametrize("flags, named", [
    (["--device", "cuda"], "--device"), (["--dtype", "float32"], "--dtype"),
    (["--batch-size", "4"], "--batch-size"), (["--compile"], "--compile"),
    (["--no-refill"], "--no-refill"),
])
def test_regenerate_refuses_engine_flags_with_a_server(monkeypatch, capsys, tmp_path, flags,
                                                       named):
    """They were dropped without a word (and --device cuda was refused for want of a GPU the
    server run never uses)."""
    src, out = prompts_file(tmp_path / "p.jsonl", 2), tmp_path / "a.jsonl"
    msg = error_of(monkeypatch, capsys, "data", "regenerate", str(src), "-o", str(out),
                   "--base-url", "http://127.0.0.1:9/v1", "--model", "m", *flags)
    assert msg == (f"{named} applies only to the built-in engine: leave it out with --base-url")
    assert not out.exists()


def test_regenerate_refuses_server_flags_without_one(monkeypatch, capsys, tmp_path):
    src, out = prompts_file(tmp_path / "p.jsonl", 2), tmp_path / "a.jsonl"
    msg = error_of(monkeypatch, capsys, "data", "regenerate", str(src), "-o", str(out),
                   "--target", NEVER, "--model", "m", "--retries", "1")
    assert msg == "--model, --retries apply only to a server: give them with --base-url"


def test_regenerate_keeps_concurrency_requests_in_flight(monkeypatch, capsys, tmp_path,
                                                         tiny_llama_dir):
    """A server's answers went out --batch-size (16) conversations at a time, so
    --concurrency 24 kept at most 16 requests in flight."""
    import threading
    import time

    from draftsmith.data.regenerate import Answer, OpenAIBackend

    lock, live, most = threading.Lock(), [0], [0]

    def one(self, messages):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        end = time.monotonic() + 10  # every request of the window begins before the first
        while most[0] < 24 and time.monotonic() < end:  # ends (a fixed 0.2 s raced the pool's
            time.sleep(0.01)  # threads on a loaded machine); 16 at a time waits it out, fails
        with lock:
            live[0] -= 1
        return Answer("fine.", 2, "stop")

    monkeypatch.setattr(OpenAIBackend, "one", one)
    src, out = prompts_file(tmp_path / "p.jsonl", 30), tmp_path / "a.jsonl"
    code, _, err = run_main(monkeypatch, capsys, "data", "regenerate", str(src), "-o", str(out),
                            "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
                            "--target", str(tiny_llama_dir), "--concurrency", "24")
    assert code == 0, err
    assert most[0] == 24 and len(out.read_text().splitlines()) == 30


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "0.5", "--seed", "3"],
     "--temperature, --seed apply only to self-made prompts: give them with --self-made N"),
    (["--target", "t", "--max-chars", "50"],
     "--target, --max-chars apply only to self-made prompts: give them with --self-made N"),
])
def test_prompts_from_files_refuse_self_made_flags(monkeypatch, capsys, tmp_path, flags, says):
    """Only --openings was refused; the rest were dropped without a word."""
    src, out = prompts_file(tmp_path / "p.jsonl", 2), tmp_path / "q.jsonl"
    assert error_of(monkeypatch, capsys, "data", "prompts", str(src), "-o", str(out),
                    *flags) == says
    assert not out.exists()


def test_self_made_prompts_refuse_file_flags(monkeypatch, capsys, tmp_path):
    out = tmp_path / "q.jsonl"
    assert error_of(monkeypatch, capsys, "data", "prompts", "--self-made", "2", "-o", str(out),
                    "--target", NEVER, "--limit", "1") == (
        "--limit applies only to prompt files: leave it out with --self-made N")


def test_vocab_of_a_dataset_refuses_a_target(monkeypatch, capsys, tmp_path, tiny_llama_dir):
    """The dataset's manifest names its target: --target was accepted and ignored."""
    from draftsmith.data.vocab import load_vocab

    src, data = prompts_file(tmp_path / "c.jsonl", 3, answered=True), tmp_path / "ds"
    code, _, err = run_main(monkeypatch, capsys, "data", "capture", str(src), "-o", str(data),
                            "--target", str(tiny_llama_dir), "--device", "cpu")
    assert code == 0, err
    before = sorted(p.name for p in data.iterdir())
    assert error_of(monkeypatch, capsys, "data", "vocab", str(data), "--size", "8",
                    "--target", str(tiny_llama_dir)).startswith(
        "--target applies only to a conversations JSONL: a dataset folder's manifest names")
    assert sorted(p.name for p in data.iterdir()) == before
    code, _, err = run_main(monkeypatch, capsys, "data", "vocab", str(data), "--size", "8")
    assert code == 0, err
    assert load_vocab(data)[0].numel() == 8


def test_bench_allreduce_refuses_shapes_beside_a_target(monkeypatch, capsys, tiny_llama_dir):
    """--hidden and --layers were replaced by the target's without a word."""
    from draftsmith.bench import allreduce

    ran = []
    monkeypatch.setattr(allreduce, "launch_tp", lambda fn, size, opts, device: ran.append(opts))
    monkeypatch.setattr(allreduce, "print_result", lambda res: None)
    base = ["bench-allreduce", "--target", str(tiny_llama_dir), "--device", "cpu", "--tp", "1"]
    assert error_of(monkeypatch, capsys, *base, "--hidden", "8", "--layers", "2") == (
        "--hidden, --layers apply only without --target: --target sets the hidden size and "
        "layers; leave them out")
    assert ran == []
    code, _, err = run_main(monkeypatch, capsys, *base)
    assert code == 0 and (ran[0]["hidden"], ran[0]["layers"]) == (64, 6), err


def test_bench_refuses_a_missing_suite_before_loading(monkeypatch, capsys, tmp_path):
    """It was found only after the target and drafter had loaded (minutes on a large one)."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, "bench", "--drafter", "random", "--target", NEVER,
                    "--device", "cpu", "--suite", "missing.jsonl") == (
        "--suite missing.jsonl: no such file or folder")


@pytest.mark.parametrize("flags, says", [
    (["--topk", "2", "--num-draft-tokens", "5"], "--topk, --num-draft-tokens without --drafter"),
    (["--steps", "5"], "--steps without --drafter"),
    (["--warm-sampling", "filtered"],
     "--warm-sampling applies only with a warm-up: give --warmup with it, or leave it out"),
    (["--warm-sampling", "none", "--no-warmup"],
     "--warm-sampling applies only with a warm-up: leave it out"),
])
def test_serve_names_the_flags_given_where_they_do_nothing(monkeypatch, capsys, flags, says):
    """Each speculative flag is told from its own default (the check repeated --steps' 3), and
    --warm-sampling without a warm-up (off on the CPU) was ignored."""
    assert error_of(monkeypatch, capsys, "serve", "--target", NEVER, "--device", "cpu",
                    *flags).startswith(says)


def test_given_names_each_flag_as_typed():
    from draftsmith.data.cli import regenerate
    from draftsmith.options import given

    assert given(regenerate, refill=False, temperature=0.8, top_p=0.5, device="auto") == [
        "--no-refill", "--top-p"]
    assert given(regenerate, temperature=0.0, refill=True) == ["--temperature"]


def test_self_made_overwrite_in_a_folder_it_cannot_write_keeps_the_old_prompts(
        monkeypatch, capsys, tmp_path):
    """`data prompts --self-made N --overwrite` deleted the old prompts before anything was
    checked, then died with a PermissionError traceback: now one error line, the file as it was."""
    import errno
    import os

    from conftest import write_tiny_folder

    tiny = write_tiny_folder(tmp_path / "tiny")
    out = tmp_path / "p.jsonl"
    out.write_text('{"prompt": "an old one"}\n')

    def refuse(*a):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    code, _, err = run_main(monkeypatch, capsys, "data", "prompts", "--self-made", "2",
                            "--overwrite", "-o", str(out), "--target", str(tiny), "--device",
                            "cpu", "-n", "8", "--min-chars", "1")
    errors = [line for line in err.splitlines() if "draftsmith: error: " in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1
    assert errors[0].endswith("p.jsonl: cannot write it (Permission denied); the prompts there "
                              "before are kept")
    assert out.read_text() == '{"prompt": "an old one"}\n'


def test_a_bad_engine_switch_is_one_error_line_from_the_command_line():
    """The engine reads its DRAFTSMITH_* switches at import, which `main` did before its error
    handling: a bad value was a traceback and exit 1, not the one line the README promises."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DRAFTSMITH_SMALL_LINEAR_ROWS": "x"}
    run = subprocess.run([sys.executable, "-m", "draftsmith", "generate", "-p", "hi"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "draftsmith: error: DRAFTSMITH_SMALL_LINEAR_ROWS='x': use a count >= 0"]


@pytest.mark.parametrize("args", [
    ["data", "regenerate", "P", "-o", "a.jsonl", "--temperature", "0", "--top-k", "5"],
    ["data", "regenerate", "P", "-o", "a.jsonl", "--temperature", "0", "--top-p", "0.5"],
    ["data", "prompts", "--self-made", "2", "-o", "x.jsonl", "--temperature", "0", "--top-p",
     "0.5"],
])
def test_data_refuses_filters_given_at_temperature_0(monkeypatch, capsys, tmp_path, args):
    """regenerate took --top-k 5 at temperature 0 and recorded top_k 5 as the answers' sampling,
    though they were greedy (generate, bench and tune refuse it)."""
    monkeypatch.chdir(tmp_path)
    prompts_file(tmp_path / "P", 2)
    says = error_of(monkeypatch, capsys, *args, "--target", NEVER, "--device", "cpu")
    assert "only to sampling (--temperature > 0): at temperature 0 decoding is greedy" in says


def test_regenerate_greedy_keeps_its_default_top_p(monkeypatch, capsys, tmp_path):
    """The default --top-p (0.95) is not a flag given: a greedy run still starts (and here
    stops at the target, which cannot load)."""
    monkeypatch.chdir(tmp_path)
    prompts_file(tmp_path / "P", 2)
    code, _, err = run_main(monkeypatch, capsys, "data", "regenerate", "P", "-o", "a.jsonl",
                            "--temperature", "0", "--target", NEVER, "--device", "cpu")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"draftsmith: error: {NEVER}: no such file or folder")
