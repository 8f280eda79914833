"""The demo's doctor.json was written with plain json.dumps: a NaN in the doctor's report (a
cosine of an all-zero state) came out as a bare NaN literal that jq and JavaScript refuse."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from draftsmith import demo, doctor
from draftsmith.doctor.report import Finding, Report


def test_the_demos_doctor_json_is_strict(monkeypatch, tmp_path):
    rep = Report(findings=[Finding("warning", "wiring", "a slot matches nothing", "d")],
                 wiring={"best_cosine": float("nan"), "rows": [1.0, float("inf")]})
    monkeypatch.setattr(doctor, "run_doctor", lambda opts: rep)
    monkeypatch.setattr("draftsmith.doctor.render.show", lambda rep: None)
    cfg = SimpleNamespace(out=tmp_path, target="default", device="cpu")
    got = demo.run_doctor(cfg, {"dir": tmp_path / "data"}, Path(tmp_path / "drafter"))
    assert got == {"exit_code": 0, "findings": 1}
    text = (tmp_path / "doctor.json").read_text()
    d = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert d["wiring"] == {"best_cosine": None, "rows": [1.0, None]} and d["exit_code"] == 0
