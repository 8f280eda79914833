"""Doctor review, fourteenth pass: a damaged draftsmith-layout drafter folder is refused in one
line naming its file before the target loads, as generate and bench refuse their --drafter
(`eagle3.check_drafter`); a bad value (num_layers 2.0, an unknown key, no aux_layer_ids) or a
cut weights file came out only after the target loaded, as a `loads` finding."""

from __future__ import annotations

import pytest
from test_cli_review import run_main
from test_cli_review8 import HOWS, _damaged, good  # noqa: F401 - a fixture
from test_compare_review8 import no_target  # noqa: F401 - a fixture


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("where", ["--target", "recorded", "--no-run"])
def test_doctor_refuses_a_damaged_drafter_before_the_target(monkeypatch, capsys, target,
                                                            good, tmp_path, no_target,  # noqa: F811
                                                            how, where):
    d, named = _damaged(good, tmp_path, how)
    args = ["doctor", "--drafter", str(d)]
    args += {"--target": ["--target", str(target.folder)], "recorded": [],
             "--no-run": ["--target", str(target.folder), "--no-run"]}[where]
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"draftsmith: error: {named}"), err


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_engine_folder_with_cut_weights_is_one_line_not_a_traceback(monkeypatch, capsys,
                                                                       target, good, tmp_path,  # noqa: F811
                                                                       fmt):
    """An SGLang or speculators folder whose safetensors file was cut short: a SafetensorError
    traceback from the doctor's size checks, after the target had loaded."""
    from draftsmith.export import export_drafter

    out = export_drafter(good, fmt, tmp_path / fmt, target=str(target.folder))
    weights = next(out.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    code, _, err = run_main(monkeypatch, capsys, "doctor", "--drafter", str(out), "--target",
                            str(target.folder))
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [err.strip()] and str(weights) in err, err
