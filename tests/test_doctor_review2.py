"""Doctor review 2: exported folders edited after export, stored states holding NaN/inf."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import test_doctor as td
import torch
from test_doctor import TRUE, doctor, errors

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5, a drafter
target_dir, target, data_dir, work, good = td.target_dir, td.target, td.data_dir, td.work, td.good


@pytest.fixture(scope="module")
def exported(good, target_dir, tmp_path_factory) -> dict[str, Path]:
    from draftsmith.export import export_drafter

    root = tmp_path_factory.mktemp("exported")
    return {fmt: export_drafter(good, fmt, root / fmt, target=str(target_dir))
            for fmt in ("sglang", "speculators")}


@pytest.mark.parametrize(("fmt", "engine", "nested", "ids", "fed", "fix"), [
    ("sglang", "sglang", True, [2, 4, 6], "[2, 4, 6]", "[1, 3, 5]"),  # a layer late for SGLang
    ("speculators", "vllm", False, [1, 3, 5], "[0, 2, 4]", "[2, 4, 6]"),  # canonical as vLLM's
    ("sglang", "vllm", False, [1, 3, 5], "[0, 2, 4]", "[2, 4, 6]"),
])
def test_an_exported_folder_edited_off_by_one_fails_without_data(
        exported, target_dir, tmp_path,
        fmt, engine, nested, ids, fed, fix):
    """The seed's edit to an exported config.json passed (exit 0) unless --data was given,
    though the folder records the canonical ids the drafter was trained on."""
    folder = tmp_path / fmt
    shutil.copytree(exported[fmt], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (cfg["eagle_config"] if nested else cfg)["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(cfg))
    rep = doctor(drafter=folder, target=str(target_dir), engine=engine)
    (f,) = [f for f in errors(rep, "wiring") if "will feed" in f.what]
    assert f"canonical layers {fed}" in f.what and "records it was trained on [1, 3, 5]" in f.what
    assert f.fix.endswith(f"in config.json: {fix}") and rep.exit_code() == 1
    assert rep.context["drafter"]["aux_layer_ids (canonical, recorded at export)"] == TRUE
    assert doctor(drafter=exported[fmt], target=str(target_dir), engine=engine).problems() == []


def edit_shards(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of dataset `src` whose shards' tensors `edit` changes in place, with the
    manifest's sizes and checksums updated (so only the doctor's live match can tell)."""
    from safetensors import safe_open
    from safetensors.torch import save

    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    for s in m["shards"]:
        path = dst / s["file"]
        with safe_open(str(path), framework="pt") as f:
            t, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
        edit(t)
        raw = save(t, metadata=meta)
        path.write_bytes(raw)
        s.update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _poison(src: Path, dst: Path, slot: int | None, every: int) -> Path:
    """A copy of `src` whose aux[slot] (None: the final hidden) holds NaN at every `every`-th
    token: a float16 capture that overflowed."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        if slot is None:
            t["hidden"][::every] = float("inf")
        else:
            t["aux"][::every, slot] = float("nan")

    return edit_shards(src, dst, edit)


def test_stored_states_holding_nan_or_inf_are_an_error(data_dir, target_dir, tmp_path):
    """A final hidden with inf at half its tokens matched 'exact' (the median skipped them)
    and the doctor said OK; an aux slot all NaN 'matched no live layer' with a fix blaming the
    target; the JSON held NaN literals that strict readers refuse."""
    bad = _poison(data_dir, tmp_path / "inf", None, 2)
    rep = doctor(data=bad, target=str(target_dir))
    (f,) = rep.errors()
    assert f.what.startswith("the stored final hidden holds NaN/inf at ")
    assert "--dtype bfloat16" in f.fix and rep.exit_code() == 1
    assert rep.wiring["true_ids"] == TRUE  # the finite tokens still name the layers
    bad = _poison(data_dir, tmp_path / "nan", 1, 1)
    rep = doctor(data=bad, target=str(target_dir))
    (f,) = rep.errors()
    assert f.what.startswith("aux[1] holds NaN/inf at ") and "--target" not in f.fix
    slot = rep.wiring["slots"][1]
    assert slot["status"] == "nonfinite" and slot["rel_err"] is None
    json.loads(json.dumps(rep.to_dict(), default=str),
               parse_constant=lambda c: pytest.fail(f"{c} in the JSON report"))


def test_nonfinite_matrix_renders(data_dir, target_dir, tmp_path):
    import io

    from rich.console import Console

    from draftsmith.doctor.render import show

    rep = doctor(data=_poison(data_dir, tmp_path / "nan", 0, 1), target=str(target_dir))
    buf = io.StringIO()
    show(rep, Console(file=buf, width=220))
    assert "- / -" in buf.getvalue() and "1 error(s)" in buf.getvalue()


def test_an_sglang_folder_is_checked_for_vllm_too_when_it_writes_vllm_ids(
        exported, data_dir, target_dir, tmp_path):
    """Export writes a top-level key for vLLM into the SGLang layout (vLLM loads it too); with it
    off by one, the doctor without --engine checked SGLang alone and said OK, even with --data."""
    folder = tmp_path / "sg"
    shutil.copytree(exported["sglang"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = TRUE
    (folder / "config.json").write_text(json.dumps(cfg))
    rep = doctor(data=data_dir, drafter=folder)
    assert rep.context["checked_engines"] == ["sglang", "vllm"]
    (f,) = rep.errors()
    assert f.what.startswith("vllm will feed the drafter canonical layers [0, 2, 4]")
    assert f.fix == "write eagle_aux_hidden_state_layer_ids (top level) in config.json: [2, 4, 6]"
    del cfg["eagle_aux_hidden_state_layer_ids"]  # SpecForge's layout: no key for vLLM, no check
    (folder / "config.json").write_text(json.dumps(cfg))
    rep = doctor(drafter=folder, target=str(target_dir))
    assert rep.context["checked_engines"] == ["sglang"] and rep.problems() == []
