"""`draftsmith tune` end to end on CPU: tiny target, random drafter; a report per batch."""

from __future__ import annotations

import json

import torch
from conftest import write_tiny_folder


def test_tune_writes_a_recommendation_per_batch(tmp_path):
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target
    from draftsmith.tune.cli import run_tune

    folder = write_tiny_folder(tmp_path / "t", "llama")
    target = load_target(folder)
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(target.cfg, 64, [0, 2, 4])
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.zeros(64, dtype=torch.long), torch.arange(128) < 64)
    drafter.embed_tokens.weight.data.copy_(target.weights["model.embed_tokens.weight"])
    save_drafter(drafter, tmp_path / "d")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"hello {i}"}) for i in range(3)))
    out = tmp_path / "tune"
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu",
                      torch.float32, False, out, max_topk=2)
    recs = report["recommendations"]
    assert [r["batch"] for r in recs] == [1, 2]
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["best_measured_tok_s"] is not None
        assert r["tokens_per_s"] == r["best_measured_tok_s"]  # measured best wins
    assert (out / "tune.png").stat().st_size > 1000
    assert "--speculative-num-steps" in (out / "tune.md").read_text() or any(
        "no speculation" in t for t in report["texts"]
    )
