"""Doctor review 4: a capture of a layer's parts (its stream after attention, before the MLP, or
its MLP output alone: SGLang's `residual` or `hidden_states` without the other) is named as such,
not read as that layer's output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from test_doctor import TRUE, convs, doctor, errors
from test_doctor_review2 import edit_shards

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.targets import load_target


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> Path:
    """A tiny target whose MLPs add little to the stream, as on deep real targets: a layer's
    stream after attention lies within 2 % of its output."""
    from safetensors.torch import load_file, save_file

    folder = write_tiny_folder(tmp_path_factory.mktemp("deep"), "llama", num_hidden_layers=8)
    w = load_file(str(folder / "model.safetensors"))
    for name in w:
        if "mlp.down_proj" in name:
            w[name] *= 0.1
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def good(deep, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    capture(load_target(deep), convs(4), out, CaptureConfig(aux_layer_ids=TRUE, max_len=96),
            progress=False, log=lambda s: None)
    return out


def _parts(model, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Each layer's stream after attention, MLP output and output, by hand (no hooks)."""
    pos = torch.arange(ids.numel()).view(1, -1)
    cos, sin = model.rope(pos, torch.float32)
    h = model.embed(ids.view(1, -1))
    out: dict[str, list[torch.Tensor]] = {"mid": [], "mlp": [], "out": []}
    for layer in model.layers:
        mid = h + layer.attn(layer.input_norm(h), cos, sin, None, None, None)
        mlp = layer.mlp(layer.post_norm(mid))
        h = mid + mlp
        for k, v in (("mid", mid), ("mlp", mlp), ("out", h)):
            out[k].append(v[0])
    return out


@torch.no_grad()
def _fabricate(src: Path, dst: Path, target_dir: Path, slot: int | None, part: str) -> Path:
    """A copy of `src` whose aux[slot] (None: the final hidden, from the last layer) holds that
    layer's `part` instead of its output."""
    model = load_target(target_dir).build(torch.float32)

    def edit(t: dict[str, torch.Tensor]) -> None:
        off = t["offsets"].tolist()
        for a, b in zip(off, off[1:], strict=False):
            got = _parts(model, t["input_ids"][a:b].long())
            stored = t["aux"][a:b, 1].float()  # the hand-run layers are the target's own
            assert (stored - got["out"][TRUE[1]]).norm() < 0.01 * stored.norm()
            if slot is None:
                t["hidden"][a:b] = got[part][-1].bfloat16()
            else:
                t["aux"][a:b, slot] = got[part][TRUE[slot]].bfloat16()

    return edit_shards(src, dst, edit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mid_layer_capture_is_named_not_read_as_its_layer(deep, good, tmp_path, dtype):
    """Data holding layer 3's stream after attention (SGLang's `residual` alone) read as layer 3
    "exact" on a target whose MLPs add little: OK, exit 0, and a drafter trained on it."""
    bad = _fabricate(good, tmp_path / "mid", deep, 1, "mid")
    rep = doctor(data=bad, target=str(deep), dtype=dtype)
    slot = rep.wiring["slots"][1]
    assert (slot["best"], slot["status"], slot["best_id"]) == (
        "layer 3 after attention", "mid-layer", None)
    assert slot["nearest_residual"] == "layer 3" and rep.wiring["true_ids"] == [1, None, 5]
    (f,) = errors(rep)
    assert f.what.startswith("aux[1] holds layer 3's stream after attention, before its MLP")
    assert f.fix.startswith("recapture storing hidden_states + residual, layer 3's output")
    assert rep.exit_code() == 1 and "true_aux_layer_ids" not in rep.context
    rep = doctor(data=good, target=str(deep), dtype=dtype)
    assert rep.problems() == [] and rep.wiring["true_ids"] == TRUE
    main = len(rep.wiring["row_kinds"]) - 2 * 8
    for k, s in enumerate(rep.wiring["slots"]):
        assert s["status"] == "exact" and s["best_kind"] in ("residual", "final norm")
        parts = [row[k] for row in rep.wiring["rel_err"][main:]]
        assert min(parts) > s["rel_err"]  # bf16: 1.4x for layer 5, whose MLP adds ~1 %


def test_an_mlp_output_capture_is_named_not_blamed_on_the_target(deep, good, tmp_path):
    """Layer 3's MLP output alone (SGLang's `hidden_states` without `residual`) 'matched no
    live layer' with a fix saying the data was from another target."""
    rep = doctor(data=_fabricate(good, tmp_path / "mlp", deep, 1, "mlp"), target=str(deep))
    (f,) = errors(rep)
    assert f.what.startswith("aux[1] holds layer 3's MLP output alone") and "--target" not in f.fix
    assert rep.wiring["slots"][1]["status"] == "mlp-output"


def test_a_final_hidden_without_the_last_mlp_is_an_error(deep, good, tmp_path):
    rep = doctor(data=_fabricate(good, tmp_path / "hid", deep, None, "mid"), target=str(deep))
    (f,) = errors(rep)
    assert f.what.startswith("the stored final hidden best matches layer 7 after attention")
    assert rep.wiring["true_ids"] == TRUE


def test_part_rows_render_only_where_matched_and_json_is_strict(deep, good, tmp_path):
    from rich.console import Console

    from draftsmith.doctor.render import show

    buf = io.StringIO()
    show(doctor(data=good, target=str(deep)), Console(file=buf, width=220))
    assert "after attention" not in buf.getvalue().split("also compared")[0]
    assert "also compared: 16 layer parts" in buf.getvalue()
    rep = doctor(data=_fabricate(good, tmp_path / "mid", deep, 2, "mid"), target=str(deep))
    buf = io.StringIO()
    show(rep, Console(file=buf, width=220))
    table = buf.getvalue().split("also compared")[0]
    assert "layer 5 after attention" in table and "layer 4 after attention" not in table
    w = json.loads(json.dumps(rep.to_dict()))["wiring"]
    assert len(w["rows"]) == len(w["row_ids"]) == len(w["row_kinds"]) == len(w["rel_err"]) == 26
    assert w["row_kinds"][10:12] == ["after attention"] * 2 and w["row_layers"][25] == 7
