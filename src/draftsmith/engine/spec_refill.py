"""Speculative decoding that keeps every row busy: a row whose answer ended takes the next prompt.

A static batch runs until its slowest row is done; the rows that finished first idle in their
slots (H200 tune run 7, greedy: 24 % of batch 8's row slots and 20 % of batch 32's). Here the
host reads the `done` flags every `check_every` cycles, harvests the finished rows and prefills
the next prompts into them while the other rows keep their state. The cycle itself is
`SpecDecoder.cycle`, the same four graphs over the same static buffers: a row is only its own
slice of every buffer and cache, and rows are independent, so each greedy answer is the one its
prompt gets alone.

The new prompts are prefilled by runtimes of their own (`Prefiller`: the target and the drafter
over the same weights, with caches and prompt graphs apart from the decoder's), and their K/V
copied into the freed rows: the decoder's own prompt pass writes rows 0..k-1, which are busy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import _trim, check_prompts, eos_list, sync
from draftsmith.engine.graphs import LateFlag
from draftsmith.engine.profiler import make_profiler
from draftsmith.engine.refill import (
    check_rows,
    check_spacing,
    prefill_runtime,
    prompt_into_rows,
    warm_prompts,
)
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_state import SpecResult, SpecState
from draftsmith.engine.speculative import SpecDecoder, drafter_prompt, drafter_tokens, set_eos


class Prefiller:
    """Prompt passes into caches apart from the decoder's: the target's through its runtime's
    shared prefill runtime (`prefill_runtime`), the drafter's through a runtime of the same
    rows that every decoder of this drafter shares (`drafter_prefill_runtime`)."""

    def __init__(self, dec: SpecDecoder) -> None:
        self.dec = dec
        self.rt = prefill_runtime(dec.rt)
        self.drt = drafter_prefill_runtime(self.rt, dec.drafter, dec.drt.max_seq)

    @torch.no_grad()
    def start(self, st: SpecState, rows: list[int], prompts: list[list[int]],
              params: list[SamplingParams] | None = None) -> None:
        """Prefill `prompts` and put each into its row of `st` (the other rows are untouched):
        K/V of both models, the root of the first draft, the first token, counts and flags;
        each row samples with its entry of `params` (default: the decoder's setting)."""
        params = self.dec.row_settings(params, len(rows))
        for at in range(0, len(rows), self.rt.max_batch):
            part = slice(at, at + self.rt.max_batch)
            self._start(st, rows[part], prompts[part], params[part])

    def _start(self, st: SpecState, rows: list[int], prompts: list[list[int]],
               params: list[SamplingParams]) -> None:
        dec, k = self.dec, len(prompts)
        idx = torch.tensor(rows, device=dec.device)
        st.sampling.set(idx, params)
        out, lens, tokens, pos, q = prompt_into_rows(self.rt, st.tpool, rows, prompts,
                                                     dec.aux_ids)
        first = torch.zeros(len(lens), dtype=torch.long, device=dec.device)
        first[:k] = st.sampling.sample(out.logits[:k, 0], idx)  # padded rows: a token all the same
        ext = drafter_tokens(tokens, lens, first)
        logits, hidden = drafter_prompt(self.drt, ext, out.aux, pos, lens, q,
                                        self.drt.caches_for(len(ext)))
        width = q or tokens.shape[1]
        for mine, theirs in zip(st.dcaches, self.drt.caches, strict=True):
            mine.k[idx, :, :width] = theirs.k[:k, :, :width]
            mine.v[idx, :, :width] = theirs.v[:k, :, :width]
        first = first[:k]
        st.root_logits[idx] = logits[:k]
        st.root_hidden[idx] = hidden[:k]
        st.L[idx], st.last[idx] = lens[:k], first
        st.out[idx] = 0
        st.out[idx, 0] = first
        st.count[idx] = 1
        st.done[idx] = (first[:, None] == st.eos).any(-1) | (st.count[idx] >= st.max_new)
        st.all_done.copy_(st.done.all())


@dataclass
class _Rows:
    """Which prompt each row holds (None: idle) and the prompts still waiting."""

    owner: list[int | None]
    queue: deque

    def assign(self, free: list[int]) -> tuple[list[int], list[int]]:
        take = [(r, self.queue.popleft()) for r in free[: len(self.queue)]]
        for r, i in take:
            self.owner[r] = i
        return [r for r, _ in take], [i for _, i in take]

    @property
    def busy(self) -> bool:
        return any(o is not None for o in self.owner)


def refill_every_for(rows: int) -> int:
    """How many cycles apart refills may come by default. Each refill costs a host read and a
    prefill launch whatever its size, and more rows end per cycle at 32 rows than at 8: on the
    H200 (`benchmarks/spec_refill.md`, runs 2-5), every 8 beat every 4 at batch 32 on HumanEval
    in all three runs (chain 1.15-1.19x against 1.10-1.14x, tree 1.13-1.14x against 1.06-1.09x
    over static batches) and tied at batch 8."""
    return 8 if rows >= 32 else 4


@torch.no_grad()
def generate_refill(dec: SpecDecoder, prompts: list[list[int]], max_new_tokens: int,
                    eos_ids: list[int] | None = None, rows: int | None = None,
                    check_every: int | None = None) -> SpecResult:
    """New tokens for every prompt (eos excluded), in prompt order, with `rows` in flight.

    The host reads the done flags one cycle late (`LateFlag`: the queue never drains for it) and
    refills the ended rows at most every `check_every` cycles (a refill drains the queue once;
    None: `refill_every_for(rows)`);
    once no prompt waits, it stops the cycle after every row is done. The result's `decode_s` is
    the whole wall time, prefills included (`prefill_s` is 0), so `tokens_per_s` is the serving
    rate; the accept statistics cover every prompt."""
    check_rows(rows, dec.rt.max_batch)
    check_prompts(prompts, dec.rt.model.cfg.vocab_size)  # before len(): an int's was a TypeError
    check_spacing(check_every, default=True)
    rows = min(rows or dec.rt.max_batch, len(prompts))
    check_every = check_every or refill_every_for(rows)
    eos = eos_list(eos_ids)  # a bare id refused: `eos_ids=0` read as no EOS at all
    _check(dec, prompts, max_new_tokens, eos, rows)
    st, pre = dec._state(rows), _prefiller(dec)
    prof = make_profiler(dec.device, dec.profile)
    sync(dec.rt)
    t0 = time.perf_counter()
    _reset(st, max_new_tokens, eos)
    book = _Rows([None] * rows, deque(range(len(prompts))))
    results: list[list[int]] = [[] for _ in prompts]
    _fill(pre, st, book, list(range(rows)), prompts)
    late = LateFlag(st.all_done, extra=(st.done,))
    all_done, cycles, since = late.seen(), 0, 0
    while not all_done or book.queue:
        dec.cycle(st, prof)
        cycles, since = cycles + 1, since + 1
        all_done = late.seen()  # as of the cycle before this one, which ran it inert
        if book.queue and since >= check_every and (ended := _ended(late.extra_seen[0], book)):
            _harvest(st, book, ended, results, eos, max_new_tokens)
            _fill(pre, st, book, ended, prompts)
            prof.mark("refill")
            late.seen()  # posts the refilled rows' flags (what it reads predates the refill)
            all_done, since = False, 0
    _harvest(st, book, [r for r, o in enumerate(book.owner) if o is not None], results, eos,
             max_new_tokens)
    sync(dec.rt)
    res = SpecResult(results, 0.0, time.perf_counter() - t0, cycles, dec.steps,
                     st.hist.tolist(), st.reached.tolist(), st.accepted.tolist())
    res.extra.update(refill_rows=rows, check_every=check_every)
    res.phases = prof.summary()
    if res.phases is not None:
        res.phases.accept_length, res.phases.accept_rate = res.mean_accept_length, res.accept_rate
    return res


@torch.no_grad()
def warm_refill(dec: SpecDecoder, prompts: list[list[int]], rows: int | None) -> None:
    """Capture, untimed, what a refill run of these prompts will replay: the cycle's graphs at
    `rows` and the prompt graphs (target and drafter) of every row count and bucket its
    prefills use."""
    check_rows(rows, dec.rt.max_batch)
    rows = min(rows or dec.rt.max_batch, len(prompts))  # None: every row, as generate_refill
    if not rows:  # nothing to warm: not a state (and on a GPU its graphs) of no rows
        return
    warm_prompts(_prefiller(dec).rt, prompts, prompt_pass(dec, rows), rows)
    sync(dec.rt)


def prompt_pass(dec: SpecDecoder, rows: int) -> Callable[[list[int], list[list[int]]], None]:
    """What a refill runs for its new prompts (`Prefiller.start` into a state of `rows` rows,
    every row idle), for warm-up and timing: call it with rows and prompts."""
    st = dec._state(rows)
    _reset(st, 1, [])
    return partial(_prefiller(dec).start, st)


def _check(dec: SpecDecoder, prompts: list[list[int]], max_new: int, eos: list[int],
           rows: int) -> None:
    dec._check_inputs(prompts, max_new, eos, batch=rows)


def drafter_prefill_runtime(pre: Runtime, drafter: Any, max_seq: int) -> DrafterRuntime:
    """The drafter's prompt passes beside `pre`, one runtime per (drafter, cache length): the
    decoders of every sampling setting share it and its graphs (a pass draws nothing), so a
    new setting's first requests capture nothing and an evicted decoder leaves no graphs."""
    runtimes = pre.__dict__.setdefault("_drafter_prefill_rts", {})
    key = (drafter, max_seq)
    if key not in runtimes:
        runtimes[key] = DrafterRuntime(drafter, pre.max_batch, max_seq, pre.graphs or False)
    return runtimes[key]


def _prefiller(dec: SpecDecoder) -> Prefiller:
    """One per decoder: its prompt graphs are captured once."""
    if "_prefiller" not in dec.__dict__:
        dec.__dict__["_prefiller"] = Prefiller(dec)
    return dec.__dict__["_prefiller"]


def _reset(st: SpecState, max_new: int, eos: list[int]) -> None:
    st.max_new.fill_(max_new)
    set_eos(st, eos)
    st.done.fill_(True)  # a row without a prompt is inert: it emits nothing and counts nothing
    st.all_done.fill_(True)
    for t in (st.hist, st.reached, st.accepted):
        t.zero_()


def _ended(done: torch.Tensor, book: _Rows) -> list[int]:
    """The rows holding a prompt whose answer is done, from host-side flags."""
    flags = done.tolist()
    return [r for r, o in enumerate(book.owner) if o is not None and flags[r]]


def _harvest(st: SpecState, book: _Rows, ended: list[int], results: list[list[int]],
             eos: list[int], max_new: int) -> None:
    idx = torch.tensor(ended, device=st.out.device)
    counts, outs = st.count[idx].tolist(), st.out[idx].tolist()
    for r, c, o in zip(ended, counts, outs, strict=True):
        results[book.owner[r]] = _trim([o[: min(c, max_new)]], eos)[0]
        book.owner[r] = None


def _fill(pre: Prefiller, st: SpecState, book: _Rows, free: list[int],
          prompts: list[list[int]]) -> None:
    rows, ids = book.assign(free)
    if rows:
        pre.start(st, rows, [prompts[i] for i in ids])
