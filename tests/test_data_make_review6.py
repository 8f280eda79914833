"""Review 6 of `data make`: a rerun whose answers' sampling or capture settings differ from what
the folder holds is refused before any stage, not after the earlier stages ran (on a real target
a grown --n made its prompts and answers for hours before the refusal)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data.pipeline import make_dataset
from draftsmith.errors import DraftsmithError

KW = dict(batch_size=4, max_len=96, max_new_tokens=8, prompt_tokens=48, vocab_size=16,
          progress=False)


@pytest.fixture(scope="module")
def made(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("review6") / "mk"
    make_dataset(out, 3, target=target, log=lambda s: None, **KW)
    return out


def _files(out) -> dict[str, bytes]:
    return {p: (out / p).read_bytes() for p in ("prompts.jsonl", "answers.jsonl", "make.json",
                                                 "dataset/manifest.json")}


@pytest.mark.parametrize("over, why", [
    ({"temperature": 0.3}, "sampled with --temperature 0.8, this run with --temperature 0.3"),
    ({"max_new_tokens": 12}, "--max-new-tokens 8, this run with --max-new-tokens 12"),
    ({"aux_layers": [0, 1]}, r"different aux_layer_ids \(\[0, 2, 4\] there, \[0, 1\] now\)"),
    ({"max_len": 80}, r"different max_len \(96 there, 80 now\)"),
    ({"dtype": torch.bfloat16}, "different compute_dtype"),
])
def test_a_grown_rerun_with_a_changed_setting_is_refused_before_any_stage(target, made, over,
                                                                          why):
    before, logs = _files(made), []
    with pytest.raises(DraftsmithError, match=why):
        make_dataset(made, 6, target=target, log=logs.append, **(KW | over))
    assert not [line for line in logs if line.startswith("== ")]  # no stage ran
    assert _files(made) == before


def test_settings_the_finished_stages_do_not_depend_on_still_reuse_them(target, made):
    """The precheck refuses no more than the stages do: a finished run reread with another
    --batch-size (the engine's batching, checked only for answers still to make) reuses all."""
    logs: list[str] = []
    make_dataset(made, 3, target=target, log=logs.append, **(KW | {"batch_size": 8}))
    assert "regenerate: reused (3 answers)" in logs and "capture: reused (3 samples)" in logs
