"""Second review of data making: read-only folders and full disks as one error with nothing
lost, reruns into an output made otherwise refused, shards lost since a capture redone."""

from __future__ import annotations

import builtins
import errno
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from draftsmith.data import atomic, prompts
from draftsmith.data.capture import CaptureConfig, capture, clean
from draftsmith.data.prompts import Conversation
from draftsmith.data.regenerate import Answer, EngineBackend, OpenAIBackend, RegenConfig, regenerate
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.data.shards import read_manifest, verify
from draftsmith.errors import DraftsmithError


def asks(n: int) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i}"}]) for i in range(n)]


class Echo:
    name = model_name = "echo"

    def __init__(self) -> None:
        self.asked = 0

    def answer(self, batch: list) -> list[Answer]:
        self.asked += len(batch)
        return [Answer("ok", 1, "stop") for _ in batch]


def read_only(monkeypatch, module, error: int = errno.EACCES) -> None:
    """`module`'s files open for reading only, as in a read-only folder (root ignores chmod)."""
    real = builtins.open

    def guarded(path, mode="r", *a, **kw):
        if any(c in mode for c in "wax+"):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(module, "open", guarded, raising=False)


CFG = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)


# --- read-only outputs: one error, the file as it was ----------------------------------------


def test_a_torn_end_in_a_read_only_file_is_one_error_and_kept(target, tmp_path, monkeypatch):
    """A kill tore the last record; the rerun, in a folder since made read-only, died with a
    raw PermissionError traceback from the cut of the torn end."""
    out = tmp_path / "a.jsonl"
    regenerate(asks(2), out, Echo(), target.tokenizer, CFG, False, lambda s: None)
    torn = out.read_bytes()[:-10]
    out.write_bytes(torn)
    read_only(monkeypatch, prompts)
    echo = Echo()
    with pytest.raises(DraftsmithError, match=r"a.jsonl: cannot mend .*Permission denied.*"
                       "make the file writable"):
        regenerate(asks(4), out, echo, target.tokenizer, CFG, False, lambda s: None)
    assert out.read_bytes() == torn and echo.asked == 0


@pytest.mark.parametrize("error", [errno.EACCES, errno.ENOSPC])
def test_regenerate_into_an_unwritable_file_says_so_before_any_answer(target, tmp_path,
                                                                      monkeypatch, error):
    out = tmp_path / "a.jsonl"
    regenerate(asks(2), out, Echo(), target.tokenizer, CFG, False, lambda s: None)
    before = out.read_bytes()
    read_only(monkeypatch, atomic, error)
    echo = Echo()
    with pytest.raises(DraftsmithError, match=f"a.jsonl: cannot write it .{os.strerror(error)}"
                       ".*keeps the 2 conversations answered before"):
        regenerate(asks(4), out, echo, target.tokenizer, CFG, False, lambda s: None)
    assert out.read_bytes() == before and echo.asked == 0


def test_self_made_overwrite_keeps_the_old_prompts_until_it_can_write(target, model, tmp_path,
                                                                      monkeypatch):
    """`prompts --self-made --overwrite` removed the old file before anything was checked: a
    read-only folder was a PermissionError traceback. Now the old prompts are replaced only by
    a write that can happen, and the fresh run equals one into a new file."""
    cfg = MagpieConfig(n=3, batch_size=3, max_new_tokens=8, min_chars=1)
    fresh, out = tmp_path / "fresh.jsonl", tmp_path / "p.jsonl"
    self_made_prompts(target, fresh, cfg, model, progress=False, log=lambda s: None)
    out.write_text('{"prompt": "an old one"}\n')
    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(
            PermissionError(errno.EACCES, "Permission denied")))
        with pytest.raises(DraftsmithError, match="p.jsonl: cannot write it .Permission denied"
                           ".*the prompts there before are kept"):
            self_made_prompts(target, out, cfg, model, progress=False, log=lambda s: None,
                              overwrite=True)
    assert out.read_text() == '{"prompt": "an old one"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["fresh.jsonl", "p.jsonl"]  # no tmp file
    self_made_prompts(target, out, cfg, model, progress=False, log=lambda s: None,
                      overwrite=True)
    assert out.read_bytes() == fresh.read_bytes()


