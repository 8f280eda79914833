"""The cost model for refilled rows: a row whose answer ends takes the next prompt (continuous
batching: `bench --refill`, `engine/spec_refill.py`, and how SGLang and vLLM serve).

A static batch runs until its slowest row ends (`PromptMix.busy`). Refilled rows idle only from
their end to the next refill, and each refill pays a prompt pass. The model replays the engine's
own host loops on draws of each prompt's cycles (rows end at scattered cycles, priced for static
batches as their expected largest), so it prices the cycles and the refills that the engine would
run, on average over the draws. Numpy only, as `cost_model`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from draftsmith.tune.cost_model import (
    Acceptance,
    CostModelError,
    CostTable,
    Prediction,
    PromptMix,
    SpecSetting,
    fill_survival,
    predict_phases,
    row_survival,
    tokens_per_cycle,
)
from draftsmith.tune.cost_model import tree_gain as _tree_gain


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
    _checked(need, rows, every)
    runs = spec_runs(np.asarray([need], dtype=np.int64), rows, every)
    fills = tuple(int(f[0]) for f in runs.fills if f[0])
    return Schedule(int(runs.cycles[0]), fills, int(runs.busy[0]))


@dataclass(frozen=True, slots=True)
class Runs:
    """`spec_schedule` of many draws at once, one entry a draw: `cycles`, `busy`, and `fills`
    (reads x draws), per host read that refilled in some draw, the rows each draw refilled
    then (0: none); the first fill included."""

    cycles: np.ndarray
    busy: np.ndarray
    fills: np.ndarray


_FAR = np.iinfo(np.int64).max


def spec_runs(need: np.ndarray, rows: int, every: int) -> Runs:
    """`spec_schedule` for each row of `need` (draws x prompts, cycles each), replayed side by
    side, each draw from its own refill to its next: a draw's next read that refills is at
    its first held row's end + 1 (seen one cycle late) once `every` cycles have passed since
    its last refill; with no prompt left it stops at its last held row's end + 1. The other
    reads change nothing: a step per refill, not per cycle any draw reads (review 11: 12 s
    of `tune --refill`'s batch-1 ranking, 60 prompts, went to stepping through them)."""
    draws, count = need.shape
    rows = min(rows, count)
    if rows == 1:
        return _one_row(need, every)
    end, held = need[:, :rows].copy(), np.ones((draws, rows), dtype=bool)
    ptr, last = np.full(draws, rows), np.zeros(draws, dtype=np.int64)
    cycles, live = np.zeros(draws, dtype=np.int64), np.arange(draws)
    when, who, took = [], [], []
    while live.size:
        e, h, p = end[live], held[live], ptr[live]
        queued = p < count
        first = np.where(h, e, _FAR).min(axis=1) + 1
        t = np.where(queued, np.maximum(first, last[live] + every),
                     np.where(h, e, -1).max(axis=1) + 1)
        cycles[live[~queued]] = t[~queued]
        live, t, e, h, p = live[queued], t[queued], e[queued], h[queued], p[queued]
        freed = h & (e <= t[:, None] - 1)
        idx = p[:, None] + np.cumsum(freed, axis=1) - 1
        take = freed & (idx < count)
        h &= ~freed | take
        rr, cc = np.nonzero(take)
        e[rr, cc] = t[rr] + need[live[rr], idx[rr, cc]]
        n = take.sum(axis=1)
        end[live], held[live], ptr[live], last[live] = e, h, p + n, t
        when.append(t)
        who.append(live)
        took.append(n)
    return Runs(cycles, need.sum(axis=1), _by_read(when, who, took, np.full(draws, rows)))


def _one_row(need: np.ndarray, every: int) -> Runs:
    """`spec_runs` of one row: each prompt refills `every` cycles after the last or the cycle
    after the one seeing its predecessor end, whichever is later; the last read is one cycle
    after the last prompt's end."""
    draws, count = need.shape
    at = np.cumsum(np.maximum(need[:, :-1] + 1, every), axis=1)
    cycles = (at[:, -1] if count > 1 else 0) + need[:, -1] + 1
    who = np.repeat(np.arange(draws), count - 1)
    fills = _by_read([at.ravel()], [who], [np.ones(who.size, dtype=np.int64)],
                     np.ones(draws, dtype=np.int64))
    return Runs(cycles, need.sum(axis=1), fills)


def _by_read(when: list[np.ndarray], who: list[np.ndarray], took: list[np.ndarray],
             first: np.ndarray) -> np.ndarray:
    """The first fill, then each read at which some draw refilled, in order: the rows each
    draw refilled (0: none)."""
    if not when:
        return first[None, :]
    reads, at = np.unique(np.concatenate(when), return_inverse=True)
    out = np.zeros((reads.size + 1, first.size), dtype=np.int64)
    out[0], out[at + 1, np.concatenate(who)] = first, np.concatenate(took)
    return out


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
        gain = _tree_gain(acc, setting)
        own = [tokens_per_cycle(a, setting) * (1.0 if a.tree else gain) for a in mix.prompts]
        return [min(max(own[i], 1.0), setting.steps + 1.0) for i in order]

    def cycle_draws(self, acc: Acceptance, setting: SpecSetting, batch: int,
                    mix: PromptMix) -> np.ndarray:
        """Each prompt's cycles, in the run's order, in DRAWS draws (draws x prompts): rows of
        a refilled batch end at scattered cycles, as a static batch's do (`PromptMix.
        fixed_length`, whose distribution of a row's cycles this draws from). A prompt decodes
        alike each time under greedy decoding, so its repeats share a draw; sampled, each
        draws its own. The baseline's: one draw, new_tokens - 1 steps each."""
        order = refill_order(len(mix.prompts), batch, self.waves)
        tokens = self.new_tokens - 1
        if setting.is_baseline:
            return np.full((1, len(order)), tokens, dtype=np.int64)
        gain = _tree_gain(acc, setting)
        fill_survival(((mix.prompts[i], setting) for i in dict.fromkeys(order)), tokens)
        cols = list(range(len(order))) if mix.sampled else order
        u = _uniforms(DRAWS, max(cols) + 1)
        out = np.empty((DRAWS, len(order)), dtype=np.int64)
        for j, (i, c) in enumerate(zip(order, cols, strict=True)):
            out[:, j] = _draw(mix.prompts[i], setting, tokens, u[:, c],
                              1.0 if mix.prompts[i].tree else gain)
        return out

    def runs(self, need: np.ndarray, setting: SpecSetting, batch: int) -> Runs:
        """The engine's schedule of each draw (`spec_runs`; the baseline's, `baseline_schedule`)."""
        if not setting.is_baseline:
            return spec_runs(need, batch, self.every[batch])
        s = baseline_schedule(need[0].tolist(), batch, self.steps_every[batch])
        return Runs(np.array([s.cycles]), np.array([s.busy]), np.array(s.fills)[:, None])

    def predict(self, costs: CostTable, acc: Acceptance, setting: SpecSetting, batch: int,
                mix: PromptMix) -> Prediction:
        """Tokens/s of the whole run, prompt passes included: every prompt's tokens over the
        expected cycles (`cycle_draws` replayed by `runs`) at the predicted cycle plus the
        expected prompt passes. As the profiler reports them: the refills' passes as the phase
        `refill`, per cycle; the first fill, before the first cycle, as `unprofiled`. Tokens
        per cycle: the paces' harmonic mean (tokens over cycles)."""
        if batch not in self.every or batch not in self.steps_every:
            raise CostModelError(f"refill: no refill spacing for batch {batch}")
        paces = self.paces(acc, setting, batch, mix)
        runs = self.runs(self.cycle_draws(acc, setting, batch, mix), setting, batch)
        return self._priced(costs, acc, setting, batch, paces, runs)

    def busy(self, acc: Acceptance, setting: SpecSetting, batch: int, mix: PromptMix) -> float:
        """The share of row slots that decode, as `predict` gives it (no costs needed)."""
        runs = self.runs(self.cycle_draws(acc, setting, batch, mix), setting, batch)
        return _busy(runs, batch, len(refill_order(len(mix.prompts), batch, self.waves)))

    def _priced(self, costs: CostTable, acc: Acceptance, setting: SpecSetting, batch: int,
                paces: list[float], runs: Runs) -> Prediction:
        spec = not setting.is_baseline
        ms = np.array([0.0, *(costs.refill_ms(k, spec) for k in range(1, batch + 1))])
        cycles = float(runs.cycles.mean())
        phases = predict_phases(costs, setting, batch)
        later = math.fsum(_read_means(ms, runs.fills[1:]))
        phases["refill"] = later / cycles
        phases["unprofiled"] = float(ms[runs.fills[0]].mean()) / cycles
        cycle = math.fsum(phases.values())
        if cycle <= 0:
            raise CostModelError(f"{setting}, batch {batch}: predicted cycle time is {cycle} ms")
        tps = len(paces) * self.new_tokens * 1000.0 / (cycle * cycles)
        beyond = not costs.covers(setting) or setting.steps > acc.depth
        tpc = len(paces) / math.fsum(1.0 / t for t in paces)
        return Prediction(setting, batch, tpc, cycle, tps, phases, beyond,
                          _busy(runs, batch, len(paces)))


DRAWS = 64  # draws of every prompt's cycles a refilled run is priced over


def _read_means(ms: np.ndarray, fills: np.ndarray) -> list[float]:
    """Each read's refill passes in ms, the mean over its draws: all reads in one call, each
    row's mean the same float as its own `.mean()` (numpy sums a contiguous row alike)."""
    return ms[fills].mean(axis=1).tolist()


def _busy(runs: Runs, batch: int, count: int) -> float:
    """Row-cycles that decoded over the row slots of the run, both expected over the draws."""
    return float(runs.busy.mean()) / (float(runs.cycles.mean()) * min(batch, count))


def _uniforms(draws: int, count: int, seed: int = 0) -> np.ndarray:
    """draws x count uniforms, each column stratified (one in each 1/draws of [0, 1), in a
    shuffled order): the draws' mean settles far sooner than at random."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((draws, count)), axis=0)
    return (ranks + rng.random((draws, count))) / draws


def _draw(acc: Acceptance, setting: SpecSetting, tokens: int, u: np.ndarray,
          gain: float) -> np.ndarray:
    """Cycles until `tokens` tokens at the uniforms `u` (inverse CDF of `cycle_survival`), cut
    by `gain` (a tree priced by its chain's figures), at least a whole cycle's most each."""
    start, sv = row_survival(acc, setting, tokens)
    cycles = start + np.searchsorted(-sv, -u, side="left")  # how many P(more than c) exceed u
    if gain == 1.0:
        return cycles
    least = math.ceil(tokens / (setting.steps + 1))
    return np.maximum(np.ceil(cycles / gain - 1e-9), least).astype(np.int64)
