"""Review 7 of `data make`: its draft vocabulary is the one `train --vocab` at the same --max-len
counts, and a rerun whose prompts' settings differ (--seed of greedy answers, --prompt-tokens)
is refused by what differs before any stage."""

from __future__ import annotations

import pytest
import torch
from test_data_make_review6 import KW as REVIEW6_KW
from test_data_make_review6 import _files

from draftsmith.data.pipeline import make_dataset
from draftsmith.data.shards import Dataset
from draftsmith.data.vocab import count_dataset, count_pairs, load_vocab
from draftsmith.errors import DraftsmithError

KW = {**REVIEW6_KW, "temperature": 0.0}


@pytest.fixture(scope="module")
def made(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("review7") / "mk"
    make_dataset(out, 3, target=target, log=lambda s: None, **KW)
    return out


def test_the_vocab_is_the_one_train_counts_within_the_same_max_len(target, made):
    """`train --vocab DIR/dataset/vocab.safetensors --max-len L` (the README's recipe passes
    data make's --max-len) trains on tokens within L: capture cut every sample there, so data
    make's count over whole samples is train's `count_pairs` at L."""
    data = Dataset(made / "dataset")
    pairs = [data.tokens(i) for i in range(len(data))]
    assert max(len(ids) for ids, _ in pairs) <= KW["max_len"]
    trained = count_pairs(pairs, target.cfg.vocab_size, KW["max_len"])
    assert trained.sum() and torch.equal(count_dataset(made / "dataset", target.cfg.vocab_size),
                                         trained)
    assert load_vocab(made / "dataset")[1].nonzero().flatten().tolist() == (
        trained.nonzero().flatten().tolist())  # fewer distinct tokens than --vocab-size: all


@pytest.mark.parametrize("over, why", [
    ({"seed": 1}, "prompts.jsonl holds self-made prompts made otherwise .*seed 0 there, 1 now"),
    ({"seed": 1, "n": 6}, "seed 0 there, 1 now"),
    ({"prompt_tokens": 40}, "max_new_tokens 48 there, 40 now"),
])
def test_other_prompt_settings_are_refused_by_name_before_any_stage(target, made, over, why):
    """Greedy answers record no seed that matters: --seed 1 was refused as answers "sampled with
    --temperature 0 (greedy), this run with --temperature 0 (greedy)", naming no difference;
    the seed that differs is the prompts'."""
    before, logs = _files(made), []
    n = over.pop("n", 3)
    with pytest.raises(DraftsmithError, match=why) as e:
        make_dataset(made, n, target=target, log=logs.append, **(KW | over))
    assert "(greedy), this run with" not in str(e.value)
    assert not [line for line in logs if line.startswith("== ")]  # no stage ran
    assert _files(made) == before


def test_a_rerun_says_the_vocab_is_reused(target, made):
    """Every stage before it said "reused" on a rerun while the vocab's line read as made
    anew (and as "1 tokens cover")."""
    logs: list[str] = []
    make_dataset(made, 3, target=target, log=logs.append, **KW)
    assert "regenerate: reused (3 answers)" in logs and "capture: reused (3 samples)" in logs
    said = [line for line in logs if line.startswith("vocab: ")]
    assert said == ["vocab: reused (1 token covers 100.00% of assistant tokens)"]
    (made / "dataset" / "vocab.safetensors").unlink()  # made again: said as made, not reused
    logs.clear()
    make_dataset(made, 3, target=target, log=logs.append, **KW)
    said = [line for line in logs if line.startswith("vocab: ")]
    assert said == ["vocab: 1 token covers 100.00% of assistant tokens"]
