"""What travels to and from the lent GPU (benchmarks/gpu_suite.py): a kept drafter and packed
answers come back in parts small enough for the device's file limit and are rebuilt exactly."""

from __future__ import annotations

import importlib.util
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.bench.drafters import random_drafter
from draftsmith.models.eagle3 import load_drafter, save_drafter
from draftsmith.targets import load_target

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


@pytest.fixture
def suite(monkeypatch, tmp_path, tiny_llama_dir):
    monkeypatch.setenv("DEVICE", "cpu")
    monkeypatch.setenv("TARGET", str(tiny_llama_dir))
    spec = importlib.util.spec_from_file_location("gpu_suite_under_test", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "OUT", tmp_path / "out")
    monkeypatch.setattr(mod, "PART_BYTES", 40_000)  # several parts from a tiny drafter
    (tmp_path / "out").mkdir()
    return mod


@pytest.fixture
def drafter_dir(tmp_path, tiny_llama_dir):
    t = load_target(tiny_llama_dir)
    embed = t.weights["model.embed_tokens.weight"].float()
    d = random_drafter(t.cfg, torch.device("cpu"), torch.float32, embed=embed, seed=5)
    return save_drafter(d, tmp_path / "drafter")


def same_weights(a: Path, b: Path) -> None:
    x, y = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert x.keys() == y.keys()
    for k in x:
        want = x[k].bfloat16() if x[k].is_floating_point() else x[k]  # kept as bf16
        assert torch.equal(y[k].to(want.dtype), want), k


def test_kept_drafter_comes_back_in_parts_and_restores(suite, drafter_dir, tmp_path,
                                                       monkeypatch):
    monkeypatch.setattr(suite, "DRAFTER", drafter_dir)
    res = suite.keep_stage()
    kept = tmp_path / "out" / "drafter"
    parts = sorted(kept.glob("weights.safetensors.xz.*"))
    assert res["weight_parts"] == len(parts) >= 2
    assert all(p.stat().st_size <= 40_000 for p in parts)
    monkeypatch.setenv("KEPT", str(kept))
    monkeypatch.setattr(suite, "DRAFTER", tmp_path / "restored")
    assert suite.restore_stage()["restored"]
    same_weights(drafter_dir, tmp_path / "restored")
    parts[-1].unlink()  # a part lost on the way: a clear failure, not a wrong drafter
    monkeypatch.setattr(suite, "DRAFTER", tmp_path / "again")
    with pytest.raises(Exception, match="[Cc]ompressed|[Ii]nput|end"):
        suite.restore_stage()


def test_restore_replaces_a_drafter_restored_from_another_kept_folder_not_a_trained_one(
        suite, drafter_dir, tmp_path, monkeypatch):
    """Two kept drafters measured one after another on a warm machine: the second restore
    must not answer with the first drafter; a drafter trained in place is never replaced."""
    monkeypatch.setattr(suite, "DRAFTER", drafter_dir)
    suite.keep_stage()
    first = tmp_path / "kept1"
    (tmp_path / "out" / "drafter").rename(first)
    t = load_target(suite.TARGET)
    other = random_drafter(t.cfg, torch.device("cpu"), torch.float32,
                           embed=t.weights["model.embed_tokens.weight"].float(), seed=6)
    monkeypatch.setattr(suite, "DRAFTER", save_drafter(other, tmp_path / "other"))
    suite.keep_stage()
    second = tmp_path / "out" / "drafter"
    monkeypatch.setattr(suite, "DRAFTER", tmp_path / "restored")
    monkeypatch.setenv("KEPT", str(first))
    assert suite.restore_stage()["restored"]
    assert not suite.restore_stage()["restored"]  # the same folder again: nothing to do
    monkeypatch.setenv("KEPT", str(second))
    assert suite.restore_stage()["restored"]
    same_weights(tmp_path / "other", tmp_path / "restored")
    monkeypatch.setattr(suite, "DRAFTER", drafter_dir)  # trained here: no marker
    before = (drafter_dir / "model.safetensors").read_bytes()
    assert not suite.restore_stage()["restored"]
    assert (drafter_dir / "model.safetensors").read_bytes() == before


