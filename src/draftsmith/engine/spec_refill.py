"""Speculative decoding that keeps every row busy: a row whose answer ended takes the next prompt.

A static batch runs until its slowest row is done; the rows that finished first idle in their
slots (H200 tune run 7, greedy: 24 % of batch 8's row slots and 20 % of batch 32's). Here the
host reads the `done` flags every `check_every` cycles, harvests the finished rows and prefills
the next prompts into them while the other rows keep their state. The cycle itself is
`SpecDecoder.cycle`, the same four graphs over the same static buffers: a row is only its own
slice of every buffer and cache, and rows are independent, so each greedy answer is the one its
prompt gets alone.

The new prompts are prefilled by a runtime of their own (`Prefiller`: the target and the drafter
over the same weights, with caches of `rows` rows and their own prompt graphs), and their K/V
copied into the freed rows: the decoder's own prompt pass writes rows 0..k-1, which are busy.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import _trim, padded, sync
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import sample
from draftsmith.engine.spec_state import SpecResult, SpecState
from draftsmith.engine.speculative import SpecDecoder, drafter_prompt
from draftsmith.errors import DraftsmithError


class Prefiller:
    """Prompt passes for `rows` rows at most, into caches apart from the decoder's."""

    def __init__(self, dec: SpecDecoder, rows: int) -> None:
        rt = dec.rt
        self.dec = dec
        self.rt = Runtime(rt.model, rows, rt.max_seq, graphs=rt.graphs is not None,
                          prompt_buckets=rt.prompt_buckets)
        self.drt = DrafterRuntime(dec.drafter, rows, dec.drt.max_seq, self.rt.graphs or False)

    @torch.no_grad()
    def start(self, st: SpecState, rows: list[int], prompts: list[list[int]]) -> None:
        """Prefill `prompts` and put each into its row of `st` (the other rows are untouched):
        K/V of both models, the root of the first draft, the first token, counts and flags."""
        dec, k = self.dec, len(prompts)
        # a prompt graph per (rows, bucket): pad the rows to a power of two with copies
        more = min(self.rt.max_batch, 1 << (k - 1).bit_length()) - k
        tokens, lens, pos = padded(prompts + prompts[-1:] * more, dec.device)
        out = self.rt.prompt(tokens, lens, dec.aux_ids)
        first = sample(out.logits[:, 0], dec.params)
        ext = torch.cat([tokens[:, 1:], tokens[:, :1]], 1).scatter_(1, (lens - 1)[:, None],
                                                                   first[:, None])
        q = self.rt.bucket(*tokens.shape)
        logits, hidden = drafter_prompt(self.drt, ext, out.aux, pos, lens, q,
                                        self.drt.caches_for(len(ext)))
        width = q or tokens.shape[1]
        idx = torch.tensor(rows, device=dec.device)
        st.tpool[:, :, idx, :, :width] = self.rt.kv[:, :, :k, :, :width]
        for mine, theirs in zip(st.dcaches, self.drt.caches, strict=True):
            mine.k[idx, :, :width] = theirs.k[:k, :, :width]
            mine.v[idx, :, :width] = theirs.v[:k, :, :width]
        lens, first = lens[:k], first[:k]
        st.root_logits[idx] = logits[:k]
        st.root_hidden[idx] = hidden[:k]
        st.L[idx], st.last[idx] = lens, first
        st.out[idx] = 0
        st.out[idx, 0] = first
        st.count[idx] = 1
        st.done[idx] = (first[:, None] == st.eos).any(-1) | (st.count[idx] >= st.max_new)


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


@torch.no_grad()
def generate_refill(dec: SpecDecoder, prompts: list[list[int]], max_new_tokens: int,
                    eos_ids: list[int] | None = None, rows: int | None = None,
                    check_every: int = 8) -> SpecResult:
    """New tokens for every prompt (eos excluded), in prompt order, with `rows` in flight.

    The result's `decode_s` is the whole wall time, prefills included (they interleave with the
    cycles; `prefill_s` is 0), so `tokens_per_s` is the serving rate. Statistics (accept
    histogram, per-position counts) cover every prompt."""
    rows = min(rows or dec.rt.max_batch, len(prompts) or 1)
    eos = list(eos_ids or [])
    _check(dec, prompts, max_new_tokens, eos, rows)
    st = dec._state(rows)
    pre = _prefiller(dec, rows)
    sync(dec.rt)
    t0 = time.perf_counter()
    _reset(st, max_new_tokens, eos)
    book = _Rows([None] * rows, deque(range(len(prompts))))
    results: list[list[int]] = [[] for _ in prompts]
    _fill(pre, st, book, list(range(rows)), prompts)
    every = max(1, min(check_every, max_new_tokens // (dec.steps + 1)))
    cycles = 0
    while book.busy:
        ended = _ended(st, book)
        if not ended:
            for _ in range(every):
                dec.cycle(st)
            cycles += every
            continue
        _harvest(st, book, ended, results, eos, max_new_tokens)
        _fill(pre, st, book, ended, prompts)
    sync(dec.rt)
    res = SpecResult(results, 0.0, time.perf_counter() - t0, cycles, dec.steps,
                     st.hist.tolist(), st.reached.tolist(), st.accepted.tolist())
    res.extra.update(refill_rows=rows, check_every=every)
    return res


@torch.no_grad()
def warm_refill(dec: SpecDecoder, prompts: list[list[int]], rows: int) -> None:
    """Capture, untimed, what a refill run of these prompts will replay: the cycle's graphs at
    `rows` and the prompt graphs of every (power-of-two row count, bucket) its prefills use."""
    rows = min(rows, len(prompts))
    st, pre = dec._state(rows), _prefiller(dec, rows)
    if dec.graphs is None:
        return
    _reset(st, 1, [])
    one = {pre.rt.bucket(1, len(p)): p for p in prompts}  # a prompt per bucket
    k = 1
    while k <= rows:
        for p in one.values():
            pre.start(st, list(range(k)), [p] * k)
        k *= 2
    pre.start(st, list(range(rows)), [next(iter(one.values()))] * rows)
    dec.cycle(st)
    sync(dec.rt)


def _check(dec: SpecDecoder, prompts: list[list[int]], max_new: int, eos: list[int],
           rows: int) -> None:
    if rows > dec.rt.max_batch:
        raise DraftsmithError(f"rows {rows} exceed max_batch {dec.rt.max_batch}")
    if not prompts:
        raise DraftsmithError("empty prompt list")
    dec._check_inputs(prompts, max_new, eos, batch=rows)


def _prefiller(dec: SpecDecoder, rows: int) -> Prefiller:
    """One per decoder and row count: its prompt graphs are captured once."""
    cache = dec.__dict__.setdefault("_prefillers", {})
    if rows not in cache:
        cache[rows] = Prefiller(dec, rows)
    return cache[rows]


def _reset(st: SpecState, max_new: int, eos: list[int]) -> None:
    st.max_new.fill_(max_new)
    st.eos.fill_(-1)
    if eos:
        st.eos[: len(eos)] = torch.tensor(eos, device=st.eos.device)
    st.done.fill_(True)  # a row without a prompt is inert: it emits nothing and counts nothing
    st.all_done.fill_(True)
    for t in (st.hist, st.reached, st.accepted):
        t.zero_()


def _ended(st: SpecState, book: _Rows) -> list[int]:
    """The rows holding a prompt whose answer is done (the loop's one read-back)."""
    done = st.done.tolist()
    return [r for r, o in enumerate(book.owner) if o is not None and done[r]]


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
