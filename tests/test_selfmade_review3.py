"""A self-made round told only its time so far: `run_generation` had no per-step hook. It now
takes `on_step(steps, rows finished)`, told every 16 decode steps and once at the end,
and a round's status shows the tokens written and the rows finished."""

from __future__ import annotations

import re

import pytest
from test_speculative import tiny_target

from draftsmith.data import progress
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.engine import generate
from draftsmith.engine.generate import run_generation

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
NEW = 40
STEP_EVERY = 16  # decode steps between two tellings


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


@pytest.fixture(scope="module")
def free(tiny):
    """Each row's greedy answer with no eos."""
    return run_generation(tiny, PROMPTS, NEW).tokens


def _told(tiny, eos: list[int], new: int = NEW) -> tuple[list[tuple[int, int]], list]:
    calls: list[tuple[int, int]] = []
    gen = run_generation(tiny, PROMPTS, new, eos_ids=eos, on_step=lambda s, f: calls.append((s, f)))
    return calls, gen.tokens


def test_on_step_tells_steps_and_the_rows_finished(tiny, free):
    eos = [free[0][3]]  # row 0 ends early; the rest run on or end where they meet it
    calls, tokens = _told(tiny, eos)
    assert tokens == run_generation(tiny, PROMPTS, NEW, eos_ids=eos).tokens  # the hook: no change
    steps = [s for s, _ in calls]
    assert steps == sorted(set(steps)) and all(s % STEP_EVERY == 0 for s in steps[:-1])
    assert len(steps) >= 2 and steps[-1] <= NEW - 1
    assert [f for _, f in calls] == sorted(f for _, f in calls)
    assert calls[-1][1] == sum(len(t) < NEW for t in tokens) >= 1


def test_every_row_finished_early_is_told_once_at_the_end(tiny, free):
    calls, tokens = _told(tiny, sorted({row[5] for row in free}))
    assert all(len(t) <= 5 for t in tokens)
    assert len(calls) == 1 and calls[0][0] < STEP_EVERY and calls[0][1] == len(PROMPTS)


def test_one_token_is_told_once(tiny):
    calls, tokens = _told(tiny, [], new=1)
    assert calls == [(0, 0)] and all(len(t) == 1 for t in tokens)


def test_a_rounds_status_tells_tokens_written_and_rows_finished(target, model, tmp_path,
                                                                 monkeypatch):
    said: list[str] = []
    gens: list = []

    class Seen(progress.Progress):
        def status(self, text: str) -> None:
            said.append(text)
            super().status(text)

    real = generate.run_generation

    def kept(*a, **k):
        gens.append(real(*a, **k))
        return gens[-1]

    monkeypatch.setattr(progress, "Progress", Seen)
    monkeypatch.setattr(generate, "run_generation", kept)
    cfg = MagpieConfig(n=2, batch_size=3, max_new_tokens=20, min_chars=1)
    self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=True, log=lambda s: None)
    told = re.compile(r"round 1: decoding 3 rows x up to 20 tokens, (\d+) tokens written, "
                      r"(\d)/3 rows finished, \d+ s in")
    first = [m for t in said if (m := told.fullmatch(t))]
    assert first, said
    written, finished = (int(x) for x in first[-1].groups())
    lengths = [len(t) for t in gens[0].tokens]
    assert finished == sum(n < 20 for n in lengths)
    assert [int(m[1]) for m in first] == sorted(int(m[1]) for m in first)
    assert 0 < written <= sum(lengths)  # never more than written (eos not counted)
    after = said[said.index(first[0].string) + 1:]
    assert not any(t.startswith("round 1") and "tokens written" not in t for t in after)
