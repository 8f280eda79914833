"""Doctor review 18: wiring mistakes a user of SGLang, vLLM, SpecForge or speculators meets, each
named by its real cause. Shards whose input_ids sit one token off their hidden states (a label
shift, a BOS dropped or added on re-tokenization) read as "not captured from this target"."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_doctor as td
import torch
from test_doctor import TRUE, doctor, errors
from test_doctor_review2 import edit_shards

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5
target_dir, target, data_dir = td.target_dir, td.target, td.data_dir


def _shifted(src: Path, dst: Path, by: int) -> Path:
    """`src` with each shard's input_ids rolled by `by` against the states (1: the ids one token
    behind, as after a BOS prepended; -1: one ahead, the first token dropped, as labels are)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        ids = t["input_ids"]
        ids[:] = torch.roll(ids, by)
        if by < 0:
            ids[-1] = 0
    return edit_shards(src, dst, edit)


@pytest.mark.parametrize(("by", "way", "fix"), [
    (1, "one token behind", "input_ids[1:] beside the states [:-1]"),
    (-1, "one token ahead of", "the dropped first token 3 prepended to input_ids[:-1]"),
])
def test_ids_one_token_off_their_states_are_named_not_blamed_on_the_target(
        data_dir, target_dir, tmp_path, by, way, fix):
    """Four errors said "the data was not captured from this target ... check --target"."""
    rep = doctor(data=_shifted(data_dir, tmp_path / "s", by), target=str(target_dir))
    (f,) = errors(rep, "wiring")
    assert f.what.startswith(f"the shards' input_ids run {way} their hidden states: "
                             "every stored state matches the live one of the token")
    assert f.fix.startswith("recapture (`draftsmith data capture` stores them aligned), or "
                            f"realign each sample: {fix}")
    assert "--target" not in f.fix and rep.exit_code() == 1
    assert rep.wiring["token_shift"] == by and rep.wiring["true_ids"] == TRUE


def test_aligned_data_and_data_of_another_target_report_no_shift(data_dir, target_dir,
                                                                 tmp_path):
    from conftest import write_tiny_folder

    assert doctor(data=data_dir, target=str(target_dir)).wiring["token_shift"] is None
    other = write_tiny_folder(tmp_path / "other", "llama", seed=1, num_hidden_layers=8)
    rep = doctor(data=data_dir, target=str(other))
    assert rep.wiring["token_shift"] is None
    assert not any("input_ids run" in f.what for f in rep.findings)


@pytest.mark.parametrize(("engine", "ids", "words"), [
    ("sglang", [1, 3, 8], "SGLang reads [1, 3, 8] as the outputs of layers [1, 3, 8]: id 8 is "
     "out of range for this target"),
    ("vllm", [-1, 1, 3], "vLLM reads [-1, 1, 3] as the inputs of layers [-1, 1, 3]: id -1 is "
     "out of range for this target"),
    ("vllm", [2, 4, 9], "vLLM reads [2, 4, 9] as the inputs of layers [2, 4, 9]: id 9 is out "
     "of range for this target"),
])
def test_ids_naming_no_layer_say_how_the_engine_reads_them(data_dir, target, tmp_path, engine,
                                                           ids, words):
    """The seed's wrong fix, the embedding as id -1 in SGLang's config, read "[-1, 1, 3] out
    of range for this target: aux layer ids [-2] out of range: canonical ids ... must lie in
    [-1, 7]": a -2 the user never wrote."""
    from test_doctor import make_drafter, sglang_folder

    src = make_drafter(tmp_path / "good", target, TRUE)
    nested, top = (ids, None) if engine == "sglang" else (None, ids)
    folder = sglang_folder(tmp_path, src, nested, top)
    rep = doctor(data=data_dir, drafter=folder, engine=engine)
    (f,) = [f for f in errors(rep, "wiring") if f.what.startswith(f"{engine}: ")]
    assert f.what.startswith(f"{engine}: {words} (8 layers: it would fail to load the drafter)")
    assert "[-2]" not in f.what and "canonical ids" not in f.what
    assert f.fix.endswith(f"{[1, 3, 5] if engine == 'sglang' else [2, 4, 6]}")
    if -1 in ids:
        assert f.what.endswith("the embedding output is id 0 for vLLM; SGLang cannot capture "
                               "it")
