"""Doctor review 3: its cost on large datasets (which shards it hashes), shard dtypes, and
vLLM's reading of an empty id list."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_doctor as td
from test_data_shards import _rewrite
from test_doctor import TRUE, convs, doctor, errors, make_drafter, sglang_folder

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5, a drafter
target_dir, target, data_dir, work, good = td.target_dir, td.target, td.data_dir, td.work, td.good


@pytest.fixture(scope="module")
def many(target, tmp_path_factory) -> Path:
    """Ten shards of one sample each."""
    from draftsmith.data.capture import CaptureConfig, capture

    out = tmp_path_factory.mktemp("many")
    cfg = CaptureConfig(aux_layer_ids=TRUE, batch_size=6, samples_per_shard=1, max_len=96)
    capture(target, convs(10), out, cfg, progress=False, log=lambda s: None)
    return out


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    import draftsmith.data.shards as shards

    names: list[str] = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: names.append(p.name) or real(p))
    return names


def _flip(folder: Path, k: int) -> None:
    path = folder / f"shard-{k:05d}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # same size: only its hash tells
    path.write_bytes(bytes(raw))


def test_the_doctor_hashes_only_the_shards_it_reads(many, target_dir, tmp_path, hashed):
    """Every run hashed every shard before any wiring result: minutes on hundreds of GB."""
    rep = doctor(data=many, target=str(target_dir), samples=2)
    assert hashed == ["shard-00000.safetensors", "shard-00009.safetensors"] and rep.ok
    assert rep.context["data"]["checked"] == (
        "size, shapes and dtypes of all 10 shards; sha256 of the 2 it reads samples from "
        "(shard-00000.safetensors, shard-00009.safetensors); --full-verify hashes all")
    bad = tmp_path / "bad"
    shutil.copytree(many, bad)
    _flip(bad, 2)
    assert doctor(data=bad, target=str(target_dir), samples=2).ok  # as its report says
    hashed.clear()
    rep = doctor(data=bad, target=str(target_dir), samples=2, full_verify=True)
    assert len(hashed) == 3 and "sha256 of all 10 shards" in rep.context["data"]["checked"]
    (f,) = errors(rep, "shards")
    assert "shard-00002.safetensors: sha256" in f.what
    cut = bad / "shard-00003.safetensors"
    cut.write_bytes(cut.read_bytes()[:-10])
    (f,) = errors(doctor(data=bad, target=str(target_dir), samples=2), "shards")
    assert "shard-00003.safetensors: " in f.what and "the manifest says" in f.what


def test_a_dtype_is_checked_in_every_shard(many, target_dir, tmp_path):
    """A float16 aux passed the shard check (shapes only); the doctor looked at 8 shards."""
    bad = tmp_path / "fp16"
    shutil.copytree(many, bad)
    _rewrite(bad, 8, aux=lambda t: t.half())  # past the 8 it read; no sample is read there
    (f,) = doctor(data=bad, target=str(target_dir), samples=2).errors()
    assert f.check == "dtype" and "shard-00008" in f.what
    assert "{'aux': 'float16'}, the manifest implies {'aux': 'bfloat16'}" in f.what


def test_the_runs_prompts_read_few_samples_and_their_shards_are_hashed(many, monkeypatch):
    """A dataset whose prompts all run past 512 tokens (long system prompts) was read whole,
    hidden states too, for prompts it never found."""
    from draftsmith.data.shards import Dataset
    from draftsmith.doctor import behaviour
    from draftsmith.doctor.run import read_shards

    ds = Dataset(many)
    monkeypatch.setattr(Dataset, "__getitem__", lambda *a: pytest.fail("states read"))
    prompts, scanned = behaviour.data_prompts(ds, 2, 512)
    assert len(prompts) == 2 and scanned == 2 and read_shards(ds, 1, scanned) == [0, 1]
    monkeypatch.setattr(behaviour, "PROMPT_SCAN", 2)
    assert behaviour.data_prompts(ds, 1, 3) == ([], 2)  # every prefix longer than 3 tokens
    assert read_shards(ds, 2, 0) == [0, 9]


def test_full_verify_flag(many, target_dir):
    import typer
    from typer.testing import CliRunner

    from draftsmith.doctor import doctor as command

    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    res = CliRunner().invoke(app, ["doctor", "--data", str(many), "--target", str(target_dir),
                                   "--json", "--no-run", "--samples", "1", "--full-verify"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["context"]["data"]["checked"] == (
        "size, shapes, dtypes and sha256 of all 10 shards")


def _speculators(src: Path, target_dir: Path, out: Path, top: list[int]) -> Path:
    from draftsmith.export import export_drafter

    folder = export_drafter(src, "speculators", out, target=str(target_dir))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = top
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_vllm_reads_an_empty_id_list_as_missing(good, target, target_dir, data_dir, tmp_path):
    """vLLM takes its defaults for `[]` (as `draftsmith import` does); the doctor said "out of
    range for this target" and never said what vLLM would feed."""
    folder = _speculators(good, target_dir, tmp_path / "spec", [])
    rep = doctor(data=data_dir, drafter=folder, target=str(target_dir), engine="vllm")
    assert not any("out of range" in f.what for f in rep.findings)
    (f,) = [f for f in errors(rep, "wiring") if "will feed" in f.what]
    assert "canonical layers [1, 3, 4] but the data holds [1, 3, 5]" in f.what
    assert f.fix.endswith("(top level) in config.json: [2, 4, 6]")
    (note,) = [f for f in rep.findings if f.severity == "info"]
    assert "is an empty list, which vLLM treats as missing" in note.what
    row = next(r for r in rep.engines if r["engine"] == "vllm")
    assert row["feed"]["written"] is None and row["feed"]["canonical"] == [1, 3, 4]
    defaults = make_drafter(tmp_path / "defaults", target, [1, 3, 4])
    folder = _speculators(defaults, target_dir, tmp_path / "spec-defaults", [])
    rep = doctor(drafter=folder, target=str(target_dir), engine="vllm")
    assert rep.ok and [f.severity for f in rep.findings] == ["info"]


def test_vllm_falls_back_to_eagle_config_past_an_empty_top_level_list(good, data_dir, tmp_path):
    folder = sglang_folder(tmp_path, good, TRUE, [])
    rep = doctor(data=data_dir, drafter=folder, engine="vllm")
    (f,) = [f for f in errors(rep, "wiring") if "will feed" in f.what]
    assert "canonical layers [0, 2, 4]" in f.what and "missing or empty" in f.what


def test_a_miscounted_shard_leaves_the_prompt_scan_to_the_next(many, tmp_path):
    """A manifest counting more samples than a shard's offsets hold stopped the doctor's run
    with an IndexError traceback; the shard check names it."""
    from draftsmith.data.shards import Dataset
    from draftsmith.doctor import behaviour

    bad = tmp_path / "miscount"
    shutil.copytree(many, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["shards"][0]["samples"] += 1
    (bad / "manifest.json").write_text(json.dumps(m))
    prompts, scanned = behaviour.data_prompts(Dataset(bad), 1, 512)
    assert len(prompts) == 1 and scanned == 3  # samples 0 and 1 lie in the miscounted shard
