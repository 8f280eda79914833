"""Batched generation that keeps every row busy: a row whose answer ended takes the next prompt.

A static batch idles a row from its EOS until the longest answer ends; here the host looks at
the `done` flags every `check_every` steps, harvests the finished rows, prefills the next
prompts together (into a scratch cache sized to them, then copied into those rows of the pool)
and decoding goes on. The decode step (forward, sample, per-row append and advance) is one CUDA
graph on GPU, as in `generate.py`; rows are independent, so a greedy answer is the one a
prompt gets alone.
"""

from __future__ import annotations

from collections import deque

import torch

from draftsmith.engine.generate import _trim, check_request, graphed_step, padded, sync
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, sample
from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import KVCache


class RefillState:
    """Static per-row buffers of one decode step over `rows` rows."""

    def __init__(self, rt: Runtime, rows: int, max_new: int, eos: list[int],
                 params: SamplingParams) -> None:
        dev = rt.device
        self.rt, self.rows, self.max_new, self.params = rt, rows, max_new, params
        z = dict(dtype=torch.long, device=dev)
        self.tok, self.pos = torch.zeros(rows, 1, **z), torch.zeros(rows, 1, **z)
        self.count, self.out = torch.zeros(rows, **z), torch.zeros(rows, max_new, **z)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)  # a row without a prompt
        self.eos = torch.tensor(eos or [-1], device=dev)
        self.ar = torch.arange(rows, device=dev)
        self.caches = rt.caches_for(rows)

    def step(self) -> None:
        rt = self.rt
        out = rt.model(self.tok, self.pos, self.caches, compiled=rt.graph_compiled)
        logits = out.logits[:, -1]
        nxt, live = sample(logits, self.params), ~self.done
        col = self.count.clamp(max=self.max_new - 1)
        self.out[self.ar, col] = torch.where(live, nxt, self.out[self.ar, col])
        self.count.add_(live.long())
        ended = (nxt.unsqueeze(1) == self.eos).any(-1) | (self.count >= self.max_new)
        self.done |= live & ended
        self.tok.copy_(torch.where(live, nxt, self.tok[:, 0]).unsqueeze(1))
        self.pos.add_(live.long().unsqueeze(1))

    def start(self, rows: list[int], prompts: list[list[int]]) -> None:
        """Prefill `prompts` into `rows` (any rows, in one forward) and sample their first token."""
        rt = self.rt
        tokens, lens, positions = padded(prompts, rt.device)
        pool, (b, longest) = rt.kv, tokens.shape
        scratch = torch.zeros((pool.shape[0], 2, b, pool.shape[3], longest, pool.shape[5]),
                              dtype=pool.dtype, device=pool.device)
        caches = [KVCache(layer[0], layer[1]) for layer in scratch]
        out = rt.model(tokens, positions, caches, logits_at=lens - 1)
        idx = torch.tensor(rows, device=rt.device)
        pool[:, :, idx, :, :longest] = scratch
        first = sample(out.logits[:, 0], self.params)
        self.tok[idx] = first.unsqueeze(1)
        self.pos[idx] = lens.unsqueeze(1)
        self.out[idx, 0] = first
        self.count[idx] = 1
        self.done[idx] = (first.unsqueeze(1) == self.eos).any(-1) | (self.max_new <= 1)


def prepare(rt: Runtime, rows: int, max_new: int, eos: list[int], params: SamplingParams):
    """Build (and on GPU capture) the step for these settings now: capture's warm-up steps
    draw random numbers, so a caller that seeds per chunk prepares before its first seed and
    a resumed run samples what an uninterrupted one does."""
    return _refiller(rt, min(rows, rt.max_batch), max_new, list(eos), params)


def _refiller(rt: Runtime, rows: int, max_new: int, eos: list[int], params: SamplingParams):
    return graphed_step(rt, ("refill", rows, max_new, tuple(eos), params),
                        lambda: RefillState(rt, rows, max_new, eos, params))


@torch.no_grad()
def generate_refill(
    rt: Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_ids: list[int] | None = None,
    rows: int | None = None,
    check_every: int = 16,
) -> list[list[int]]:
    """New tokens for every prompt (eos excluded), in prompt order, with `rows` in flight
    (fewer prompts than rows leave rows idle: one captured step serves every call)."""
    rows = min(rows or rt.max_batch, rt.max_batch)
    _check(rt, prompts, max_new_tokens)
    eos = list(eos_ids or [])
    state, step = _refiller(rt, rows, max_new_tokens, eos, params)
    state.done.fill_(True)
    queue = deque(enumerate(prompts))
    owner: list[int | None] = [None] * rows
    results: list[list[int]] = [[] for _ in prompts]
    _assign(state, list(range(rows)), owner, queue)
    every = max(1, min(check_every, max_new_tokens // 4))  # short answers: look more often
    while any(o is not None for o in owner):
        for _ in range(every):
            step()
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
    return results


def _assign(state: RefillState, free: list[int], owner: list[int | None], queue: deque) -> None:
    take = [(r, queue.popleft()) for r in free[: len(queue)]]
    if take:
        for r, (i, _) in take:
            owner[r] = i
        state.start([r for r, _ in take], [p for _, (_, p) in take])


def _check(rt: Runtime, prompts: list[list[int]], max_new: int) -> None:
    if max_new < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new}")
    check_request(rt, prompts, max_new)
