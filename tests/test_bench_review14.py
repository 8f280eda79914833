"""`draftsmith bench`, fourteenth review: its report goes under runs/ by default, beside
tune's and the demo's (`runs/` is ignored by git), not into a `bench-out` folder of its own."""

from __future__ import annotations

import json

from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)

ARGS = ("--num-prompts", "2", "--batch-size", "2", "--max-new-tokens", "4", "--device", "cpu")


def test_the_report_goes_to_runs_bench_by_default(tiny_llama_dir, drafter_dir,  # noqa: F811
                                                  tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "1",
                 *ARGS)
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "runs" / "bench" / "bench.json").read_text())
    assert [r["setting"] for r in saved["results"]] == ["baseline", "chain 1"]
    assert not (tmp_path / "bench-out").exists()
