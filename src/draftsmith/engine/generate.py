"""Baseline batched generation: one prefill, then decode steps that never leave the device.

A decode step (forward, sample, append, advance) is one CUDA graph on GPU; the host reads one
all-rows-done flag a step late (`LateFlag`), so the GPU always has the next step queued.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.engine.graphs import LateFlag
from draftsmith.engine.params import whole
from draftsmith.engine.profiler import make_clock
from draftsmith.engine.runtime import Runtime, check_window, engine_compile, pinned_at
from draftsmith.engine.sampling import RowSampling, SamplingParams, widest
from draftsmith.engine.spec_state import MAX_EOS
from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Transformer

INT64 = 1 << 63
STEP_EVERY = 16  # decode steps between two calls of run_generation's `on_step`


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt, eos excluded
    prefill_s: float
    decode_s: float
    host: dict | None = None  # HostClock summary (DRAFTSMITH_HOST_TIMING=1)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def prefill(rt: Runtime, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Write every prompt into the cache; return last-position logits [B, V] and lengths [B]."""
    if not len(prompts) or any(not len(p) for p in prompts):  # no prompts: max() raised
        raise DraftsmithError("empty prompt list or empty prompt")
    longest = max(len(p) for p in prompts)
    if longest > rt.max_seq:
        raise DraftsmithError(f"prompt of {longest} tokens exceeds max_seq {rt.max_seq}")
    tokens, lens, _ = padded(prompts, rt.device)
    return rt.prompt(tokens, lens).logits[:, 0], lens


