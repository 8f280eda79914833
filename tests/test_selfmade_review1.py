"""Self-made prompts' progress moved one prompt at a time after a whole round had run, so the
line printed off a terminal fired on the first of a round's prompts and projected the run's end
from it (`1/16 prompts, 13.3 min spent, eta 3.3 h`, then at once 16/16). It moves by the
round's prompts, as they are written."""

from __future__ import annotations

import json

from draftsmith.data import progress
from draftsmith.data.selfmade import BUILTIN_OPENINGS, MagpieConfig, self_made_prompts


def test_progress_moves_a_round_at_a_time_as_it_is_written(target, model, tmp_path,
                                                           monkeypatch):
    moves: list[tuple[int, int]] = []
    out = tmp_path / "p.jsonl"

    class Seen(progress.Progress):
        def update(self, n: int) -> None:
            written = len(out.read_text().splitlines()) if out.exists() else 0
            moves.append((n, written))
            super().update(n)

    monkeypatch.setattr(progress, "Progress", Seen)
    cfg = MagpieConfig(n=6, batch_size=4, max_new_tokens=12, min_chars=1,
                       openings=BUILTIN_OPENINGS)
    self_made_prompts(target, out, cfg, model, progress=False)
    rounds = {json.loads(x)["meta"]["round"] for x in out.read_text().splitlines()}
    assert len(moves) == len(rounds) and sum(n for n, _ in moves) == 6
    assert [w for _, w in moves] == [sum(n for n, _ in moves[: i + 1]) for i in range(len(moves))]
