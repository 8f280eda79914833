"""Measure what the cost model needs on the real engine, and run the sweep.

Costs are timed on the exact shapes the speculative engine uses (graphed where the engine is):
the target's verify forward of n tokens with aux capture, one drafter step of q tokens per row,
the drafter's re-extend over n tokens, and the bookkeeping phase from the profiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from draftsmith.bench import load
from draftsmith.engine import refill as plain_refill
from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import run_generation, sync
from draftsmith.engine.refill import PREFILL_ROWS, padded_rows
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_refill import generate_refill as spec_generate_refill
from draftsmith.engine.spec_refill import prompt_pass, refill_every_for, warm_refill
from draftsmith.engine.spec_state import SpecResult
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import RankCounts
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    Measurement,
    PromptMix,
    SpecSetting,
    batch_groups,
    prompt_tree,
    tree_capacity,
    tune_topks,
)
from draftsmith.tune.refill_model import WAVES, refill_order

VERIFY_NS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int | None = None) -> float:
    """Mean milliseconds per call after two warm-up calls; CUDA events on GPU."""
    iters = iters or (20 if device.type == "cuda" else 2)
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    if device.type != "cuda":
        with load.timed():
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with load.timed():
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / iters


Figure = float | dict[str, float]  # a cost shape's: ms, or a phase probe's ms by phase


class CostLog:
    """The cost shapes as they are timed, a line each (i of N, elapsed, time left) to `say`
    and every figure so far to `save` (tune's partial file); those in `kept` (a stopped run's)
    are taken, not timed again."""

    def __init__(self, kept: dict[str, Figure] | None = None,
                 save: Callable[[dict[str, Figure]], None] | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.kept, self.figures = dict(kept or {}), dict(kept or {})
        self.save, self.say = save, say
        self.begin(0)

    def begin(self, total: int) -> None:
        """A new run of `total` shapes (the costs', then the refills' passes), counted and its
        time left estimated on its own."""
        self.total, self.seen, self.timed = total, 0, 0
        self.start = time.perf_counter()

    def take(self, key: str, fn: Callable[[], Figure]) -> Figure:
        self.seen += 1
        if key in self.kept:
            return self.kept[key]
        self.figures[key] = figure = fn()
        self.timed += 1
        if self.save:
            self.save(dict(self.figures))
        if self.say:
            spent = time.perf_counter() - self.start
            left = spent / self.timed * max(self.total - self.seen, 0)
            self.say(f"cost {self.seen}/{self.total}: {key} ({spent:.0f} s, about {left:.0f} s "
                     "left)")
        return figure


@dataclass
class Engine:
    """The pieces every measurement shares: one target runtime and one drafter runtime, the
    sampling every decode runs under (greedy by default), baselines and acceptance alike, and
    the log its cost shapes are timed through."""

    rt: Runtime
    drt: DrafterRuntime
    drafter: Eagle3Drafter
    params: SamplingParams = SamplingParams()
    costs: CostLog = field(default_factory=CostLog)

    @property
    def device(self) -> torch.device:
        return self.rt.device


AT = 64  # where costs are timed: a cycle past a short prompt (`cost_room` moves it back)


def verify_ns(max_n: int) -> list[int]:
    """The verify widths timed up to `max_n`, itself among them."""
    return [n for n in VERIFY_NS if n <= max_n] + ([max_n] if max_n not in VERIFY_NS else [])


def verify_costs(eng: Engine, shapes: list[tuple[int, int]], at: int = AT
                 ) -> dict[int, dict[int, float]]:
    """ms of one target verify of n tokens per row, for each (batch, n) of `shapes`; a batch's
    untaken widths captured before its first is timed."""
    aux = tuple(eng.drafter.cfg.aux_layer_ids)
    out: dict[int, dict[int, float]] = {}
    for b, n in shapes:
        if b not in out:
            out[b] = {}
            eng.rt.capture([b], [m for c, m in shapes if c == b
                                 and verify_key(b, m) not in eng.costs.kept], aux_ids=aux)
        out[b][n] = eng.costs.take(verify_key(b, n),
                                   lambda b=b, n=n: _verify_ms(eng, b, n, at, aux))
    return out


def verify_key(b: int, n: int) -> str:
    return f"verify batch {b}, {n} tokens"


def _verify_ms(eng: Engine, b: int, n: int, at: int, aux: tuple[int, ...]) -> float:
    tok = torch.zeros(b, n, dtype=torch.long, device=eng.device)
    pos = torch.arange(at, at + n, device=eng.device).repeat(b, 1)
    return time_ms(lambda: eng.rt.forward(tok, pos, aux_ids=aux), eng.device)


def drafter_costs(eng: Engine, shapes: list[tuple[int, int]], at: int = AT
                  ) -> dict[int, dict[int, float]]:
    """ms of one drafter forward of q tokens per row (a draft step of width q, or an extend),
    for each (batch, q) of `shapes`."""
    out: dict[int, dict[int, float]] = {}
    for b, q in shapes:
        if b not in out:
            out[b] = {}
            eng.drt.capture([b], [r for c, r in shapes if c == b
                                  and drafter_key(b, r) not in eng.costs.kept])
        out[b][q] = eng.costs.take(drafter_key(b, q), lambda b=b, q=q: _drafter_ms(eng, b, q, at))
    return out


def drafter_key(b: int, q: int) -> str:
    return f"drafter batch {b}, {q} tokens"


def _drafter_ms(eng: Engine, b: int, q: int, at: int) -> float:
    tok = torch.zeros(b, q, dtype=torch.long, device=eng.device)
    hid = torch.zeros(b, q, eng.drafter.cfg.hidden_size, dtype=eng.drt.dtype, device=eng.device)
    pos = torch.arange(at, at + q, device=eng.device).repeat(b, 1)
    return time_ms(lambda: eng.drt.forward(tok, hid, pos), eng.device)


def decode_costs(eng: Engine, batches: list[int], prompts: list[list[int]], steps: int = AT
                 ) -> dict[int, float]:
    """ms of one plain decode step: `steps` new tokens past each row's prompt."""
    return {b: eng.costs.take(f"decode batch {b}", lambda b=b: _decode_ms(eng, b, prompts, steps))
            for b in batches}


