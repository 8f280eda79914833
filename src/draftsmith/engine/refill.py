"""Batched generation that keeps every row busy: a row whose answer ended takes the next prompt.

A static batch idles a row from its EOS until the longest answer ends; here the host looks at
the `done` flags every `check_every` steps, harvests the finished rows, prefills the next
prompts together (`prompt_into_rows`: a runtime of their own, graphed per bucket, then their K/V
copied into those rows of the pool) and decoding goes on. The decode step (forward, sample,
per-row append and advance) is one CUDA graph on GPU, as in `generate.py`; rows are
independent, so a greedy answer is the one a prompt gets alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from draftsmith.engine.generate import (
    _trim,
    check_max_new,
    check_request,
    eos_list,
    graphed_step,
    padded,
    sync,
)
from draftsmith.engine.params import whole
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, SamplingParams
from draftsmith.errors import DraftsmithError


class RefillState:
    """Static per-row buffers of one decode step over `rows` rows; each row samples with the
    setting its prompt came with (of `params`' kind or one before it: `sampling.KINDS`)."""

    def __init__(self, rt: Runtime, rows: int, max_new: int, eos: list[int],
                 params: SamplingParams) -> None:
        dev = rt.device
        self.rt, self.rows, self.max_new, self.params = rt, rows, max_new, params
        self.sampling = RowSampling(rows, dev, params)
        z = dict(dtype=torch.long, device=dev)
        self.tok, self.pos = torch.zeros(rows, 1, **z), torch.zeros(rows, 1, **z)
        self.count, self.out = torch.zeros(rows, **z), torch.zeros(rows, max_new, **z)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # a row without a prompt
        self.eos = torch.tensor(eos or [-1], device=dev)
        self.ar = torch.arange(rows, device=dev)
        self.caches = rt.caches_for(rows)
        self.pre = prefill_runtime(rt)

    def step(self) -> None:
        rt = self.rt
        out = rt.model(self.tok, self.pos, self.caches, compiled=rt.graph_compiled)
        logits = out.logits[:, -1]
        nxt, live = self.sampling.sample(logits), ~self.done
        col = self.count.clamp(max=self.max_new - 1)
        self.out[self.ar, col] = torch.where(live, nxt, self.out[self.ar, col])
        self.count.add_(live.long())
        ended = (nxt.unsqueeze(1) == self.eos).any(-1) | (self.count >= self.max_new)
        self.done |= live & ended
        self.tok.copy_(torch.where(live, nxt, self.tok[:, 0]).unsqueeze(1))
        self.pos.add_(live.long().unsqueeze(1))

    def start(self, rows: list[int], prompts: list[list[int]],
              params: list[SamplingParams] | None = None) -> None:
        """Prefill `prompts` into `rows` (any rows) and sample their first token; each row then
        samples with its entry of `params` (default: the state's setting)."""
        params = [self.params] * len(rows) if params is None else list(params)
        for at in range(0, len(rows), self.pre.max_batch):
            part = slice(at, at + self.pre.max_batch)
            idx = torch.tensor(rows[part], device=self.rt.device)
            self.sampling.set(idx, params[part])
            out, lens, _, _, _ = prompt_into_rows(self.pre, self.rt.kv, rows[part], prompts[part])
            k = len(rows[part])
            self._first(idx, out.logits[:k, 0], lens[:k])

    def _first(self, idx: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor) -> None:
        first = self.sampling.sample(logits, idx)
        self.tok[idx] = first.unsqueeze(1)
        self.pos[idx] = lens.unsqueeze(1)
        self.out[idx, 0] = first
        self.count[idx] = 1
        self.done[idx] = (first.unsqueeze(1) == self.eos).any(-1) | (self.max_new <= 1)


# the prefill runtime's rows: refills of more rows than this prefill in parts (its pool is a
# second KV cache of this many rows)
PREFILL_ROWS = 64


def prefill_runtime(rt: Runtime, max_seq: int | None = None,
                    buckets: bool | None = None) -> Runtime:
    """A runtime over `rt`'s model for prompt passes apart from `rt`'s rows: `rt.prompt` writes
    rows 0..b-1, which a refill must leave alone. Graphed per (rows, bucket) where `rt` is. One
    per runtime, as many rows as `rt` (at most PREFILL_ROWS): its cache is scratch, copied out at
    once, so every refilling state of `rt` (any row count, any sampling setting, baseline or
    speculative) shares it. `max_seq` (the first call's): its cache's length, where the caller
    knows the longest prompt (default: `rt`'s); `buckets` (the first call's): prompts padded to
    buckets and graphed (default: as `rt`'s)."""
    if "_prefill_rt" not in rt.__dict__:
        seq = max_seq or rt.max_seq
        rt.__dict__["_prefill_rt"] = Runtime(
            rt.model, min(rt.max_batch, PREFILL_ROWS), seq, graphs=rt.graphs is not None,
            prompt_buckets=rt.prompt_buckets if buckets is None else buckets,
            kept=min(seq, rt.kept))  # prompts: within `rt`'s kept positions
    return rt.__dict__["_prefill_rt"]


def padded_rows(k: int, most: int) -> int:
    """The rows `k` rows pad to: the next power of two, at most `most` (a few sizes, each
    graphed once)."""
    return min(most, 1 << (k - 1).bit_length())


def warm_prompts(pre: Runtime, prompts: list[list[int]],
                 start: Callable[[list[int], list[list[int]]], object], rows: int) -> None:
    """Run `start(rows, prompts)` untimed once for every padded row count `prompt_into_rows`
    can use for refills of up to `rows` rows, and every bucket these prompts fall in: what a
    refill run replays is captured. The first tokens `start` samples leave the random state as
    it was (as `Graphs.capture` does): a seeded run after the warm-up draws what it draws
    without one."""
    if pre.graphs is None:
        return
    one = {pre.bucket(1, len(p)): p for p in prompts}  # a prompt per bucket
    sizes = {padded_rows(k, pre.max_batch) for k in range(1, min(rows, pre.max_batch) + 1)}
    cuda = [pre.device] if torch.device(pre.device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        for size in sorted(sizes, reverse=True):  # largest first: the graphs share one pool
            for p in sorted(one.values(), key=len, reverse=True):
                if pre.bucket(size, len(p)) is not None:  # else eager: nothing to capture
                    k = min(size, rows)  # padded to `size` rows all the same
                    start(list(range(k)), [p] * k)


def prompt_into_rows(pre: Runtime, pool: torch.Tensor, rows: list[int], prompts: list[list[int]],
                     aux_ids: tuple[int, ...] = ()):
    """The prompt pass of `prompts` on `pre` (rows padded to a power of two with copies of the
    last: one prompt graph per power and bucket), their K/V copied into `rows` of `pool`
    ([layers, 2, batch, heads, seq, dim]). Returns pre's output and the padded tokens' lengths,
    tokens, positions and bucket: each covers the padded rows (the first len(rows) are real)."""
    k = len(prompts)
    if (longest := max(map(len, prompts))) > pre.max_seq:  # else an IndexError in its pass
        raise DraftsmithError(f"prompt of {longest} tokens exceeds the prefill runtime's "
                              f"{pre.max_seq} positions")
    more = padded_rows(k, pre.max_batch) - k
    tokens, lens, pos = padded(prompts + prompts[-1:] * more, pre.device)
    out = pre.prompt(tokens, lens, aux_ids)
    q = pre.bucket(*tokens.shape)
    width = q or tokens.shape[1]
    pool[:, :, torch.tensor(rows, device=pre.device), :, :width] = pre.kv[:, :, :k, :, :width]
    return out, lens, tokens, pos, q


def prepare(rt: Runtime, rows: int | None, max_new: int, eos: list[int], params: SamplingParams,
            prompts: list[list[int]] = ()):
    """Build (and on GPU capture) the step for these settings now, so that no chunk pays for
    the capture (which leaves the random state alone: `Graphs.capture`). `prompts`: also
    capture the prompt graphs their refills will use (`warm_prompts`)."""
    check_rows(rows, rt.max_batch)
    check_max_new(max_new)  # 0 made a state whose first token had no slot
    check_params(params)
    rows = rows or rt.max_batch  # None: as generate_refill takes it, every row the runtime has
    state, step = _refiller(rt, rows, max_new, eos_list(eos), params)
    warm_prompts(state.pre, list(prompts), state.start, state.rows)
    state.done.fill_(True)
    return state, step


def _refiller(rt: Runtime, rows: int, max_new: int, eos: list[int], params: SamplingParams):
    """The refilling state of these rows and limits for params' kind of sampling (one state and
    graph serves every setting of the kind and of the kinds before it: `start` gives each row
    its own)."""
    state, step = graphed_step(rt, ("refill", rows, max_new, tuple(eos), params.kind),
                               lambda: RefillState(rt, rows, max_new, eos, params))
    state.params = params  # the setting `start` gives rows by default, until the next call
    return state, step


@torch.no_grad()
def generate_refill(
    rt: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_ids: list[int] | None = None,
    rows: int | None = None,
    check_every: int = 16,
    stats: dict | None = None,
) -> list[list[int]]:
    """New tokens for every prompt (eos excluded), in prompt order, with `rows` in flight
    (fewer prompts than rows leave rows idle: one captured step serves every call); `stats`,
    if given, gets the decode steps run (`steps`)."""
    check_rows(rows, rt.max_batch)
    rows = rows or rt.max_batch
    eos = eos_list(eos_ids)  # a bare id refused: `eos_ids=0` read as no EOS at all
    check_params(params)
    check_spacing(check_every)
    check_request(rt, prompts, max_new_tokens, eos)
    state, step = _refiller(rt, rows, max_new_tokens, eos, params)
    state.done.fill_(True)
    queue = deque(enumerate(prompts))
    owner: list[int | None] = [None] * rows
    results: list[list[int]] = [[] for _ in prompts]
    _assign(state, list(range(rows)), owner, queue)
    every, steps = step_spacing(check_every, max_new_tokens), 0
    while any(o is not None for o in owner):
        for _ in range(every):
            step()
        steps += every
        done = state.done.tolist()
        ended = [r for r, o in enumerate(owner) if o is not None and done[r]]
        if ended:
            idx = torch.tensor(ended, device=rt.device)
            counts, outs = state.count[idx].tolist(), state.out[idx].tolist()
            for r, c, o in zip(ended, counts, outs, strict=True):
                results[owner[r]] = _trim([o[:c]], eos)[0]
                owner[r] = None
            _assign(state, ended, owner, queue)
    sync(rt)
    if stats is not None:
        stats["steps"] = steps
    return results


def check_rows(rows: int | None, most: int) -> None:
    """Rows in flight: None for as many as the engine holds (`most`, its max_batch), else at
    least one and at most that."""
    if rows is not None and not whole(rows):
        raise DraftsmithError(f"rows must be a whole number, got {rows!r}")
    if rows is not None and rows < 1:
        raise DraftsmithError(f"rows must be >= 1, got {rows}")
    if rows is not None and rows > most:
        raise DraftsmithError(f"rows {rows} exceed max_batch {most}")


def check_params(params: SamplingParams) -> None:
    """One SamplingParams for every row (a list failed deep in the state's making)."""
    if not isinstance(params, SamplingParams):
        raise DraftsmithError(f"params must be a SamplingParams, got {params!r}")


def check_spacing(every: int | None, default: bool = False) -> None:
    """check_every: a whole number >= 1 (`default`: also None or 0, the engine's own spacing).
    A string or float was a TypeError at the first look, 0 and negatives ran silently."""
    if default and (every is None or every == 0 and whole(every)):
        return
    if not whole(every) or every < 1:
        raise DraftsmithError(f"check_every must be a whole number >= 1"
                              f"{' (None: by rows)' if default else ''}, got {every!r}")


def step_spacing(check_every: int, max_new: int) -> int:
    """Decode steps between two looks at the done flags: `check_every`, fewer for short
    answers (a quarter of them at most)."""
    return max(1, min(check_every, max_new // 4))


def _assign(state: RefillState, free: list[int], owner: list[int | None], queue: deque) -> None:
    take = [(r, queue.popleft()) for r in free[: len(queue)]]
    if take:
        for r, (i, _) in take:
            owner[r] = i
        state.start([r for r, _ in take], [p for _, (_, p) in take])
