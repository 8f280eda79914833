"""Doctor review 15: the behaviour run leaves DRAFTSMITH_PROFILE to bench."""

from __future__ import annotations

import test_doctor as td
import torch

from draftsmith.targets import load_target

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5, a drafter
target_dir, target, data_dir, work, good = td.target_dir, td.target, td.data_dir, td.work, td.good


def test_the_behaviour_run_ignores_a_profile_switch(good, target_dir, monkeypatch):
    """A DRAFTSMITH_PROFILE set for bench (here a value bench refuses) stopped doctor --run after
    its wiring checks, at the first speculative decoder: doctor times no phase."""
    from draftsmith.doctor.behaviour import spec_run
    from draftsmith.models.eagle3 import load_drafter

    monkeypatch.setenv("DRAFTSMITH_PROFILE", "yes please")
    t = load_target(target_dir)
    prompt = t.chat_ids([{"role": "user", "content": "hi"}])
    run = spec_run(t.build(torch.float32), load_drafter(good), [prompt], 2, 6, t.eos_ids)
    assert run["new_tokens"] == 6 and sum(run["reached"]) > 0
