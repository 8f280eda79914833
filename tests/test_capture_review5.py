"""Capture, fifth review: a capture that does not fit its disk refused before its forwards, shards
that describe themselves (a renamed one or one moved from another dataset refused by name), and
a shard cut short named by the reader and by a resume, not by a safetensors message."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from safetensors import safe_open

from draftsmith.data import capture as capture_module
from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset, read_manifest, verify
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=4, samples_per_shard=2, max_len=400)
Usage = namedtuple("Usage", "total used free")


def convs(n: int = 5, answer: str = "a") -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"{answer}{i}."}]) for i in range(n)]


def run(target, model, out: Path, cs: list[Conversation] | None = None, **kw) -> dict:
    kw.setdefault("log", lambda s: None)
    return capture(target, cs or convs(), out, CFG, progress=False, model=model, **kw)


def shard(folder: Path, k: int) -> Path:
    return folder / f"shard-{k:05d}.safetensors"


def with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(capture_module.shutil, "disk_usage",
                        lambda path: Usage(10 * free + 1, 9 * free, free))


def test_a_capture_its_disk_cannot_hold_is_refused_before_any_forward(
        target, model, tmp_path, monkeypatch):
    """A full disk stopped a capture at the shard that filled it, hours in; the bytes it writes
    (states, ids, masks, each shard's header) are known from the planned tokens."""
    ref = run(target, model, tmp_path / "ref")["totals"]["bytes"]
    out = tmp_path / "data"
    with_free(monkeypatch, ref - 1)  # the estimate is never below what is written
    with pytest.raises(DraftsmithError, match=rf"^--out {out}: the shards to write take "
                       r"[\d.]+ KB \(\d+ bytes\), but its disk has [\d.]+ KB \(\d+ bytes\) free; "
                       "free space, pass another --out"):
        run(target, None, out)  # no model: refused before the target is built
    assert not list(out.glob("shard-*"))
    with_free(monkeypatch, int(ref * 1.1))  # within 10 % of it
    logs: list[str] = []
    assert run(target, model, out, log=logs.append)["totals"]["bytes"] == ref
    assert any(s.startswith("capture: ") and "to write" in s and f"free on the disk of {out}"
               in s for s in logs)
    with_free(monkeypatch, 0)  # a finished capture writes nothing more
    run(target, None, out)


def test_each_shard_names_what_a_reader_needs(target, model, tmp_path):
    m = run(target, model, tmp_path)
    for entry in m["shards"]:
        with safe_open(str(tmp_path / entry["file"]), framework="pt") as f:
            meta = f.metadata()
        assert json.loads(meta["aux_layer_ids"]) == [-1, 0, 5]
        assert meta["aux_convention"] == CANONICAL_WORDS
        assert (meta["hidden_size"], meta["dtype"]) == (str(m["hidden_size"]), "bfloat16")
        assert meta["target_fingerprint"] == target.fingerprint
        assert (meta["index"], meta["samples"], meta["tokens"]) == tuple(
            str(entry[k]) for k in ("index", "samples", "tokens"))
        assert meta["tokens_sha256"] == entry["tokens_sha256"]


def test_a_renamed_shard_is_refused_by_the_reader_and_redone_by_a_resume(
        target, model, tmp_path):
    """Shard 1 copied over shard 0 (as many samples and bytes) read as shard 0 without a word;
    a resume counted it done."""
    run(target, model, tmp_path)
    assert shard(tmp_path, 0).stat().st_size == shard(tmp_path, 1).stat().st_size
    shutil.copy(shard(tmp_path, 1), shard(tmp_path, 0))
    why = (rf"^{shard(tmp_path, 0)}: not the shard the manifest lists \(its metadata says index "
           r"1, the manifest 0\): renamed, or moved here from another dataset")
    with pytest.raises(DraftsmithError, match=why):
        Dataset(tmp_path)[0]
    with pytest.raises(DraftsmithError, match=why):
        verify(tmp_path, hashed=[])
    logs: list[str] = []
    run(target, model, tmp_path, log=logs.append)
    assert f"capture: {shard(tmp_path, 0)}: its metadata says index 1, the manifest 0; " \
           "captured again" in logs
    verify(tmp_path)


def test_a_shard_moved_from_another_dataset_is_refused(target, model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run(target, model, a)
    run(target, model, b, convs(answer="b"))
    assert shard(a, 0).stat().st_size == shard(b, 0).stat().st_size
    shutil.copy(shard(b, 0), shard(a, 0))
    with pytest.raises(DraftsmithError, match=rf"^{shard(a, 0)}: not the shard the manifest "
                       r"lists \(its metadata says tokens_sha256 \w+, the manifest \w+\)"):
        Dataset(a)[1]


def test_a_shard_cut_short_is_named_by_the_reader_and_by_a_resume(target, model, tmp_path):
    """The reader's error was safetensors' "incomplete metadata, file not fully covered"; a
    resume rewrote the shard without saying which or why."""
    m = run(target, model, tmp_path)
    path, size = shard(tmp_path, 1), m["shards"][1]["bytes"]
    path.write_bytes(path.read_bytes()[: size // 2])
    cut = rf"{size // 2} bytes, the manifest says {size} \(cut short by a crash or a full disk"
    with pytest.raises(DraftsmithError, match=rf"^{path}: unreadable shard: {cut}") as e:
        Dataset(tmp_path)[2]
    assert "deserializ" not in str(e.value)
    logs: list[str] = []
    run(target, model, tmp_path, log=logs.append)
    assert any(s.startswith(f"capture: {path}: {size // 2} bytes, the manifest says {size} "
                            "(cut short") and s.endswith("; captured again") for s in logs)
    assert read_manifest(tmp_path)["shards"][1]["bytes"] == size
    verify(tmp_path)
