"""Cross-cutting follow-ups: a recorded default target named by its (cleared) conversion cache
folder resolves to the default everywhere; --seed refused by flag on every command taking it;
the CLI's warnings as one line; --dtype named in its error."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
from test_cli_review import run_main

from draftsmith.errors import DraftsmithError
from draftsmith.targets import default_cache_keys


@pytest.fixture
def gone_cache(tmp_path) -> str:
    """A default's conversion cache folder, as an old drafter or export records it, since
    cleared (another DRAFTSMITH_CACHE, another machine)."""
    keys = sorted(default_cache_keys())
    if not keys:
        pytest.skip("the default target is not installed")
    path = tmp_path / "cache" / "targets" / keys[0]
    assert not path.exists()
    return str(path)


class Loaded:
    fingerprint = "f" * 16


def test_load_recorded_takes_a_cleared_default_cache_folder_as_the_default(monkeypatch,
                                                                           gone_cache):
    """It refused it as "not a file or folder here: pass --target", though load_target knows it."""
    from draftsmith.train import sources

    monkeypatch.setattr(sources, "load_target", lambda src: ("loaded", src))
    got = sources.load_recorded(gone_cache, "the manifest", "a hint")
    assert got == ("loaded", gone_cache)


def test_a_manifest_naming_a_default_cache_folder_names_the_default(gone_cache):
    from draftsmith.train.sources import target_of_dataset

    assert target_of_dataset({"target": {"source": gone_cache}}) == "default"


def test_an_export_recording_a_cleared_default_cache_folder_loads_the_default(
        monkeypatch, tmp_path, gone_cache):
    """recorded_target refused it as "moved or deleted": an import or export without --target
    of an old export failed."""
    import draftsmith.targets as targets
    from draftsmith.export import recorded_target

    loads = []
    monkeypatch.setattr(targets, "load_target", lambda src: loads.append(src) or Loaded())
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"draftsmith": {"target": gone_cache, "target_fingerprint": Loaded.fingerprint}}))
    t, src = recorded_target(folder, DraftsmithError("no --target"))
    assert (src, loads) == ("default", ["default"]) and isinstance(t, Loaded)


@pytest.mark.parametrize("layout", ["draftsmith", "speculators"])
def test_the_doctor_takes_a_drafter_recording_a_cleared_default_cache_folder(tmp_path, layout,
                                                                            gone_cache):
    """draftsmith's own record was passed on as a path (then refused as moved); a speculators
    verifier naming it was dropped (no target known)."""
    from draftsmith.doctor.artifacts import DrafterInfo
    from draftsmith.doctor.run import drafter_target

    config = ({"target_source": gone_cache} if layout == "draftsmith" else
              {"speculators_config": {"verifier": {"name_or_path": gone_cache}}})
    assert drafter_target(DrafterInfo(tmp_path, layout, config)) == "default"


def test_a_foreign_missing_path_is_still_not_the_default(tmp_path):
    from draftsmith.doctor.artifacts import DrafterInfo
    from draftsmith.doctor.run import drafter_target

    gone = str(tmp_path / "targets" / ("0" * 16))
    config = {"speculators_config": {"verifier": {"name_or_path": gone}}}
    assert drafter_target(DrafterInfo(tmp_path, "speculators", config)) is None


SEED_OUT = str(1 << 64)
SEED_ERROR = f"draftsmith: error: --seed must be from -2**63 to 2**64 - 1, got {SEED_OUT}"


def test_bench_refuses_a_seed_torch_cannot_take_before_loading(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "bench", "--drafter", "random", "--device",
                            "cpu", "--temperature", "1", "--seed", SEED_OUT,
                            "--target", "/nowhere", "-o", str(tmp_path / "b"))
    assert (code, err.strip()) == (2, SEED_ERROR)


def test_tune_refuses_a_seed_torch_cannot_take_before_loading(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "tune", "--drafter", str(tmp_path / "d"),
                            "--device", "cpu", "--temperature", "1", "--seed", SEED_OUT,
                            "-o", str(tmp_path / "t"))
    assert (code, err.strip()) == (2, SEED_ERROR)


def test_train_refuses_a_seed_torch_cannot_take_before_loading(monkeypatch, capsys, tmp_path):
    import draftsmith.train as train

    monkeypatch.setattr(train, "train", lambda cfg: pytest.fail("training started"))
    code, _, err = run_main(monkeypatch, capsys, "train", "-o", str(tmp_path / "t"), "--data",
                            str(tmp_path / "none"), "--seed", SEED_OUT)
    assert (code, err.strip()) == (2, SEED_ERROR)


def test_the_server_takes_the_seeds_the_commands_take():
    from draftsmith import options
    from draftsmith.serve import protocol

    assert protocol.SEEDS is options.SEEDS


def _to_stderr(msg) -> None:
    """The standard library's own display (pytest records warnings instead)."""
    (msg.file or sys.stderr).write(warnings._formatwarnmsg(msg))


