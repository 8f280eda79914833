"""Capture, sixth review: a capture refused for disk space leaves nothing that changes the next
run (no folder, no manifest, no dropped shards)."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from draftsmith.data import capture as capture_module
from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=4, samples_per_shard=2, max_len=400)
Usage = namedtuple("Usage", "total used free")


def convs(n: int = 5, answer: str = "a") -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"{answer}{i}."}]) for i in range(n)]


def run(target, model, out: Path, cs: list[Conversation] | None = None,
        cfg: CaptureConfig = CFG, **kw) -> dict:
    kw.setdefault("log", lambda s: None)
    return capture(target, cs or convs(), out, cfg, progress=False, model=model, **kw)


def with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(capture_module.shutil, "disk_usage",
                        lambda path: Usage(10 * free + 1, 9 * free, free))


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_a_capture_refused_for_room_leaves_no_folder_and_no_manifest(
        target, model, tmp_path, monkeypatch):
    """The refused run wrote a manifest of its settings: a rerun with the smaller --max-len or
    fewer conversations the refusal suggests was refused as "a different max_len"."""
    out = tmp_path / "data"
    with_free(monkeypatch, 10)
    with pytest.raises(DraftsmithError, match=r"free(, counting .* removes first)?; free space"):
        run(target, None, out)
    assert not out.exists()
    monkeypatch.undo()
    small = CaptureConfig(aux_layer_ids=[0, 5], batch_size=4, samples_per_shard=2, max_len=300)
    m = run(target, model, out, convs(3), cfg=small)
    assert m["max_len"] == 300 and m["totals"]["samples"] == 3
    assert m["commands"] == ["draftsmith.data.capture.capture()"]


def test_a_refusal_in_an_existing_folder_leaves_it_as_it_was(target, model, tmp_path,
                                                              monkeypatch):
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with_free(monkeypatch, 10)
    with pytest.raises(DraftsmithError, match=r"free(, counting .* removes first)?; free space"):
        run(target, None, out, command="first")
    assert files(out) == {"notes.txt": b"mine"}


def test_a_grow_refused_for_room_keeps_every_shard(target, model, tmp_path, monkeypatch):
    """`--grow` dropped the shards whose samples change (and rewrote the manifest) before the
    room check refused it: the old dataset, still wanted by a rerun without --grow, was cut."""
    out = tmp_path / "data"
    run(target, model, out, convs(5))
    before = files(out)
    grown = convs(5)
    grown[0] = Conversation([{"role": "user", "content": "q0?"},
                             {"role": "assistant", "content": "another answer."}])
    with_free(monkeypatch, 10)
    with pytest.raises(DraftsmithError, match=r"free(, counting .* removes first)?; free space"):
        run(target, None, out, grown + convs(2, "z"), grow=True)
    assert files(out) == before
    monkeypatch.undo()
    run(target, None, out, convs(5))  # the old input resumes: complete, nothing to forward
    verify(out)


def test_a_resume_refused_for_room_adds_no_command(target, model, tmp_path, monkeypatch):
    out = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        run(target, model, out, convs(5), on_shard=_stop_after(1), command="first")
    before = files(out)
    with_free(monkeypatch, 10)
    with pytest.raises(DraftsmithError, match=r"free(, counting .* removes first)?; free space"):
        run(target, None, out, convs(5), command="second")
    assert files(out) == before
    monkeypatch.undo()
    assert run(target, model, out, convs(5), command="first")["commands"] == ["first"]
    assert read_manifest(out)["complete"]


def _stop_after(n: int):
    def stop(k: int) -> None:
        if k + 1 >= n:
            raise KeyboardInterrupt
    return stop


def test_an_overwrite_refused_for_room_keeps_the_old_dataset(target, model, tmp_path,
                                                             monkeypatch):
    """--overwrite removed the old dataset, then the room check refused the new one: the user
    lost both. The old shards' bytes count as room, as the removal frees them."""
    out = tmp_path / "data"
    old = run(target, model, out, convs(5))["totals"]["bytes"]
    before = files(out)
    with_free(monkeypatch, 10)
    with pytest.raises(DraftsmithError, match=r"\(\d+ bytes\) free, counting the [\d.]+ KB this "
                       "run removes first; free space"):
        run(target, None, out, convs(9, "b"), overwrite=True)
    assert files(out) == before
    with_free(monkeypatch, 8 * 1024)  # the new shards fit with the old ones' room alone
    new = run(target, model, out, convs(5, "b"), overwrite=True)
    assert new["totals"]["bytes"] <= old + 8 * 1024
    verify(out)


@pytest.mark.parametrize("cs, cfg, fix", [
    ([Conversation([{"role": "user", "content": "hi?"}])], CFG,
     r"; conversations need answers: have the target answer the prompts first \(draftsmith data "
     r"regenerate\)$"),
    (convs(2), CaptureConfig(aux_layer_ids=[0], max_len=3, too_long="skip"),
     r"\(skipped: 2 too_long\); raise --max-len, or pass --too-long truncate$"),
    (convs(2), CaptureConfig(aux_layer_ids=[0], max_len=3),
     r"\(skipped: 2 answer_past_max_len\); raise --max-len, which cuts them before their "
     r"answers$"),
])
def test_an_input_of_no_sample_says_what_to_do(target, tmp_path, cs, cfg, fix):
    """It named the reason alone ("skipped: 1 no_assistant_tokens"), not the way out."""
    with pytest.raises(DraftsmithError, match=r"^no conversation has assistant tokens to "
                       r"capture .*" + fix):
        run(target, None, tmp_path / "d", cs, cfg)
    assert not (tmp_path / "d").exists()
