"""compare, fourth review: a speculators folder without lm_head weights, whose head vLLM takes
from the target, was counted as holding a head of 0 parameters."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file
from test_compare import H, V, build, speculators_folder

from draftsmith.compare.describe import describe
from draftsmith.compare.report import _params


def _headless(target, root: Path, name: str, dv: int) -> Path:
    folder = speculators_folder(build(target, 128, dv, [1, 2, 3], 0), root / name, target)
    w = load_file(folder / "model.safetensors")
    del w["lm_head.weight"]
    save_file(w, str(folder / "model.safetensors"))
    return folder


def test_vllm_shares_the_targets_head_with_a_headless_speculators_folder(target, tmp_path):
    """vLLM's Eagle3LlamaForCausalLM marks a checkpoint without lm_head weights as having no
    head of its own, and the EAGLE proposer then shares the target's lm_head."""
    full = describe(_headless(target, tmp_path, "full", V), "full").params
    assert full.lm_head == V * H and full.lm_head_source == "shared"
    assert full.trainable == full.core + V * H and full.all == full.trainable + V * H
    row = {r[0]: r[1:] for r in _params([{"params": full.to_dict()}])}
    assert row["lm_head (as the engine serves it)"] == [
        f"{V * H:,} (the target's lm_head, not stored (vLLM shares the target's))"]


def test_a_headless_speculators_folder_with_a_draft_vocab_is_named_a_misfit(target, tmp_path):
    """With a draft vocabulary smaller than the target's, the shared head's rows are the whole
    vocabulary's: the table says so instead of a head of 0 parameters."""
    small = describe(_headless(target, tmp_path, "small", 32), "small").params
    assert small.lm_head_source == "shared_misfit" and small.lm_head == V * H
    row = {r[0]: r[1:] for r in _params([{"params": small.to_dict()}])}
    served = row["lm_head (as the engine serves it)"][0]
    assert "does not fit the smaller draft vocabulary" in served


def test_a_speculators_folder_that_stores_its_head_counts_it(target, tmp_path):
    folder = speculators_folder(build(target, 128, 32, [1, 2, 3], 0), tmp_path / "sp", target)
    p = describe(folder, "sp").params
    assert p.lm_head_source == "stored" and p.lm_head == 32 * H