def test_the_cli_shows_a_warning_as_one_line(monkeypatch, capsys, tmp_path, target):
    """It came out as "/.../speculators.py:155: UserWarning: ..." and the source line."""
    from test_export import make

    d = make(target, tmp_path / "d", aux=[-1, 1, 2])  # the embedding: newer vLLM only
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "_showwarnmsg_impl", _to_stderr)
        code, _, err = run_main(monkeypatch, capsys, "export", str(d), "-f", "speculators",
                                "-o", str(tmp_path / "out"), "--target", str(target.folder))
        lines = [x for x in err.splitlines() if "needs vLLM" in x]
        assert code == 0 and lines and all(x.startswith("draftsmith: warning: id -1 needs vLLM")
                                           for x in lines), err
        assert ".py:" not in err and "UserWarning" not in err
        assert warnings.formatwarning is warnings._formatwarning_orig  # put back after the run


def test_warnings_outside_the_cli_keep_python_s_format():
    text = warnings.formatwarning("hi", UserWarning, "f.py", 3, "")
    assert text.startswith("f.py:3: UserWarning: hi")


def test_a_bad_dtype_names_the_flag_and_its_values(monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "generate", "-p", "hi", "--device", "cpu",
                            "--dtype", "f32", "--target", "/nowhere")
    assert (code, err.strip()) == (2, "draftsmith: error: --dtype f32: use auto, float32, "
                                      "bfloat16 or float16 (fp32, bf16, fp16 for short)")


def test_every_dtype_the_help_names_is_taken():
    from draftsmith.cli import dtype_name

    for name in ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "auto"):
        assert dtype_name("cpu", name)


def test_a_large_train_seed_packs_without_overflow_and_small_ones_keep_their_order():
    """`Plan._pack_epoch` seeded torch with seed * 100_003 + epoch: past ~1.8e14 an overflow
    traceback after the data loaded; the wrap keeps every order a working seed gave."""
    import torch

    from draftsmith.train.batches import Plan

    for seed in (-3, 0, 7):
        got = torch.randperm(9, generator=torch.Generator().manual_seed(
            (seed * 100_003 + 1) % (1 << 64))).tolist()
        assert got == torch.randperm(9, generator=torch.Generator().manual_seed(
            seed * 100_003 + 1)).tolist()
    plan = Plan([5] * 9, 2, 16, 1, 0, 2**60)
    assert plan.steps_per_epoch(0) >= 1


def test_an_export_of_a_drafter_recording_a_default_cache_folder_names_the_default(
        monkeypatch, gone_cache):
    """`layout._recorded_where` wrote the (dead) cache path as the engines' verifier."""
    import draftsmith.targets as targets
    from draftsmith.export import layout

    class T:
        folder, hf_config = "/somewhere/default", {"torch_dtype": "bfloat16"}

    loads = []
    monkeypatch.setattr(targets, "load_target", lambda src: loads.append(src) or T())
    monkeypatch.setattr(layout, "config_dtype", lambda c: c["torch_dtype"])
    assert layout._recorded_where(gone_cache)[1] == "bfloat16" and loads == ["default"]


def test_the_doctors_fingerprint_fix_names_a_default_cache_folder_default(gone_cache):
    from draftsmith.doctor.checks import _hashes

    found = _hashes({"source": gone_cache, "fingerprint": "a"}, {"fingerprint": "b"},
                    "x", "data", "here")
    fixes = " ".join(f.fix for f in found)
    assert "('default')" in fixes and gone_cache not in fixes
