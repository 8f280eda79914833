"""DRAFTSMITH_PROFILE read late: bench timed the baseline and its first setting (minutes on a
real target) before a value it refuses stopped it, and those rows were lost."""

from __future__ import annotations

import pytest

import draftsmith.bench.run as bench_run
import draftsmith.targets as targets
from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.errors import DraftsmithError
from draftsmith.switches import env_choice


def _never(*_a, **_k):
    raise AssertionError("the target loaded before DRAFTSMITH_PROFILE was read")


def test_a_bad_profile_switch_is_refused_before_the_target_loads(monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_PROFILE", "yes")
    monkeypatch.setattr(targets, "load_target", _never)
    monkeypatch.setattr(bench_run, "_baseline", _never)
    with pytest.raises(DraftsmithError) as e:
        run_bench(BenchConfig(drafter="random", steps=[2], topk=[1], num_prompts=1,
                              max_new_tokens=4, device="cpu"), log=lambda s: None)
    assert "DRAFTSMITH_PROFILE" in str(e.value)


def test_a_profile_flag_given_leaves_the_switch_unread(monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_PROFILE", "yes")
    assert bench_run.profiling(BenchConfig(profile=False)) is False


def test_a_refused_switch_is_quoted_as_typed(monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_X", " TRUE ")
    with pytest.raises(DraftsmithError) as e:
        env_choice("DRAFTSMITH_X", "0", ("0", "1"))
    assert "DRAFTSMITH_X='TRUE'" in str(e.value), str(e.value)
