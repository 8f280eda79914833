"""`draftsmith tune` under tensor parallelism, fifth review: a target that cannot be split
refused before any rank starts, one writer of --out under torchrun, and the NCCL sweep's device
refused before its first setting."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_folder
from test_tune_cli import _tiny_pair, invoke_tune
from test_tune_review4 import _fake_measures

import draftsmith.dist
from draftsmith.errors import DraftsmithError
from draftsmith.tune import nccl
from draftsmith.tune.partial import PARTIAL
from draftsmith.tune.tp_targets import refuse_split, source_split_dims

# ---- a target that cannot be split is refused before the ranks start ---------------------------


def _no_launch(monkeypatch) -> None:
    monkeypatch.setattr(draftsmith.dist, "launch_tp", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(draftsmith.dist, "spawn", lambda *a, **k: pytest.fail("spawned"))


@pytest.mark.parametrize(("over", "tp", "why"), [
    ({}, 3, "--tp 3: 4 attention heads do not split over 3 ranks"),
    ({"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8}, 2,
     "--tp 2: 1 kv heads do not split over 2 ranks"),
    ({"intermediate_size": 129}, 2, "--tp 2: 129 intermediate size do not split over 2 ranks"),
])
def test_a_target_that_cannot_split_is_refused_before_any_rank_starts(tmp_path, monkeypatch,
                                                                       over, tp, why):
    """Each of --tp N ranks loaded the target, then one failed in TP.split (7 s for a tiny
    target on CPU, minutes for a real one on GPUs), the error coming from inside a rank."""
    folder = write_tiny_folder(tmp_path / "t", "llama", **over)
    _no_launch(monkeypatch)
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(folder), "--device",
                      "cpu", "--tp", str(tp), "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == f"{why} (target {folder})"
    assert not (tmp_path / "o").exists()


def test_generate_refuses_a_target_that_cannot_split_before_any_rank_starts(tmp_path,
                                                                           monkeypatch):
    """generate --tp 3 on a 4-head target started its ranks, each loading the target."""
    from typer.testing import CliRunner

    from draftsmith.cli import app

    folder = write_tiny_folder(tmp_path / "t", "llama")
    _no_launch(monkeypatch)
    res = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--target", str(folder),
                                   "--device", "cpu", "--tp", "3"])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == f"--tp 3: 4 attention heads do not split over 3 ranks " \
                                 f"(target {folder})"


def test_split_dims_are_read_without_the_weights(tmp_path, monkeypatch):
    monkeypatch.setattr("draftsmith.targets.hf.read_weights",
                        lambda *a: pytest.fail("weights read"))
    folder = write_tiny_folder(tmp_path / "t", "llama")
    assert source_split_dims(str(folder)) == {"attention heads": 4, "kv heads": 2,
                                              "intermediate size": 128}
    refuse_split(str(folder), 2)  # splits: no error
    with pytest.raises(DraftsmithError, match=r"^.*missing: no such file or folder$"):
        refuse_split(str(tmp_path / "missing"), 2)


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_the_default_targets_gguf_header_gives_its_split_dims():
    """The default (SmolLM2-135M: 9 heads, 3 kv heads) runs on no --tp 2: refused from its
    GGUF header, not after each rank converted or loaded it."""
    try:
        dims = source_split_dims("default")
    except DraftsmithError as e:
        pytest.skip(str(e))
    assert dims == {"attention heads": 9, "kv heads": 3, "intermediate size": 1536}
    with pytest.raises(DraftsmithError, match=r"^--tp 2: 9 attention heads do not split over 2 "):
        refuse_split("default", 2)


# ---- under torchrun one process writes --out ---------------------------------------------------


def _run(tmp_path, folder, prompts, out):
    from draftsmith.tune.cli import run_tune

    return run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu",
                    torch.float32, False, out, max_topk=2, max_draft=5)


def test_a_torchrun_rank_other_than_0_touches_no_file_of_out(tmp_path, monkeypatch):
    """Every process of `torchrun ... tune --tp 1` wrote tune.json, tune.md, tune.png and
    tune.partial.json into one folder (torn JSON where they raced); a kept partial file of
    another tune was read, refused and named by each."""
    folder, prompts = _tiny_pair(tmp_path)
    _fake_measures(monkeypatch, [])
    out = tmp_path / "o"
    out.mkdir()
    (out / PARTIAL).write_text('{"run": {"new_tokens": 99}}')
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    report = _run(tmp_path, folder, prompts, out)
    assert "recommendations" not in report and report["texts"]
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL]
    assert json.loads((out / PARTIAL).read_text()) == {"run": {"new_tokens": 99}}
    monkeypatch.setenv("RANK", "0")
    fresh = tmp_path / "fresh"
    assert _run(tmp_path, folder, prompts, fresh)["recommendations"]
    assert sorted(p.name for p in fresh.iterdir()) == ["tune.json", "tune.md", "tune.png"]


@pytest.mark.parametrize(("tp", "world"), [(1, 2), (2, 4), (2, 1)])
def test_tune_under_torchrun_is_one_tp_group_of_every_process(tmp_path, monkeypatch, tp, world):
    """--tp 1 in each of 2 processes (or 2 groups of 2 in 4) timed the same settings side by
    side on one device, each writing --out: refused before anything loads."""
    _no_launch(monkeypatch)
    monkeypatch.setattr("draftsmith.tune.cli.run_tune", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    res = invoke_tune("--drafter", str(tmp_path), "--device", "cpu", "--tp", str(tp))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception).startswith(f"--tp {tp} under torchrun with WORLD_SIZE={world}: "
                                         f"tune times one tensor-parallel group of every "
                                         f"process; give --tp {world}")


# ---- the NCCL sweep's device -------------------------------------------------------------------


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize(("device", "gpus", "why"), [
    ("cuda:1", 2, "--device cuda:1 with --tp 2: spawned rank r runs on cuda:r; give --device "
                  "cuda"),
    ("cuda:0", 2, "--device cuda:0 with --tp 2: spawned rank r runs on cuda:r"),
    ("cuda", 1, "--tp 2 on cuda needs 2 CUDA devices, one a rank; 1 visible"),
])
def test_tune_nccl_refuses_a_device_its_ranks_cannot_take_before_any_setting(
        tmp_path, monkeypatch, device, gpus, why):
    """Each setting's spawned ranks refused --device cuda:1 (rank r runs on cuda:r): all 14
    recorded as failed with that line, and an nccl.json of failures written."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune.cli import tune_nccl

    _gpus(monkeypatch, gpus)
    monkeypatch.setattr(nccl, "spawn", lambda *a, **k: pytest.fail("spawned"))
    out = tmp_path / "n"
    app = typer.Typer()
    app.command()(tune_nccl)
    res = CliRunner().invoke(app, ["--target", "tiny", "--tp", "2", "--device", device, "--out",
                                   str(out)])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception).startswith(why)
    assert not out.exists()