def _decode_ms(eng: Engine, b: int, prompts: list[list[int]], steps: int) -> float:
    rows = [prompts[i % len(prompts)] for i in range(b)]
    run_generation(eng.rt, rows, min(16, steps), eng.params)
    with load.timed():
        g = run_generation(eng.rt, rows, steps, eng.params)
    return g.decode_s / (steps - 1) * 1e3


def decode_rate(new_tokens: int, rows: int, decode_s: float) -> float:
    """Tokens/s of the decode phase: prefill (which makes each row's first token) left out,
    as the cost model predicts steady-state decoding."""
    return (new_tokens - rows) / max(decode_s, 1e-9)


def prompt_groups(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Every prompt at least once, in batches of `batch` rows (`batch_groups`: the cost model
    predicts these very batches): a small batch's figure is then the prompts' figure, not the
    first prompt's."""
    return [[prompts[i] for i in g] for g in batch_groups(len(prompts), batch)]


WARM_TOKENS = 8  # a sweep run's warm-up (graph capture)


def warm_tokens(eng: Engine, rows: list[list[int]], new: int) -> int:
    """A sweep run's warm-up: WARM_TOKENS new tokens past its longest row where the target has
    the positions (and sliding window) for them, else its own `new`, which it has room for."""
    cfg = eng.rt.model.cfg
    room = min(filter(None, (cfg.max_position_embeddings, cfg.sliding_window)), default=None)
    return WARM_TOKENS if not room or max(map(len, rows)) + WARM_TOKENS <= room else new


def run_setting(
    eng: Engine,
    setting: SpecSetting,
    prompts: list[list[int]],
    batch: int,
    new: int,
    eos: list[int],
    refill: int = 0,
) -> Measurement:
    """Decode tokens/s of one setting on the real engine (baseline for steps 0) over every
    prompt (`prompt_groups`), phases profiled in a separate run of the first group. Pass eos=[]
    for fixed-length rows: a row stopped early would idle in its static batch, which the cost
    model does not predict. `refill`: `run_refilled` instead, with that many waves."""
    if refill:
        return run_refilled(eng, setting, prompts, batch, new, eos, refill)
    groups = prompt_groups(prompts, batch)
    rows, warm = batch * len(groups), warm_tokens(eng, groups[0], new)
    if setting.is_baseline:
        run_generation(eng.rt, groups[0], warm, eng.params, eos)
        with load.timed():  # other work on the cores skews the sweep: the report says so
            gs = [run_generation(eng.rt, g, new, eng.params, eos) for g in groups]
        return Measurement(setting, batch, decode_rate(sum(g.new_tokens for g in gs), rows,
                                                       sum(g.decode_s for g in gs)))
    dec = decoder(eng, setting)
    dec.generate(groups[0], warm, eos)  # warm-up and capture
    dec.profile = False
    with load.timed():
        res = SpecResult.merged([dec.generate(g, new, eos) for g in groups])
    dec.profile = True
    with load.timed():
        prof = dec.generate(groups[0], new, eos)
    check_cycled(res, setting, batch, new)
    return Measurement(setting, batch, decode_rate(res.new_tokens, rows, res.decode_s),
                       res.mean_accept_length, measured_phases(prof), 1e3 * res.decode_s /
                       res.cycles, sum(res.accept_hist) / (res.cycles * batch))


def check_cycled(res: SpecResult, setting: SpecSetting, batch: int, new: int) -> None:
    """Refuse a sweep run of no cycle: every row ended at its first token, so its cycle time,
    busy share and tokens/s would be figures of nothing (0 ms, 0 %), not measurements."""
    if not res.cycles:
        raise DraftsmithError(f"{setting} at batch {batch} ran no speculative cycle in {new} "
                              f"new tokens: every answer ended at its first token (EOS), so "
                              f"nothing was measured; use --prompts whose answers run longer")


def measured_phases(prof: SpecResult) -> dict[str, float] | None:
    """A profiled run's ms per cycle by phase, or None (unprofiled, as reports show it) where
    it ran no cycle: its phases are no 0 ms measurements."""
    if prof.phases is None or not prof.phases.cycles:
        return None
    return dict(prof.phases.ms)


def run_refilled(eng: Engine, setting: SpecSetting, prompts: list[list[int]], batch: int,
                 new: int, eos: list[int], waves: int = WAVES) -> Measurement:
    """Tokens/s of one setting with `batch` rows refilled as they end, over the prompts of
    `refill_order` (`waves` a row at least), prompt passes included, each engine at its default
    refill spacing; phases (`refill` among them) from a second, profiled run of the same
    prompts."""
    flat = [prompts[i] for i in refill_order(len(prompts), batch, waves)]
    if setting.is_baseline:
        every = refill_every_for(batch)
        plain_refill.prepare(eng.rt, batch, new, eos, eng.params, flat)
        sync(eng.rt)
        with load.timed():
            t0, ran = time.perf_counter(), {}
            tokens = plain_refill.generate_refill(eng.rt, flat, new, eng.params, eos, batch,
                                                  every, ran)
            wall = time.perf_counter() - t0
        # a step decodes one token a busy row; each prompt's first came from its prompt pass
        decoded = sum(map(len, tokens)) - sum(1 for t in tokens if t)
        steps = max(ran["steps"], 1)
        return Measurement(setting, batch, sum(map(len, tokens)) / wall, None, None,
                           1e3 * wall / steps, decoded / (steps * min(batch, len(flat))))
    dec = decoder(eng, setting)
    warm_refill(dec, flat, batch)
    with load.timed():
        res = spec_generate_refill(dec, flat, new, eos, batch)
    dec.profile = True
    with load.timed():
        prof = spec_generate_refill(dec, flat, new, eos, batch)
    check_cycled(res, setting, batch, new)
    rows = res.extra["refill_rows"]
    return Measurement(setting, batch, res.tokens_per_s, res.mean_accept_length,
                       measured_phases(prof), 1e3 * res.decode_s / res.cycles,
                       sum(res.accept_hist) / (res.cycles * rows))


def refill_costs(eng: Engine, batches: list[int], prompts: list[list[int]]
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """ms of one refill's prompt passes into k freed rows, the baseline's (target) and the
    speculative engine's (target and drafter), for every row count a pass pads to (a power of
    two) up to the largest batch or the prefill runtime's rows: the mean over groups of k
    prompts in turn that cover them all (a pass costs its longest prompt's bucket). A shape at
    a time through `eng.costs`: said, saved, and a stopped run's taken."""
    most = min(max(batches), PREFILL_ROWS)
    shapes = refill_shapes(most)
    eng.costs.begin(len(shapes))
    starts = _pass_starts(eng, most)
    out: tuple[dict[int, float], dict[int, float]] = ({}, {})
    for k, spec in shapes:
        groups = [[prompts[(at + i) % len(prompts)] for i in range(k)]
                  for at in range(0, len(prompts), k)]
        out[spec][k] = eng.costs.take(refill_key(k, most, spec), lambda k=k, spec=spec, g=groups:
                                      pass_ms(starts(spec), k, g, eng))
    return out


def refill_shapes(most: int) -> list[tuple[int, bool]]:
    """(rows, speculative) of every pass `refill_costs` times into a state of `most` rows."""
    sizes = sorted({padded_rows(k, most) for k in range(1, most + 1)})
    return [(k, spec) for k in sizes for spec in (False, True)]


def refill_key(k: int, most: int, speculative: bool) -> str:
    return (f"refill pass batch {most}, {k} rows, "
            + ("speculative" if speculative else "no speculation"))


def _pass_starts(eng: Engine, most: int) -> Callable[[bool], Callable]:
    """The baseline's or the speculative engine's prompt pass into `most` rows, each built
    at its first use: a resumed run that took every pass of one builds none of it."""
    made: dict[bool, Callable] = {}

    def start(speculative: bool) -> Callable:
        if speculative in made:
            return made[speculative]
        if speculative:
            made[speculative] = prompt_pass(decoder(eng, SpecSetting(1)), most)
        else:
            made[speculative] = plain_refill.prepare(eng.rt, most, 8, [], eng.params)[0].start
        return made[speculative]
    return start


def pass_ms(start: Callable[[list[int], list[list[int]]], object], k: int,
            groups: list[list[list[int]]], eng: Engine) -> float:
    """Mean wall ms of `start(rows, group)` over the groups, each warmed (captured) first and
    timed from an idle device to its end, as a refill runs it: the host has just read the
    done flags, and the next cycle waits for the pass."""
    rows, times = list(range(k)), []
    for g in groups:
        start(rows, g)
        for _ in range(3 if eng.device.type == "cuda" else 1):
            sync(eng.rt)
            with load.timed():
                t0 = time.perf_counter()
                start(rows, g)
                sync(eng.rt)
                times.append(time.perf_counter() - t0)
    return 1e3 * sum(times) / len(times)


def decoder(eng: Engine, s: SpecSetting) -> SpecDecoder:
    n = None if s.topk == 1 else s.num_draft_tokens
    return SpecDecoder(eng.rt, eng.drt, s.steps, s.topk, n, eng.params, profile=False)


def chain_acceptance(
    eng: Engine, prompts: list[list[int]], steps: int, new: int, eos: list[int]
) -> tuple[Acceptance, PromptMix]:
    """Conditional per-position acceptance from a deep chain run (position k counted only
    where positions < k were accepted): pooled over the prompts, and each prompt's own (each
    decoded alone, so its counts are its own) for the static batches' idle rows. A prompt
    that never reached a draft (done at its prefill) takes the pooled figures, so the mix
    stays aligned with the sweep's batches."""
    dec = decoder(eng, SpecSetting(steps, 1, steps + 1))
    runs = [dec.generate([p], new, eos) for p in prompts]
    reached = [sum(c) for c in zip(*(r.reached for r in runs), strict=True)]
    accepted = [sum(c) for c in zip(*(r.accepted for r in runs), strict=True)]
    if not reached or not reached[0]:
        raise DraftsmithError(f"no prompt reached a draft in {new} new tokens: every answer "
                              "ended at its first token (EOS), so nothing measures acceptance; "
                              "use --prompts whose answers run longer")
    pooled = Acceptance.from_chain_counts(reached, accepted)
    own = [Acceptance.from_chain_counts(r.reached, r.accepted) if r.reached[0] else pooled
           for r in runs]
    return pooled, PromptMix(tuple(own), sampled=not eng.params.greedy)


def tree_acceptance(
    eng: Engine, prompts: list[list[int]], steps: int, topk: int, new: int, eos: list[int],
    chain: Acceptance, mix: PromptMix, tokens: int = 32,
) -> tuple[Acceptance, PromptMix]:
    """The chain's figures plus a tree's by depth and sibling rank (`RankCounts`), from one
    run of a wide tree (steps deep, topk wide, up to `tokens` verified) over the prompts, in
    batches of the runtime's largest: pooled, and each prompt's own (`prompt_tree`, on its
    chain figures from `mix`) for the static batches' idle rows and the refilled rows' paces.
    Drafts drawn from the drafter (sampling under DRAFTSMITH_SAMPLED_DRAFTS=drawn) may repeat
    a token among siblings, so the accepted node is not known from its token: then the
    chain's figures alone."""
    tokens = min(tree_capacity(steps, topk), tokens)
    dec = decoder(eng, SpecSetting(steps, topk, tokens))
    if dec.drawn:
        return chain, mix
    rows: list[tuple[list[list[int]], list[list[int]]]] = []
    none = ([[0] * topk] * steps,) * 2  # every row ended at its prefill: no cycle counted
    for i in range(0, len(prompts), eng.rt.max_batch):
        batch = prompts[i : i + eng.rt.max_batch]
        dec.rank_counts = counts = RankCounts(steps, topk, eng.device)
        dec.generate(batch, new, eos)
        rows += counts.row_counts() or [none] * len(batch)  # a row a prompt, in order
    dec.rank_counts = None
    reached, accepted = ([[sum(r[j][d][k] for r in rows) for k in range(topk)]
                          for d in range(steps)] for j in (0, 1))
    pooled = Acceptance.from_rank_counts(reached, accepted, chain=chain.chain)
    own = tuple(prompt_tree(pooled, r, a, p.chain)
                for (r, a), p in zip(rows, mix.prompts, strict=True))
    return pooled, PromptMix(own, tuple(rows), mix.sampled)


SHALLOW, DEEP = 2, 4  # the phase probes' draft depths: a line through the two


def probe_setting(steps: int, topk: int) -> SpecSetting:
    return SpecSetting(steps, topk, steps + 1 if topk == 1 else min(tree_capacity(steps, topk), 8))


def draft_phase_costs(
    eng: Engine, shapes: list[tuple[int, int, int]], prompts: list[list[int]], new: int = 32,
) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]], dict[int, float]]:
    """(first step, each further step) of the engine's own draft phase, in ms, per batch and
    topk: the profiled draft of a shallow and a deep setting (`shapes`: (batch, topk, steps)
    of each probe), a line through the two. A tree's step is its drafter forward plus its
    top-k and frontier bookkeeping; a chain's first step reads the root from the extend's
    output (H200 tune run 6: 0.03 ms, where a drafter forward takes 0.16; a 4-wide tree's
    step 0.30). Third, per batch: the bookkeeping of a cycle, the shallow chain's accept
    phase."""
    got = {(b, k, s): _probe(eng, probe_setting(s, k), prompts, b, new) for b, k, s in shapes}
    first: dict[int, dict[int, float]] = {}
    step: dict[int, dict[int, float]] = {}
    overhead: dict[int, float] = {}
    for b, k in dict.fromkeys((b, k) for b, k, _ in shapes):
        lo, hi = got[(b, k, SHALLOW)], got[(b, k, DEEP)]
        step.setdefault(b, {})[k] = max(0.0, (hi.get("draft", 0.0) - lo.get("draft", 0.0))
                                        / (DEEP - SHALLOW))
        first.setdefault(b, {})[k] = max(0.0, lo.get("draft", 0.0) - (SHALLOW - 1) * step[b][k])
        if k == 1:
            overhead[b] = lo.get("accept", 0.0)
    return first, step, overhead