def test_capture_overwrite_in_a_read_only_folder_is_one_error(tmp_path, monkeypatch):
    """The manifest goes first, so a clean cut short never lists shards it removed."""
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "shard-00000.safetensors").write_bytes(b"x")
    real = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith("shard-"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(DraftsmithError, match="cannot remove what an earlier capture left "
                       r"\(Permission denied: .*shard-00000"):
        clean(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00000.safetensors"]


# --- reruns into an output made otherwise ----------------------------------------------------


def answered(out: Path, **answer) -> None:
    """`out` holding one answer recorded as `answer` (with CFG's sampling)."""
    rec = Conversation(asks(1)[0].messages + [{"role": "assistant", "content": "ok"}],
                       meta={"prompt_id": asks(1)[0].id, "answers": [
                           {"turn": 0, "sampling": CFG.sampling(), "tokens": 1,
                            "finish": "stop", **answer}]})
    out.write_text(json.dumps(rec.to_json()) + "\n")


def test_server_answers_sent_otherwise_are_not_mixed_with_this_runs(target, tmp_path):
    """Answers recorded with other fields sent beyond OpenAI's (another top_k, min_p,
    repetition_penalty) are not resumed under this run's; answers written before the fields
    were recorded (yesterday's draftsmith sent these same fields) are."""
    from draftsmith.data.regenerate import PENALTIES, Answer, server_sampling

    out = tmp_path / "a.jsonl"
    answered(out, backend="openai", model="m", base_url="http://old/v1",
             sent={**PENALTIES, **server_sampling(CFG), "top_k": 20})
    before = out.read_bytes()
    backend = OpenAIBackend("http://127.0.0.1:9/v1", "m", CFG, retries=0, timeout=1)
    try:
        with pytest.raises(DraftsmithError, match=r"a.jsonl:1: holds answers of requests with "
                           r"the fields .*'top_k': 20.*'top_k': -1.*write to another file"):
            regenerate(asks(3), out, backend, target.tokenizer, CFG, False, lambda s: None)
        assert out.read_bytes() == before
        out.unlink()
        answered(out, backend="openai", model="m", base_url="http://old/v1")  # no `sent`
        backend.one = lambda messages: Answer("ok", 1, "stop")  # the window asks by `one`
        stats = regenerate(asks(2), out, backend, target.tokenizer, CFG, False, lambda s: None)
        assert stats["done_before"] == 1 and stats["answered"] == 1
    finally:
        backend.close()


def test_the_engine_knows_its_target_by_fingerprint_not_by_path(target, model, tmp_path):
    """The engine's answers named their target by the path typed: the same folder typed
    otherwise was refused, other weights at the same path resumed as the same target."""
    backend = EngineBackend(target, model, CFG)
    out = tmp_path / "a.jsonl"
    answered(out, backend="engine", model="../elsewhere/tiny", target=target.fingerprint)
    backend.answer = Echo().answer
    stats = regenerate(asks(2), out, backend, target.tokenizer, CFG, False, lambda s: None)
    assert stats["done_before"] == 1 and stats["answered"] == 1
    recs = prompts.read_jsonl_tail_safe(out)
    assert recs[1]["meta"]["answers"][0]["target"] == target.fingerprint
    answered(out, backend="engine", model=target.source, target="0123other")
    with pytest.raises(DraftsmithError, match=r"holds answers by .*target 0123other.*target "
                       f"{target.fingerprint}"):
        regenerate(asks(2), out, backend, target.tokenizer, CFG, False, lambda s: None)


def test_self_made_prompts_made_otherwise_are_refused_when_enough_are_there(target, tmp_path):
    """A rerun with another --seed (or target) on a file already holding --self-made N
    prompts said they were kept, as if made with this run's settings."""
    cfg = MagpieConfig(n=1, seed=1)
    meta = {"source": "magpie", "target": target.fingerprint, "round": 0,
            **{k: v for k, v in asdict(cfg).items() if k != "openings"}, "seed": 0}
    out = tmp_path / "p.jsonl"
    out.write_text(json.dumps({"messages": [{"role": "user", "content": "made before"}],
                               "meta": meta}) + "\n")
    with pytest.raises(DraftsmithError, match="made otherwise .seed 0 there, 1 now"):
        self_made_prompts(target, out, cfg, progress=False, log=lambda s: None)
    # the batch size only shapes rounds: a full file made at another one is kept (a `data make`
    # rerun with another --batch-size after its capture ran out of memory)
    other = MagpieConfig(n=1, seed=0, batch_size=cfg.batch_size * 2)
    stats = self_made_prompts(target, out, other, progress=False, log=lambda s: None)
    assert stats["kept"] == 1


# --- capture: a shard gone since is written again --------------------------------------------


def test_a_shard_deleted_or_cut_short_is_captured_again(target, model, tmp_path):
    """A rerun counted every shard the manifest listed as done, gone or not, and called the
    dataset complete: the reader then failed on the missing file."""
    convs = [Conversation([{"role": "user", "content": f"q {i}"},
                           {"role": "assistant", "content": f"answer {i}"}]) for i in range(6)]
    cfg = CaptureConfig(batch_size=2, max_len=64, samples_per_shard=2, dtype=torch.float32)
    out = tmp_path / "ds"
    run = dict(progress=False, model=model, log=lambda s: None)
    capture(target, convs, out, cfg, **run)
    whole = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "shard-00001.safetensors").unlink()
    shard = out / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    capture(target, convs, out, cfg, **run)
    assert verify(out)["shards"] == 3 and read_manifest(out)["complete"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == whole


# --- data make: --n is what the dataset holds ------------------------------------------------


def test_make_with_a_smaller_n_holds_n_samples(target, tmp_path):
    """After `--n 5`, `--n 3` answered and captured all 5 prompts the folder held, recording
    n 3 beside a dataset of 5. Back at 5, the dataset is the first run's again."""
    from draftsmith.data.pipeline import make_dataset
    from draftsmith.data.shards import Dataset

    kw = dict(target=target, batch_size=4, max_len=96, max_new_tokens=16, prompt_tokens=48,
              vocab_size=16, log=lambda s: None, progress=False)
    make_dataset(tmp_path, 5, **kw)
    first = Dataset(tmp_path / "dataset").manifest["shards"]
    rec = make_dataset(tmp_path, 3, **kw)
    ds = Dataset(tmp_path / "dataset")
    assert rec["n"] == 3 and len(ds) == 3 and verify(tmp_path / "dataset")["samples"] == 3
    make_dataset(tmp_path, 5, **kw)
    assert Dataset(tmp_path / "dataset").manifest["shards"] == first


def test_regenerate_skips_a_conversation_the_template_refuses(target, tmp_path, capsys):
    """One system prompt under a template without a system role stopped the run, saying a
    rerun resumes; the rerun stopped at the same conversation, so the run never ended."""
    tok = target.tokenizer
    old = tok.chat_template
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
                         "role not supported') }}{% endif %}" + old)
    refused = Conversation([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "question 9"}])
    convs = asks(3)[:1] + [refused] + asks(3)[1:]
    out = tmp_path / "a.jsonl"
    try:
        stats = [regenerate(convs, out, Echo(), tok, CFG, False, lambda s: None)
                 for _ in range(2)]
    finally:
        tok.chat_template = old
    assert [(s["answered"], s["template_refused"]) for s in stats] == [(3, 1), (0, 1)]
    assert {r["meta"]["prompt_id"] for r in prompts.read_jsonl_tail_safe(out)} == {
        c.id for c in asks(3)}
    warned = capsys.readouterr().err
    assert f"prompt {refused.id} skipped" in warned and "System role not supported" in warned
