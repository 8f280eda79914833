"""Long stages killed (SIGKILL), torn mid-write or out of disk, then rerun: the result equals an
uninterrupted run's, bit for bit on CPU, and a full disk is one error line with what was written
kept readable. The disk fills through RLIMIT_FSIZE in a subprocess (writes past the limit fail
with EFBIG, as a full disk fails them with ENOSPC); Python ignores SIGXFSZ."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_helpers import write_dataset

from draftsmith.data.prompts import Conversation, read_prompts
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
from draftsmith.data.selfmade import BUILTIN_OPENINGS, MagpieConfig, self_made_prompts
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import TrainConfig, train
from draftsmith.train.report import read_log

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*args: object, fsize: int | None = None) -> subprocess.CompletedProcess:
    """`python -m draftsmith ARGS`; with `fsize`, no file it writes may grow past that."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "draftsmith", *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=limit if fsize else None)


def one_error(r: subprocess.CompletedProcess, *said: str) -> None:
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(errors) == 1 and all(s in errors[0] for s in said), errors


def line_starts(data: bytes) -> list[int]:
    return [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]


# --- self-made prompts: one write a round ----------------------------------------------------

MAGPIE = MagpieConfig(n=16, batch_size=4, max_new_tokens=24, min_chars=1,
                      openings=BUILTIN_OPENINGS)
MAGPIE_CLI = ("data", "prompts", "--self-made", 16, "--batch-size", 4, "--max-new-tokens", 24,
              "--min-chars", 1, "--openings", "builtin", "--device", "cpu")


@pytest.fixture(scope="module")
def magpie(target, model, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("magpie") / "whole.jsonl"
    self_made_prompts(target, out, MAGPIE, model, progress=False)
    return out.read_bytes()


def rounds(data: bytes) -> list[int]:
    return [json.loads(line)["meta"]["round"] for line in data.splitlines()]


def test_self_made_prompts_torn_round_is_made_again_whole(target, model, magpie, tmp_path):
    """A kill inside a round's write left its first records whole and the next cut short: the
    whole ones were kept and the rerun went on at the next round, so the torn round lost its
    other prompts and every later round was seeded otherwise."""
    r = rounds(magpie)
    i = next(i for i in range(1, len(r)) if r[i] == r[i - 1])  # a round's second record
    start = line_starts(magpie)[i]
    part = tmp_path / "part.jsonl"
    part.write_bytes(magpie[: start + 20])
    self_made_prompts(target, part, MAGPIE, model, progress=False)
    assert part.read_bytes() == magpie


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_self_made_prompts_on_a_full_disk_say_so_and_resume_equal(target, model, magpie,
                                                                  tiny_llama_dir, tmp_path):
    """The disk filled inside a round's write: a traceback (OSError), the file ending inside a
    record. Now one error line, the file cut back to whole rounds, and a rerun equals the
    uninterrupted run."""
    part = tmp_path / "part.jsonl"
    r = cli(*MAGPIE_CLI, "--target", tiny_llama_dir, "--out", part, fsize=len(magpie) // 2)
    one_error(r, str(part), "cannot write it", "prompts made before", "a rerun")
    kept = part.read_bytes()
    n = kept.count(b"\n")
    assert kept and magpie.startswith(kept) and kept.endswith(b"\n")
    assert rounds(magpie)[n - 1] != rounds(magpie)[n]  # whole rounds only
    self_made_prompts(target, part, MAGPIE, model, progress=False)
    assert part.read_bytes() == magpie


# --- regenerate: one write a chunk -----------------------------------------------------------

def asks(n: int = 12) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i} " + "why " * (i % 5)}])
            for i in range(n)]


def test_regenerate_torn_chunk_is_answered_again_whole(target, model, tmp_path):
    """The second record of a two-prompt chunk cut short: its first was kept and the second
    prompt answered alone, in a batch of one, sampled otherwise than the uninterrupted run."""
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, refill=False)
    backend = EngineBackend(target, model, cfg)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    regenerate(asks(), whole, backend, target.tokenizer, cfg, False, lambda s: None)
    data = whole.read_bytes()
    part.write_bytes(data[: line_starts(data)[5] + 30])  # inside chunk 2's second record
    regenerate(asks(), part, backend, target.tokenizer, cfg, False, lambda s: None)
    assert part.read_bytes() == data


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_regenerate_on_a_full_disk_says_so_and_resumes_equal(target, model, tiny_llama_dir,
                                                            tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c.to_json()) + "\n" for c in asks(24)))
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2)  # refill: 16 prompts a chunk
    backend = EngineBackend(target, model, cfg)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    convs = read_prompts(prompts)
    regenerate(convs, whole, backend, target.tokenizer, cfg, False, lambda s: None)
    data = whole.read_bytes()
    r = cli("data", "regenerate", prompts, "--target", tiny_llama_dir, "--batch-size", 2,
            "--max-new-tokens", 8, "--max-len", 64, "--device", "cpu", "--out", part,
            fsize=len(data) - 100)
    one_error(r, str(part), "cannot write it", "keeps the 16 conversations answered before")
    assert part.read_bytes() == data[: line_starts(data)[16]]
    regenerate(convs, part, backend, target.tokenizer, cfg, False, lambda s: None)
    assert part.read_bytes() == data


# --- train -----------------------------------------------------------------------------------

TRAIN = dict(max_steps=6, batch_size=2, max_len=48, ttt_steps=3, lr=3e-3, log_every=1,
             save_every=3, keep_last=2, draft_vocab_size=64, loader_workers=0)


