"""CUDA graphs: capture callables over static buffers, largest first, in one shared pool."""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from draftsmith.errors import DraftsmithError

_OWNERS = itertools.count(1)
_HELD: list[Any] = []  # graphs dropped while a capture ran, destroyed once it ends
_CAPTURES = [0]  # captures in progress, any Graphs


@contextmanager
def capture_guard() -> Iterator[None]:
    """No graph is destroyed while a capture runs: destroying one is an illegal call then, and
    invalidates the capture (the H200's CUBLAS_STATUS_EXECUTION_FAILED in a process that had run
    `bench` before: the cyclic GC collected its dead decoders mid-capture). The cyclic GC waits,
    and graphs dropped meanwhile are held until the last capture ends."""
    paused = gc.isenabled()
    gc.disable()
    _CAPTURES[0] += 1
    try:
        yield
    finally:
        _CAPTURES[0] -= 1
        if not _CAPTURES[0]:
            _HELD.clear()
        if paused:
            gc.enable()


class Graphs:
    """Captured callables keyed by shape. A callable reads and writes tensors that outlive it
    (static buffers); `replay(key)` returns the outputs it produced at capture time, which the
    next replay overwrites."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def owner(self, obj: object) -> tuple[str, int]:
        """The first element of obj's graph keys. Unlike id(obj), never reused: a new drafter
        runtime that got a dead one's id() replayed the dead one's prompt graph over freed
        buffers (H200 run 15's device-side assert). obj's graphs are forgotten, and the memory
        they hold freed, when obj is collected."""
        tag = ("owner", next(_OWNERS))
        weakref.finalize(obj, self.forget, tag).atexit = False  # exiting frees them anyway
        return tag

    def forget(self, owner: tuple[str, int]) -> None:
        """Drop the graphs whose keys start with this owner tag."""
        self.drop(lambda k: isinstance(k, tuple) and k[:1] == (owner,))

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        """Drop the graphs whose keys match (their memory goes back to the pool). A finalizer
        may call this from whichever thread collects an owner: it iterates a snapshot."""
        for key in [k for k in list(self.graphs) if match(k)]:
            gone = self.graphs.pop(key, None)
            if _CAPTURES[0]:
                _HELD.append(gone)

    def capture(self, key: Hashable, fn: Callable[[], Any], warmup: int = 2) -> Any:
        """Capture fn under key. The warm-up calls (and any compile they trigger) leave the
        random state as they found it: a seeded call that captures a graph draws what a later
        call under the same seed draws. The capture itself consumes nothing until replayed."""
        if torch.device(self.device).type != "cuda":
            raise DraftsmithError(f"CUDA graphs need a CUDA device, not {self.device}: make the "
                                  f"runtime with graphs=False (or None: graphs where CUDA is)")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.random.fork_rng(devices=[self.device]), torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with capture_guard(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs[key] = (graph, out)
        return out

    def replay(self, key: Hashable) -> Any:
        graph, out = self.graphs[key]
        graph.replay()
        return out


def pad_to(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n, or None."""
    fits = [s for s in sorted(sizes) if s >= n]
    return fits[0] if fits else None


def static_inputs(
    b: int, q: int, max_seq: int, device: torch.device, with_slots: bool, with_mask: bool
) -> dict[str, torch.Tensor]:
    """The static input buffers of a graphed forward of q tokens for b rows."""
    static = {
        "tokens": torch.zeros(b, q, dtype=torch.long, device=device),
        "positions": torch.arange(q, device=device).repeat(b, 1),
    }
    if with_slots:
        static["slots"] = static["positions"].clone()
    if with_mask:
        static["mask"] = torch.ones(b, 1, q, max_seq, dtype=torch.bool, device=device)
    return static


def fill(static: dict[str, torch.Tensor], b: int, **inputs: torch.Tensor | None) -> None:
    """Copy a call's inputs into the first b rows of a graph's static buffers."""
    for name, t in inputs.items():
        if t is not None:
            static[name][:b].copy_(t)


def fill_padded(buf: torch.Tensor, t: torch.Tensor) -> None:
    """Copy t [b, n, ...] into the first n positions of buf [b, q, ...] and zero the rest."""
    n = t.shape[1]
    buf[:, n:].zero_()
    buf[:, :n].copy_(t)


def run_keyed(graphs: Graphs | None, key: Hashable, fn: Callable[[], Any]) -> Any:
    """fn() eagerly without graphs; with them, a replay of the graph captured for key on its
    first call (fn reads and writes static buffers only)."""
    if graphs is None:
        return fn()
    if key not in graphs:
        graphs.capture(key, fn)
    return graphs.replay(key)


class LateFlag:
    """A device flag the host reads one step late, so that reading it never drains the queue.

    Each `seen()` returns the value posted by the previous call and posts the current one (a
    non-blocking copy into pinned memory plus an event on CUDA). A loop that launches step k,
    then asks `seen()`, learns whether the rows were all done *before* step k while step k runs;
    when they were, step k changed nothing that callers read (finished rows are inert).
    `late=False` reads the current value instead (profiled runs: no inert step to account for).
    `extra`: small tensors posted and read alongside (`extra_seen`, the same step late)."""

    def __init__(self, flag: torch.Tensor, late: bool = True,
                 extra: tuple[torch.Tensor, ...] = ()) -> None:
        self.flag, self.late, self.extra = flag, late, extra
        cuda = flag.is_cuda
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self.extra_host = [torch.zeros_like(t, device="cpu", pin_memory=cuda) for t in extra]
        self.extra_seen: tuple[torch.Tensor, ...] | None = None
        self.event = torch.cuda.Event() if cuda else None
        self.posted = False

    def seen(self) -> bool:
        if not self.late:
            return bool(self.flag)
        was = False
        if self.posted:
            if self.event is not None:
                self.event.synchronize()
            was = bool(self.host)
            if self.extra:
                self.extra_seen = tuple(t.clone() for t in self.extra_host)
        blocking = self.event is None
        self.host.copy_(self.flag, non_blocking=not blocking)
        for dst, src in zip(self.extra_host, self.extra, strict=True):
            dst.copy_(src, non_blocking=not blocking)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.flag.device))
        self.posted = True
        return was