def _probe(eng: Engine, s: SpecSetting, prompts: list[list[int]], b: int, new: int) -> dict:
    return dict(eng.costs.take(f"phase probe batch {b}: {s}",
                               lambda: probe_phases(eng, s, prompts, b, new)))


def probe_phases(eng: Engine, s: SpecSetting, prompts: list[list[int]], b: int,
                 new: int = 32) -> dict:
    """The profiled phases (ms per cycle) of one batch of the prompts, `new` new tokens, rows
    of fixed length."""
    phases = run_setting(eng, s, prompts[:b], b, new, []).phases
    if not phases:  # a missing phase would read as 0 ms in the draft's line
        raise DraftsmithError(f"the phase probe of {s} at batch {b} ran no profiled cycle in "
                              f"{new} new tokens; use --prompts whose answers run longer")
    return dict(phases)


def cost_width(max_steps: int, max_topk: int, max_draft: int) -> int:
    """The widest verify `cost_table` times: the deepest chain's, or the widest tree's."""
    return max_steps + 1 if max_topk == 1 else max(max_steps + 1, max_draft)


def cost_room(most: int | None, prompts: list[list[int]], widest: int, deep: int = 4
              ) -> tuple[int, int]:
    """(where verifies and drafter steps are timed, new tokens the decode and phase probes
    run): position AT and AT tokens past the longest prompt, both moved back within a target
    of few positions (`most`, its max_position_embeddings; a probe drafts `deep` past its
    last token): timed past them, a forward the target never runs was timed, and an engine
    that sizes its tables by them fails there."""
    if not most:
        return AT, AT
    longest = max(map(len, prompts))
    if most < widest:
        raise DraftsmithError(f"tune times verifies of up to {widest} tokens (--max-steps, "
                              f"--max-draft-tokens): more than the target's "
                              f"{_limit(most)}")
    if longest + 2 + deep > most:
        raise DraftsmithError(f"tune's cost probes decode 2 tokens and draft {deep} past the "
                              f"longest prompt ({longest} tokens): more than the target's "
                              f"{_limit(most)}; use shorter --prompts")
    return min(AT, most - widest), min(AT, most - longest - deep)


