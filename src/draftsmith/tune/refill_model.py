"""The cost model for refilled rows: a row whose answer ends takes the next prompt (continuous
batching: `bench --refill`, `engine/spec_refill.py`, and how SGLang and vLLM serve).

A static batch runs until its slowest row ends (`PromptMix.busy`). Refilled rows idle only from
their end to the next refill, and each refill pays a prompt pass. The model replays the engine's
own host loops on each prompt's expected number of cycles, so it prices the cycles and the
refills that the engine would run on those counts. Numpy only, as `cost_model`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from draftsmith.tune.cost_model import (
    Acceptance,
    CostModelError,
    CostTable,
    Prediction,
    PromptMix,
    SpecSetting,
    predict_phases,
    tokens_per_cycle,
)


@dataclass(frozen=True, slots=True)
class Schedule:
    """What a refilled run does: `cycles` cycles (plain steps for the baseline); `fills`, the
    rows each refill prefilled (the first fill included); `busy`, row-cycles that decoded."""

    cycles: int
    fills: tuple[int, ...]
    busy: int


def _start(queue: deque, need: Sequence[int], end: list[int | None], free: Sequence[int],
           now: int) -> int:
    """Give the freed rows the next prompts, decoding from the cycle after `now`; how many."""
    took = 0
    for r in free:
        if not queue:
            break
        end[r], took = now + need[queue.popleft()], took + 1
    return took


def _checked(need: Sequence[int], rows: int, every: int) -> tuple[deque, list[int | None]]:
    if not need or rows < 1 or every < 1 or min(need) < 0:
        raise CostModelError(f"refill schedule: need prompts, rows >= 1, spacing >= 1 and "
                             f"cycles >= 0, got {len(need)} prompts, {rows} rows, every {every}")
    return deque(range(len(need))), [None] * min(rows, len(need))


def spec_schedule(need: Sequence[int], rows: int, every: int) -> Schedule:
    """`spec_refill.generate_refill` on prompts that take `need[i]` cycles each: after every
    cycle the host reads the done flags one cycle late (`LateFlag`) and, once `every` cycles
    have passed since the last refill, refills the rows that were done; with no prompt left it
    stops at the first cycle that sees every row done (one cycle after the last ends)."""
    queue, end = _checked(need, rows, every)
    fills = [_start(queue, need, end, range(len(end)), 0)]
    t = since = 0
    while True:
        t, since = t + 1, since + 1
        ended = [r for r, e in enumerate(end) if e is not None and e <= t - 1]
        all_done = len(ended) == sum(e is not None for e in end)
        if queue and since >= every and ended:
            for r in ended:
                end[r] = None
            fills.append(_start(queue, need, end, ended, t))
            all_done, since = False, 0
        if all_done and not queue:
            return Schedule(t, tuple(fills), sum(need))


def baseline_schedule(need: Sequence[int], rows: int, every: int) -> Schedule:
    """`refill.generate_refill` on prompts that take `need[i]` steps each: `every` steps, then
    a read of the current done flags, the done rows refilled; it stops at the read that finds
    no row holding a prompt."""
    queue, end = _checked(need, rows, every)
    fills = [_start(queue, need, end, range(len(end)), 0)]
    t = 0
    while any(e is not None for e in end):
        t += every
        ended = [r for r, e in enumerate(end) if e is not None and e <= t]
        for r in ended:
            end[r] = None
        if queue and ended:
            fills.append(_start(queue, need, end, ended, t))
    return Schedule(t, tuple(fills), sum(need))


WAVES = 4  # a refilled run decodes at least this many prompts per row


def refill_order(count: int, batch: int, waves: int = WAVES) -> list[int]:
    """The prompts a refilled run of `batch` rows decodes, in order: all `count` in turn, again
    and again up to `waves` prompts per row. With as many prompts as rows a refilled run is a
    static batch; the queue behind a busy server is deeper."""
    if count < 1 or batch < 1:
        raise CostModelError(f"refill_order: need prompts and a batch, got {count} and {batch}")
    return [i % count for i in range(max(count, waves * batch))]


@dataclass(frozen=True, slots=True)
class Refill:
    """Refilled rows for the model: every prompt of the run (`refill_order`) makes `new_tokens`
    tokens, its first by its prompt pass; `every` and `steps_every`, per row count, the
    speculative cycles and the baseline's steps between refills (the engine's defaults)."""

    new_tokens: int
    every: Mapping[int, int]
    steps_every: Mapping[int, int]
    waves: int = WAVES

    def paces(self, acc: Acceptance, setting: SpecSetting, batch: int,
              mix: PromptMix) -> list[float]:
        """Tokens per cycle of each prompt the run decodes, in order, kept within 1 and a
        cycle's most (steps + 1). A prompt's own figure is its own tree's where `tune`
        measured one (`tree_acceptance`), else its chain's (`chain_acceptance`), a tree's then
        scaled by the tree's gain over its chain in the pooled figures (`acc`). A chain's is
        its own: pooled figures weigh each prompt by its cycles at the measured depth, too low
        at shallower ones (review of 50c6ae4: 2-5 % on the CPU run)."""
        order = refill_order(len(mix.prompts), batch, self.waves)
        if setting.is_baseline:
            return [1.0] * len(order)
        gain = 1.0
        if setting.topk > 1 and acc.chain:
            gain = tokens_per_cycle(acc, setting) / tokens_per_cycle(
                Acceptance(chain=acc.chain), setting)
        own = [tokens_per_cycle(a, setting) * (1.0 if a.tree else gain) for a in mix.prompts]
        return [min(max(own[i], 1.0), setting.steps + 1.0) for i in order]

    def schedule(self, paces: list[float], setting: SpecSetting, batch: int) -> Schedule:
        """Each prompt's cycles: the tokens after its first over its pace, rounded up (the
        last cycle of an answer may accept more than it needs)."""
        need = [math.ceil((self.new_tokens - 1) / t - 1e-9) for t in paces]
        if setting.is_baseline:
            return baseline_schedule(need, batch, self.steps_every[batch])
        return spec_schedule(need, batch, self.every[batch])

    def predict(self, costs: CostTable, acc: Acceptance, setting: SpecSetting, batch: int,
                mix: PromptMix) -> Prediction:
        """Tokens/s of the whole run, prompt passes included: every prompt's tokens over the
        schedule's cycles at the predicted cycle plus the prompt passes. As the profiler
        reports them: the refills' passes as the phase `refill`, per cycle; the first fill,
        before the first cycle, as `unprofiled`. Tokens per cycle: the paces' harmonic mean
        (tokens over cycles)."""
        if batch not in self.every or batch not in self.steps_every:
            raise CostModelError(f"refill: no refill spacing for batch {batch}")
        paces = self.paces(acc, setting, batch, mix)
        sched = self.schedule(paces, setting, batch)
        phases = predict_phases(costs, setting, batch)
        first, *later = (costs.refill_ms(k, not setting.is_baseline) for k in sched.fills)
        phases["refill"] = math.fsum(later) / sched.cycles
        phases["unprofiled"] = first / sched.cycles
        cycle = math.fsum(phases.values())
        if cycle <= 0:
            raise CostModelError(f"{setting}, batch {batch}: predicted cycle time is {cycle} ms")
        tps = len(paces) * self.new_tokens * 1000.0 / (cycle * sched.cycles)
        beyond = not costs.covers(setting) or setting.steps > acc.depth
        tpc = len(paces) / math.fsum(1.0 / t for t in paces)
        return Prediction(setting, batch, tpc, cycle, tps, phases, beyond,
                          sched.busy / (sched.cycles * min(batch, len(paces))))