def test_the_sweeps_parent_reads_a_checkpoints_config_without_its_weights(tmp_path,
                                                                          monkeypatch):
    """`tune-nccl --target FOLDER` loaded every weight in the parent (an 8B checkpoint: 16 GB
    held beside the ranks' own) to read three sizes and a layer count."""
    from draftsmith.tune.tp_targets import TargetSpec

    folder = write_tiny_folder(tmp_path / "t", "llama")
    monkeypatch.setattr("draftsmith.targets.hf.read_weights",
                        lambda *a: pytest.fail("weights read"))
    cfg = TargetSpec(str(folder)).config()
    assert (cfg.num_heads, cfg.num_layers, cfg.intermediate_size) == (4, 6, 128)


# ---- a failed write keeps the report there -----------------------------------------------------

FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from draftsmith.errors import DraftsmithError
from draftsmith.tune.cli import attach_nccl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (80, 80))  # a disk that fills after 80 bytes a file
try:
    attach_nccl(Path(sys.argv[1]), {"recommendation": {"per_shape": [], "overall": None,
                                                       "note": "x" * 200}})
except DraftsmithError as e:
    print(e)
"""


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_a_full_disk_while_the_nccl_sweep_is_named_keeps_tune_json_whole(tmp_path):
    """`tune --nccl-sweep` rewrote tune.json in place to name its sweep: a disk that filled
    mid-write left it torn (the whole tune's report lost) and raised a bare OSError."""
    import subprocess
    import sys

    out = tmp_path / "o"
    out.mkdir()
    before = json.dumps({"recommendations": [], "nccl": None})
    (out / "tune.json").write_text(before)
    (out / "tune.md").write_text("x\n")
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(out)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{out / 'tune.json'}: cannot write it" in run.stdout
    assert (out / "tune.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["tune.json", "tune.md"]