def train_cli(root: Path, out: str, *more: object) -> list[object]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()]
    return ["train", "--data", root / "data", "--target", root / "target", "--out", root / out,
            "--device", "cpu", "--no-progress", *flags, *more]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_dir, target) -> Path:
    root = tmp_path_factory.mktemp("crash_train")
    write_dataset(root / "data", target, n=24)
    (root / "target").symlink_to(tiny_llama_dir)
    with pytest.warns(UserWarning, match="distinct assistant tokens"):
        train(TrainConfig(out=str(root / "whole"), data=str(root / "data"),
                          target=str(root / "target"), progress=False, **TRAIN))
    return root


def same_run(a: Path, b: Path) -> None:
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    rows = [[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_log(x)]
            for x in (a, b)]
    assert rows[0] == rows[1] and len(rows[0]) == TRAIN["max_steps"]


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_train_on_a_full_disk_at_a_checkpoint_says_so_and_resumes_equal(trained):
    """The first checkpoint did not fit: a SafetensorError traceback, its half-written tmp
    folder left behind. Now one error line, no tmp folder, the log rows readable, and
    --resume trains the run an uninterrupted one trains."""
    out = trained / "full"
    r = cli(*train_cli(trained, "full"), fsize=4096)
    one_error(r, "step-00000003", "cannot write it", "--resume")
    assert [p.name for p in (out / "checkpoints").iterdir()] == []
    assert [row["step"] for row in read_log(out)] == [1, 2, 3]
    with pytest.warns(UserWarning, match="distinct assistant tokens"):
        train(TrainConfig(out=str(out), data=str(trained / "data"),
                          target=str(trained / "target"), progress=False, resume=True, **TRAIN))
    same_run(trained / "whole", out)


def test_train_on_a_full_disk_at_the_drafter_says_so_and_resume_writes_it(trained, monkeypatch):
    """The final drafter did not fit: an OSError traceback and save_drafter's tmp file left in
    --out. Now one error naming it, no tmp file, and --resume writes the same drafter."""
    import safetensors.torch

    out = trained / "full_at_end"
    save_file = safetensors.torch.save_file

    def disk_full(state, path, metadata=None):  # the final drafter's write only, half done
        if Path(path).parent != out:
            return save_file(state, path, metadata=metadata)
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    cfg = TrainConfig(out=str(out), data=str(trained / "data"), target=str(trained / "target"),
                      progress=False, **TRAIN)
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(DraftsmithError, match=r"model.safetensors: cannot write it \(\[Errno 28\]"
                       r".*--resume"), pytest.warns(UserWarning):
        train(cfg)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    train(dataclasses.replace(cfg, resume=True))  # the vocab comes with the checkpoint
    same_run(trained / "whole", out)


# --- SIGKILL at points of a subprocess's run -------------------------------------------------

def kill_when(args: list[object], ready, timeout: float = 120) -> None:
    """Run `python -m draftsmith ARGS` and SIGKILL it once `ready()` holds."""
    p = subprocess.Popen([sys.executable, "-m", "draftsmith", *map(str, args)], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + timeout
        while not ready():
            assert p.poll() is None, f"finished before the kill: {p.stderr.read()[-2000:]!r}"
            assert time.monotonic() < end, "never ready"
            time.sleep(0.002)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
        p.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("at", ["tmp folder", "second checkpoint"])
def test_train_killed_then_resumed_equals_the_uninterrupted_run(trained, at):
    out = trained / f"killed-{at.replace(' ', '-')}"
    ckpts = out / "checkpoints"
    ready = {"tmp folder": lambda: ckpts.is_dir() and any(p.name.startswith(".")
                                                          for p in ckpts.iterdir()),
             "second checkpoint": lambda: (ckpts / "step-00000006").is_dir()}[at]
    kill_when(train_cli(trained, out.name), ready)
    r = cli(*train_cli(trained, out.name, "--resume"))
    assert r.returncode == 0, r.stderr[-2000:]
    same_run(trained / "whole", out)
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_data_make_killed_in_each_stage_then_rerun_equals_the_uninterrupted_run(tiny_llama_dir,
                                                                                tmp_path):
    def make(out: Path) -> list[object]:
        return ["data", "make", out, "--n", 12, "--target", tiny_llama_dir, "--batch-size", 4,
                "--max-len", 96, "--max-new-tokens", 16, "--prompt-tokens", 48,
                "--vocab-size", 40, "--device", "cpu"]

    def files(out: Path) -> dict[str, bytes]:
        keep = ("prompts.jsonl", "answers.jsonl", "dataset/vocab.safetensors")
        shards = sorted(p.relative_to(out).as_posix() for p in out.glob("dataset/shard-*"))
        return {name: (out / name).read_bytes() for name in (*keep, *shards)}

    whole = tmp_path / "whole"
    assert cli(*make(whole)).returncode == 0
    for stage, name in [("prompts", "prompts.jsonl"), ("regenerate", "answers.jsonl"),
                        ("capture", "dataset/shard-00000.safetensors")]:
        out = tmp_path / stage
        kill_when(make(out), lambda o=out, n=name: (o / n).is_file() and (o / n).stat().st_size)
        r = cli(*make(out))
        assert r.returncode == 0, r.stderr[-2000:]
        assert files(out) == files(whole), stage
        manifest = json.loads((out / "dataset/manifest.json").read_text())
        assert manifest["complete"] and manifest["shards"] == json.loads(
            (whole / "dataset/manifest.json").read_text())["shards"]
