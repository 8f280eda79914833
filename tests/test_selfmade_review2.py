"""A round of self-made prompts ran silent: on CPU `data make run --n 16` printed only `round 1:
decoding 32 rows x up to 128 tokens` for 87 s (a round is one `run_generation` call, which has
no per-step hook). The round's status now beats while it decodes: its time so far, beside the
bar on a terminal, off one a line at most every 30 s."""

from __future__ import annotations

import threading
import time

from draftsmith.data import progress
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts


def _off_terminal(monkeypatch, every: float) -> tuple[list[str], progress.Progress]:
    lines: list[str] = []
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    return lines, progress.Progress(4, 0, "prompt", "prompts", True, lines.append, every=every)


def until(cond, timeout: float = 10.0) -> None:
    """Waits for `cond` (the beat thread may get little CPU on a loaded machine), then goes on:
    the test's assertions fail honestly if it never held."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def test_a_long_step_beats_until_it_ends(monkeypatch):
    lines, bar = _off_terminal(monkeypatch, every=0)
    with bar.beating("round 1: decoding", beat=0.02):
        until(lambda: len(lines) >= 3)  # a fixed 0.2 s raced the beat thread under load
    ended = len(lines)
    time.sleep(0.1)
    assert lines[0] == "prompts: round 1: decoding" and ended >= 3
    assert all(x.startswith("prompts: round 1: decoding, ") and x.endswith(" s in")
               for x in lines[1:])
    assert len(lines) == ended


def test_beats_off_a_terminal_are_rate_limited(monkeypatch):
    lines, bar = _off_terminal(monkeypatch, every=3600)
    with bar.beating("round 1: decoding", beat=0.01):
        time.sleep(0.1)
    assert lines == ["prompts: round 1: decoding"]


def test_no_beat_when_progress_is_off(monkeypatch):
    bar = progress.Progress(4, 0, "prompt", "prompts", False, print)
    before = threading.active_count()
    with bar.beating("round 1", beat=0.01):
        assert threading.active_count() == before


def test_a_round_beats_while_it_decodes(target, model, tmp_path, monkeypatch):
    from draftsmith.engine import generate

    said: list[tuple[str, str]] = []

    class Seen(progress.Progress):
        def status(self, text: str) -> None:
            said.append(("status", text))
            super().status(text)

        def update(self, n: int) -> None:
            said.append(("update", str(n)))
            super().update(n)

    real = generate.run_generation

    def slow(*a, **k):  # decodes until a beat was said (a fixed 0.15 s raced it under load)
        until(lambda: any(kind == "status" and t.endswith(" s in") for kind, t in said))
        return real(*a, **k)

    monkeypatch.setattr(progress, "Progress", Seen)
    monkeypatch.setattr(progress, "BEAT_S", 0.03)
    monkeypatch.setattr(generate, "run_generation", slow)
    cfg = MagpieConfig(n=2, batch_size=3, max_new_tokens=6, min_chars=1)
    self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=True, log=lambda s: None)
    first = next(i for i, (k, _) in enumerate(said) if k == "update")
    beats = [t for k, t in said[:first] if k == "status" and t.endswith(" s in")]
    assert beats and beats[0].startswith("round 1: decoding 3 rows x up to 6 tokens, ")
