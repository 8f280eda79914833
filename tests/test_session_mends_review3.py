"""Review 3 of small mends: offline samples cut by a smaller --max-len are said, an empty
--target is refused, and `data prompts --help` names its sources without a Python type."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_cli_review import run_main

from draftsmith.errors import DraftsmithError
from draftsmith.targets import is_default
from draftsmith.train.batches import Plan, TokenSource, batches


def _sample(n: int, answer_from: int) -> tuple[list[int], list[bool]]:
    return list(range(n)), [i >= answer_from for i in range(n)]


def _said(plan: Plan, source) -> list[str]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in batches(plan, source, 0, plan.steps_per_epoch(0), workers=0):
            pass
    return [str(w.message) for w in said]


def test_samples_cut_by_max_len_are_said_once_with_the_answer_tokens_lost():
    """A capture of longer samples trained with a smaller --max-len lost their answer tails
    without a word (online training says where a sample loses every answer token)."""
    source = TokenSource([_sample(10, 4), _sample(30, 10), _sample(40, 30), _sample(16, 8)])
    said = _said(Plan(source.lengths(), 1, 16, 1, 0, 0), source)
    assert len(said) == 1 and "\n" not in said[0]
    # 30 tokens: 14 answer tokens past 16 (16..29); 40: its whole answer, 10 (30..39)
    assert said[0] == ("--max-len 16 cuts 2 of 4 sample(s) (the longest has 40 tokens): 24 "
                       "answer token(s) past it never train; raise --max-len (up to 40) to "
                       "train on them")


def test_nothing_is_said_where_no_sample_is_cut_nor_on_other_ranks():
    source = TokenSource([_sample(10, 4), _sample(16, 8), _sample(40, 30), _sample(40, 30)])
    assert _said(Plan(source.lengths(), 1, 48, 1, 0, 0), source) == []
    assert _said(Plan(source.lengths(), 1, 16, 2, 1, 0), source) == []  # rank 0 says it


class _Reader(TokenSource):
    """A source with its own mask reader (a dataset's): read once, not sample by sample."""

    def __init__(self, samples) -> None:
        super().__init__(samples)
        self.read: list[int] = []

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.read.append(i)
        return super().__getitem__(i)

    def loss_masks(self):
        yield from (torch.tensor(m) for _, m in self.samples)


def test_a_readers_masks_are_counted_through_its_own_mask_reader():
    source = _Reader([_sample(10, 4), _sample(30, 20), _sample(12, 4), _sample(8, 2)])
    plan = Plan(source.lengths(), 4, 16, 1, 0, 0)
    said = _said(plan, source)
    assert len(said) == 1 and " 10 answer token(s) past it " in said[0]
    assert sorted(source.read) == [0, 1, 2, 3]  # the batch's reads only, none for the count


EMPTY = ("--target '' names no target; pass an HF checkpoint folder, a .gguf file or "
         "'default'")


def test_an_empty_target_is_refused_naming_the_flag():
    """`--target ''` loaded the embedded default as if 'default' were given: every caller that
    reads a recorded target treats "" as none recorded, so only a mistake reaches it."""
    with pytest.raises(DraftsmithError) as e:
        is_default("")
    assert str(e.value) == EMPTY
    assert is_default(None) and is_default("default")  # no --target: the default, as before


def test_an_empty_target_on_the_command_line_is_one_line(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "demo", "--out", str(tmp_path / "d"),
                            "--target", "")
    assert code == 2 and err.strip().endswith(EMPTY) and "\n" not in err.strip()
    assert not (tmp_path / "d").exists()


def test_data_prompts_help_names_its_sources_without_a_python_type(monkeypatch, capsys):
    """`data prompts --help` showed `sources... <list[str]>`, a Python type."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_main(monkeypatch, capsys, "data", "prompts", "--help")
    assert code == 0 and "list[str]" not in out
    assert "  sources...  JSONL/JSON/Parquet files" in out


def test_compare_help_names_its_drafters_without_a_python_type(monkeypatch, capsys):
    """compare's variadic argument alike: `drafters... <list[str]>` before."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_main(monkeypatch, capsys, "compare", "--help")
    assert code == 0 and "list[str]" not in out and "  drafters...  " in out