def _limit(most: int) -> str:
    return f"max_position_embeddings {most} (or sliding window, where smaller)"


class CostPlan(NamedTuple):
    """Every shape `cost_table` times, by kind, in the order timed: the lists its loops
    iterate, and all of them together its progress's total (`len(plan.shapes())`)."""

    drafter: list[tuple[int, int]]  # (batch, tokens a row): a draft step's or an extend's
    probe: list[tuple[int, int, int]]  # (batch, topk, steps): a profiled draft phase
    verify: list[tuple[int, int]]  # (batch, tokens a row)
    decode: list[int]  # batch: a plain decode step

    def shapes(self) -> list:
        return [shape for kind in self for shape in kind]


def cost_plan(batches: list[int], max_topk: int, max_steps: int, widest: int) -> CostPlan:
    qs = range(2, max_steps + 2)  # the extend's widths (a draft step is timed whole)
    return CostPlan(
        drafter=[(b, q) for b in batches for q in qs],
        probe=[(b, k, s) for b in batches for k in tune_topks(max_topk) for s in (SHALLOW, DEEP)],
        verify=[(b, n) for b in batches for n in verify_ns(widest)],
        decode=list(batches))


def cost_table(
    eng: Engine,
    batches: list[int],
    prompts: list[list[int]],
    max_topk: int,
    max_steps: int = 10,
    max_draft: int = 16,
    most: int | None = None,
) -> CostTable:
    """Every cost the model needs, timed within the target's `most` positions (`cost_room`), a
    shape at a time through `eng.costs`."""
    widest = cost_width(max_steps, max_topk, max_draft)
    at, new = cost_room(most, prompts, widest)
    plan = cost_plan(batches, max_topk, max_steps, widest)
    eng.costs.begin(len(plan.shapes()))
    drafts = drafter_costs(eng, plan.drafter, at)
    first, step, overhead = draft_phase_costs(eng, plan.probe, prompts, new=min(32, new))
    return CostTable(
        verify=verify_costs(eng, plan.verify, at),
        draft_step=step,
        draft_first=first,
        extend={b: {n: row[n] for n in row if n >= 2} for b, row in drafts.items()},
        overhead=overhead,
        decode=decode_costs(eng, plan.decode, prompts, new),
    )