def padded(prompts: list[list[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts right-padded into one batch on `device`: tokens [B, longest], lengths [B] and
    positions [B, longest]."""
    b, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(b, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.as_tensor(p)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    return tokens.to(device), lens, torch.arange(longest, device=device).repeat(b, 1)


class DecodeState:
    """Static tensors one decode step reads and writes; rows sample as `sampling` says (settings
    of `params`' kind and the kinds before it share the state: set the rows' before `reset`)."""

    def __init__(self, rt: Runtime, b: int, eos_ids: list[int], params: SamplingParams) -> None:
        dev = rt.device
        self.rt, self.b = rt, b
        self.sampling = RowSampling(b, dev, params)
        self.tok = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(b, rt.max_seq, dtype=torch.long, device=dev)
        self.step_i = torch.zeros(1, dtype=torch.long, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.all_done = torch.zeros((), dtype=torch.bool, device=dev)
        self.eos = torch.tensor(eos_ids or [-1], device=dev)
        self.caches = rt.caches_for(b)
        self.advance_compiled = (engine_compile(self.advance, pinned_at(b)) if rt.compiled
                                 else self.advance)

    def reset(self, first: torch.Tensor, lens: torch.Tensor) -> None:
        self.tok.copy_(first.view(-1, 1))
        self.pos.copy_(lens.view(-1, 1))
        self.out.zero_()
        self.out[:, 0] = first
        self.step_i.fill_(1)
        self.done.copy_(torch.isin(first, self.eos))
        self.all_done.copy_(self.done.all())

    def step(self) -> None:
        rt = self.rt
        logits = rt.model(self.tok, self.pos, self.caches, compiled=rt.graph_compiled)
        advance = self.advance_compiled if rt.graph_compiled else self.advance
        advance(logits.logits[:, -1])

    def advance(self, logits: torch.Tensor) -> None:
        # a done row repeats the token that ended it: an eos id may lie past the vocabulary
        nxt = torch.where(self.done, self.tok[:, 0], self.sampling.sample(logits))
        self.out.index_copy_(1, self.step_i, nxt.unsqueeze(1))
        self.done |= (nxt.unsqueeze(1) == self.eos).any(-1)  # isin may sync inside a graph
        self.all_done.copy_(self.done.all())
        self.tok.copy_(nxt.unsqueeze(1))
        self.pos.add_(1)
        self.step_i.add_(1)


def decoder(rt: Runtime, b: int, eos_ids: list[int], params: SamplingParams | list[SamplingParams]):
    """A (state, step function) pair, its rows set to `params` (one setting, or one a row); the
    step is a captured CUDA graph where possible, one per kind of sampling (the widest of the
    rows': `sampling.KINDS`)."""
    rt.check(b)  # before a step is made: on GPU its capture wrote past the cache's rows
    rows = row_params(params, b)
    like = widest(rows)
    state, step = graphed_step(rt, ("decode", b, tuple(eos_ids), like.kind),
                               lambda: DecodeState(rt, b, eos_ids, like))
    state.sampling.set(torch.arange(b, device=rt.device), rows)
    return state, step


def graphed_step(rt: Runtime, key: tuple, make: Callable[[], Any]) -> tuple[Any, Callable]:
    """(state, step function) for `key`, made once per runtime: `make()` builds a state whose
    `step()` reads and writes only its static buffers; on GPU the step is captured as a CUDA
    graph and the function replays it."""
    cached = rt.__dict__.setdefault("_steps", {})
    if key not in cached:
        state = make()
        fn = state.step
        if rt.graphs is not None:
            with torch.no_grad():
                rt.graphs.capture(key, state.step)
            fn = lambda: rt.graphs.replay(key)  # noqa: E731
        cached[key] = (state, fn)
    return cached[key]


@torch.no_grad()
def generate(
    model: Transformer | Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    eos_ids: list[int] | None = None,
) -> list[list[int]]:
    return run_generation(model, prompts, max_new_tokens, params, eos_ids).tokens


@torch.no_grad()
def run_generation(
    model: Transformer | Runtime,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams | list[SamplingParams] = SamplingParams(),
    eos_ids: list[int] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> Generation:
    """params: one setting for every prompt, or one a prompt. Sampled rows draw from torch's
    global generator, one draw for the whole batch a step: seed it (`torch.manual_seed`) to
    repeat a run, and a prompt's answer repeats only in the same batch (same prompts, same
    order, same batch size); there is no per-request seed as vLLM's.
    `on_step(steps, finished)`: told every `STEP_EVERY` decode steps and once at the end, the
    decode steps run so far (each wrote one token to every row still running; the prefill wrote
    the first) and the rows finished (an eos written)."""
    eos = eos_list(eos_ids)
    rt = model if isinstance(model, Runtime) else _runtime_for(model, prompts, max_new_tokens)
    check_request(rt, prompts, max_new_tokens, eos)
    state, step = decoder(rt, len(prompts), eos, params)
    sync(rt)
    t0 = time.perf_counter()
    logits, lens = prefill(rt, prompts)
    state.reset(state.sampling.sample(logits), lens)
    sync(rt)
    t1 = time.perf_counter()
    late, host = LateFlag(state.all_done), make_clock()
    late.seen()  # the first token's flag
    i, told = 0, -1  # the last step told: the end is told once, whatever it is
    for i in range(1, max_new_tokens):
        host.start()
        step()
        host.lap("launch")
        if on_step is not None and i % STEP_EVERY == 0:
            told = _tell(on_step, i, state)
        done = eos and late.seen()  # done before this step, which then changed no output
        host.lap("wait")
        if done:
            break
    if on_step is not None and told != i:
        _tell(on_step, i, state)
    sync(rt)
    t2 = time.perf_counter()
    return Generation(_trim(state.out[:, :max_new_tokens].tolist(), eos), t1 - t0, t2 - t1,
                      host.summary())


def _tell(on_step: Callable[[int, int], None], steps: int, state: DecodeState) -> int:
    """on_step(steps, rows finished): reading the count is one small device->host copy that
    waits for the steps queued (the loop's done flag is read a step late and never waits), so
    it is read only every STEP_EVERY steps."""
    on_step(steps, int(state.done.sum()))
    return steps


def check_request(rt: Runtime, prompts: list[list[int]], max_new: int,
                  eos: Sequence[int] = ()) -> None:
    """Every prompt non-empty and in the target's vocabulary, max_new >= 1, eos ids whole
    numbers, and the longest prompt plus max_new within the target's max_position_embeddings
    (past them it decoded on without a word), the runtime's slots and the sliding window."""
    check_prompts(prompts, rt.model.cfg.vocab_size)
    check_eos(eos)
    check_max_new(max_new)
    check_positions(prompts, max_new, rt.model.cfg.max_position_embeddings)
    need = max(len(p) for p in prompts) + max_new
    if need > rt.max_seq:
        raise DraftsmithError(f"prompt + max_new_tokens = {need} exceeds max_seq {rt.max_seq}")
    check_window(need, rt.model.cfg.sliding_window)


def check_max_new(max_new: int) -> None:
    """max_new_tokens a whole number >= 1 (a float one failed deep in a buffer's allocation)."""
    if not whole(max_new):
        raise DraftsmithError(f"max_new_tokens must be a whole number, got {max_new!r}")
    if max_new < 1:
        raise DraftsmithError(f"max_new_tokens must be >= 1, got {max_new}")


def check_positions(prompts: list[list[int]], max_new: int, most: int | None,
                    what: str = "max_new_tokens", window: int | None = None) -> None:
    """The longest prompt plus max_new within the target's max_position_embeddings (`most`),
    as `serve` refuses past it: decoding went on past the positions the target knows; and
    within its sliding window (`window`), which the cached engine does not apply. Front ends
    call it before loading the weights."""
    need = max(map(len, prompts), default=0) + max_new
    if most and need > most:
        raise DraftsmithError(f"the longest prompt + {what} = {need} exceeds the target's "
                              f"max_position_embeddings {most}")
    check_window(need, window, f"the longest prompt + {what} = {need}")


def check_prompts(prompts: list[list[int]], vocab: int) -> None:
    """A non-empty list of non-empty prompts of integer token ids in [0, vocab): an id past the
    embedding is an IndexError on CPU and, on a GPU, a device-side assert that ends the
    process's CUDA context; a float id was cut to an integer without a word."""
    if not isinstance(prompts, (list, tuple)):
        raise DraftsmithError(f"prompts must be a list of token-id lists, not a "
                              f"{type(prompts).__name__}")
    if not prompts:
        raise DraftsmithError("empty prompt list or empty prompt (prompts: lists of token ids)")
    for i, p in enumerate(prompts):
        if not id_sequence(p):
            raise DraftsmithError(f"prompt {i} is not a list of whole-number token ids "
                                  f"(prompts: lists of token ids)")
    if any(not len(p) for p in prompts):
        raise DraftsmithError("empty prompt list or empty prompt (prompts: lists of token ids)")
    for i, p in enumerate(prompts):
        if not whole_numbers(p):
            raise DraftsmithError(f"prompt {i} is not a list of whole-number token ids "
                                  f"(prompts: lists of token ids)")
        if (low := int(min(p))) < 0 or (high := int(max(p))) >= vocab:
            bad = low if low < 0 else high
            raise DraftsmithError(f"prompt {i} holds token id {bad}, outside the target's "
                                  f"vocabulary [0, {vocab})")


def row_params(params: SamplingParams | Sequence[SamplingParams], n: int
               ) -> list[SamplingParams]:
    """n rows' settings from one setting for all or one a row; anything else refused by name
    (a dict or a float failed deep in the sampler with an AttributeError)."""
    rows = [params] * n if isinstance(params, SamplingParams) else params
    if not isinstance(rows, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in rows):
        raise DraftsmithError(f"sampling settings must be a SamplingParams or a list of one a "
                              f"prompt, got {params!r}")
    if len(rows) != n:
        raise DraftsmithError(f"{len(rows)} sampling settings for {n} prompts")
    return list(rows)


def eos_list(eos_ids: Iterable[int] | None) -> list[int]:
    """eos_ids as a checked list (None: none). A bare id is refused: `eos_ids=2` was a
    TypeError, and `eos_ids=0` read as no EOS at all."""
    if eos_ids is None:
        return []
    array = hasattr(eos_ids, "ndim")  # a tensor or a numpy array: a 0-d one is no list
    if (isinstance(eos_ids, (numbers.Number, str, bytes)) or not isinstance(eos_ids, Iterable)
            or array and eos_ids.ndim != 1):
        raise DraftsmithError(f"eos_ids must be a list of token ids, got {eos_ids!r}")
    eos = eos_ids.tolist() if array else list(eos_ids)
    check_eos(eos)
    return distinct_eos(eos)


def check_eos(eos: Sequence[int]) -> None:
    """EOS ids are whole numbers within int64 (they may lie past the vocabulary)."""
    if len(eos) and not (whole_numbers(eos) and min(eos) >= -INT64 and max(eos) < INT64):
        raise DraftsmithError(f"eos ids must be whole numbers within int64, got {list(eos)}")


def check_spec_eos(eos: Sequence[int]) -> None:
    """At most MAX_EOS distinct eos ids: the speculative decoders' buffer (the baseline's
    takes any number); a repeat is one stop id."""
    if (n := len(distinct_eos(eos))) > MAX_EOS:
        raise DraftsmithError(f"{n} distinct eos ids given, speculative decoding takes at most "
                              f"{MAX_EOS}; pass only the ids that end an answer")


def distinct_eos(eos: Iterable[int]) -> list[int]:
    """The eos ids once each, in order: a set of stop ids, so a repeat never counts twice
    (toward MAX_EOS, or in a graph's key)."""
    return list(dict.fromkeys(int(t) for t in eos))


def id_sequence(p: Any) -> bool:
    """Whether p can hold a prompt's ids in order: a 1-d array or tensor, or a sequence that is
    no text (a set or dict has no order and failed in torch; bytes read as ids 0-255; a float,
    None or 0-d array has no len())."""
    if hasattr(p, "ndim"):
        return p.ndim == 1
    return isinstance(p, Sequence) and not isinstance(p, (str, bytes, bytearray))


def whole_numbers(values: Any) -> bool:
    """Whether `values` is a flat sequence of integers: an array's dtype says so; a list's
    element types, gathered in C, must each be an integer type other than bool (a bool summed
    as one, so [True, 5] decoded as [1, 5]; numpy's bool is no Integral)."""
    if hasattr(values, "dtype"):  # a tensor or an array
        t = torch.as_tensor(values)
        return t.dim() == 1 and not (t.dtype.is_floating_point or t.dtype.is_complex
                                     or t.dtype == torch.bool)
    try:
        kinds = set(map(type, values))
    except TypeError:  # not iterable
        return False
    return all(issubclass(k, numbers.Integral) and not issubclass(k, bool) for k in kinds)


def _runtime_for(model: Transformer, prompts: list[list[int]], new: int) -> Runtime:
    """A runtime sized to the request (checked first: a bad one would size it wrong, and one
    past the target's positions would get a cache of its length before its refusal)."""
    check_prompts(prompts, model.cfg.vocab_size)
    check_max_new(new)
    check_positions(prompts, new, model.cfg.max_position_embeddings)
    need = max(len(p) for p in prompts) + new
    return Runtime(model, len(prompts), need + 1, kept=need)


def _trim(rows: list[list[int]], eos: list[int]) -> list[list[int]]:
    out = []
    for r in rows:
        cut = next((i for i, t in enumerate(r) if t in eos), len(r))
        out.append(r[:cut])
    return out


def sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