def test_restore_still_reads_the_two_file_layout(suite, drafter_dir, tmp_path, monkeypatch):
    state = load_drafter(drafter_dir).state_dict()
    state.pop("embed_tokens.weight")
    state = {k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()}
    old = tmp_path / "old"
    old.mkdir()
    keys = sorted(state)
    for name, part in (("a", keys[: len(keys) // 2]), ("b", keys[len(keys) // 2 :])):
        save_file({k: state[k].contiguous() for k in part}, str(old / f"model_{name}.safetensors"))
    (old / "draftsmith.json").write_text((drafter_dir / "draftsmith.json").read_text())
    monkeypatch.setenv("KEPT", str(old))
    monkeypatch.setattr(suite, "DRAFTER", tmp_path / "restored")
    assert suite.restore_stage()["restored"]
    same_weights(drafter_dir, tmp_path / "restored")


def test_packed_answers_unpack_byte_for_byte(suite, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    rng = random.Random(0)
    text = "".join(f'{{"id": "{i}", "messages": [{{"role": "user", "content": '
                   f'"{rng.getrandbits(128):x}"}}]}}\n' for i in range(3000))
    (work / "answers.jsonl").write_text(text)
    monkeypatch.setattr(suite, "WORK", work)
    res = suite.pack_stage()
    assert res["parts"] >= 2
    monkeypatch.setattr(suite, "WORK", tmp_path / "work2")
    monkeypatch.setenv("DATA_PARTS", str(tmp_path / "out"))
    assert suite.unpack_stage()["conversations"] == 3000
    assert (tmp_path / "work2" / "answers.jsonl").read_text() == text


def test_a_part_found_in_two_folders_is_read_once(suite, tmp_path, monkeypatch):
    """Call 0 copies a part to /tmp/data and the device keeps the carried copy too: the answers
    must not come back twice (2026-12-01: 96,000 conversations unpacked from 48,000). The first
    folder listed holds the copy that is read."""
    work = tmp_path / "work"
    work.mkdir()
    text = "".join(f'{{"id": "{i}", "messages": []}}\n' for i in range(50))
    (work / "answers.jsonl").write_text(text)
    monkeypatch.setattr(suite, "WORK", work)
    assert suite.pack_stage()["parts"] == 1
    copy, stale = tmp_path / "copy", tmp_path / "stale"
    copy.mkdir()
    stale.mkdir()
    shutil.copy(tmp_path / "out" / "answers.jsonl.xz.00", copy)
    (stale / "answers.jsonl.xz.00").write_bytes(b"not xz")  # a later folder's copy is not read
    monkeypatch.setattr(suite, "WORK", tmp_path / "work2")
    monkeypatch.setenv("DATA_PARTS", f"{copy}:{tmp_path / 'out'}:{stale}")
    res = suite.unpack_stage()
    assert (res["parts"], res["conversations"]) == (1, 50)
    assert (tmp_path / "work2" / "answers.jsonl").read_text() == text


def test_two_packed_datasets_unpack_one_after_the_other(suite, tmp_path, monkeypatch):
    """A second generation (another SEED) packs under its own stem; unpack joins both datasets,
    each from its own parts, in stem order; a bad stem is refused."""
    texts = {}
    for stem, n in (("answers", 40), ("answers-s1", 30)):
        work = tmp_path / stem
        work.mkdir()
        texts[stem] = "".join(f'{{"id": "{stem}{i}", "messages": []}}\n' for i in range(n))
        (work / "answers.jsonl").write_text(texts[stem])
        monkeypatch.setattr(suite, "WORK", work)
        monkeypatch.setenv("PACK_STEM", stem)
        assert suite.pack_stage()["parts"] >= 1
    monkeypatch.setenv("PACK_STEM", "other.jsonl")
    with pytest.raises(SystemExit, match="PACK_STEM"):
        suite.pack_stage()
    monkeypatch.setattr(suite, "WORK", tmp_path / "joined")
    monkeypatch.setenv("DATA_PARTS", str(tmp_path / "out"))
    res = suite.unpack_stage()
    assert res["datasets"] == ["answers", "answers-s1"] and res["conversations"] == 70
    joined = (tmp_path / "joined" / "answers.jsonl").read_text()
    assert joined == texts["answers"] + texts["answers-s1"]


def test_spec_stage_checks_every_repeated_row_against_plain_greedy(suite, drafter_dir, monkeypatch):
    """REPEATS decodes each prompt again: the greedy check covers every row it decoded, counts
    them as rows (not prompts), and fp32 speculative rows equal plain greedy ones."""
    monkeypatch.setattr(suite, "DRAFTER", drafter_dir)
    monkeypatch.setattr(suite, "SPEC_BATCHES", [1])
    monkeypatch.setattr(suite, "NEW", 12)
    for var, value in {"PROMPTS": "3", "REPEATS": "2", "SUITES": "chat", "CHAIN": "2",
                       "TREES": "2/2/4",
                       "DRAFTSMITH_HOST_TIMING": "1"}.items():  # restored after, not leaked
        monkeypatch.setenv(var, value)
    rows = suite.spec_stage()["rows"]
    assert [r["setting"] for r in rows] == ["baseline", "2/1/3", "2/2/4"]
    for r in rows[1:]:
        assert r["greedy_agreement"] == {"rows": 6, "distinct_prompts": 3, "diverged": 0,
                                         "top2_gaps_at_divergence": []}
    model = load_target(suite.TARGET).build(torch.float32, "cpu")
    g = suite.agreement(model, [[[1, 2, 3]], [[1, 2, 3]]], [[7, 8], [9]], [[7, 6], [9, 5]], [])
    assert (g["rows"], g["distinct_prompts"], g["diverged"]) == (2, 1, 2)  # a longer row too
    assert len(g["top2_gaps_at_divergence"]) == 2
    with pytest.raises(ValueError):  # a row without its prompt is an error, not skipped
        suite.agreement(None, [[[1, 2]]], [[3], [4]], [[3], [4]], [])
