"""The target runtime: a static KV cache addressed by slot, and graphed forwards of q tokens."""

from __future__ import annotations

import typing
from collections.abc import Callable
from functools import partial

import torch

from draftsmith.engine.graphs import Graphs, fill, fill_padded, pad_to, run_keyed, static_inputs
from draftsmith.engine.params import whole
from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import ForwardOut, KVCache, Transformer
from draftsmith.switches import env_assignments, env_count, env_flag

# Prompt lengths a prefill is padded to (graphed on GPU): steps of 1.5x, so at most a third of a
# padded prompt is padding. Batches over PROMPT_GRAPH_TOKENS padded tokens run eagerly and exact:
# they are compute-bound, and each graph keeps its outputs (aux states [b, q, k, H]) for good.
PROMPT_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                  4096)
PROMPT_GRAPH_TOKENS = 4096


def check_window(need: int, window: int | None, what: str | None = None) -> None:
    """Prompt + answer (`need` positions) within a sliding-window target's window: the engine's
    decode kernels and tree masks see the whole cache, so only positions below the window, whose
    attention the window does not cut, are exact; positions past `need` shape only cut drafts."""
    if window and need > window:
        raise DraftsmithError(
            f"the target attends over a sliding window of {window} tokens, which draftsmith's "
            f"cached engine does not apply: keep prompt and answer within it "
            f"({what or f'prompt + max_new_tokens = {need}'} > {window})")


def check_sizes(max_batch: object, max_seq: object, what: str = "Runtime") -> tuple[int, int]:
    """A runtime's rows and slots as ints: whole numbers >= 1 (a bool or 64.0 is no count)."""
    sizes = {"max_batch": max_batch, "max_seq": max_seq}
    if bad := {k: v for k, v in sizes.items() if not whole(v) or v < 1}:
        raise DraftsmithError(f"{what}: max_batch and max_seq must be whole numbers >= 1, got "
                              + ", ".join(f"{k} {v!r}" for k, v in bad.items()))
    return int(max_batch), int(max_seq)


def check_kept(kept: object, max_seq: int) -> int:
    """A runtime's kept positions: a whole number from 1 to its max_seq (the positions past
    max_seq have no slot to be kept in)."""
    if not whole(kept) or not 1 <= kept <= max_seq:
        raise DraftsmithError(f"Runtime: kept must be a whole number from 1 to max_seq "
                              f"{max_seq}, got {kept!r}")
    return int(kept)


class Runtime:
    """Owns the KV cache of `max_batch` rows x `max_seq` slots for one model.

    `forward` replays a captured CUDA graph when one fits (batch padded up to the nearest
    captured size, q exact) and runs eagerly otherwise. Outputs of a replay are static:
    the next forward overwrites them.
    """

    def __init__(
        self,
        model: Transformer,
        max_batch: int,
        max_seq: int,
        graphs: bool | None = None,
        compile: bool = False,
        prompt_buckets: bool | None = None,
        kept: int | None = None,
    ) -> None:
        """prompt_buckets: prompts padded to a bucket length (`PROMPT_BUCKETS`) and, with graphs,
        prefilled by a captured forward; None = whenever graphs are on. kept: the positions whose
        output is kept, prompt + answer: 1 to max_seq (default max_seq); slots past them are a
        drafting margin whose forwards only shape drafts that get cut."""
        max_batch, max_seq = check_sizes(max_batch, max_seq)
        self.kept = max_seq if kept is None else check_kept(kept, max_seq)
        check_window(self.kept, model.cfg.sliding_window,
                     None if kept is not None else f"max_seq {max_seq}")
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.max_batch, self.max_seq = max_batch, max_seq
        att = model.layers[0].attn
        # one pool [layer, k/v, batch, kv_heads, seq, head_dim]: each layer's K and V are
        # contiguous views, and a tree's accepted path moves in all layers with one copy
        self.kv = torch.zeros((len(model.layers), 2, max_batch, att.kv_heads, max_seq, att.d),
                              dtype=p.dtype, device=p.device)
        self.caches = [KVCache(layer[0], layer[1]) for layer in self.kv]
        self.compiled = compile
        if compile:
            compile_layers(model)
        use = p.device.type == "cuda" if graphs is None else graphs
        self.graphs = Graphs(p.device) if use else None
        self._static: dict[tuple, dict[str, torch.Tensor]] = {}
        self._batches: dict[tuple, list[int]] = {}
        self.prompt_buckets = self.graphs is not None if prompt_buckets is None else prompt_buckets

    @property
    def graph_compiled(self) -> bool:
        """Graphed steps run the torch.compile'd layers (eager calls never do)."""
        return self.compiled and self.graphs is not None

    def caches_for(self, b: int) -> list[KVCache]:
        return [KVCache(c.k[:b], c.v[:b]) for c in self.caches]

    def pool_for(self, b: int) -> torch.Tensor:
        """[layers, 2, b, kv_heads, seq, head_dim]: every cache of the first b rows."""
        return self.kv[:, :, :b]

    def check(self, b: int, positions: torch.Tensor | None = None) -> None:
        if b > self.max_batch:
            raise DraftsmithError(f"batch {b} exceeds the runtime's max_batch {self.max_batch}")

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        aux_ids: tuple[int, ...] = (),
        want_logits: bool = True,
        logits_at: torch.Tensor | None = None,
    ) -> ForwardOut:
        b, q = tokens.shape
        self.check(b)
        flags = (q, tuple(aux_ids), slots is not None, mask is not None, want_logits)
        bp = pad_to(b, self._batches.get(flags, [])) if logits_at is None else None
        if bp is None:
            return self.model(
                tokens,
                positions,
                self.caches_for(b),
                slots,
                mask,
                tuple(aux_ids),
                logits_at,
                want_logits,
            )
        static = self._static[(bp, *flags)]
        fill(static, b, tokens=tokens, positions=positions, slots=slots, mask=mask)
        out = self.graphs.replay((bp, *flags))
        return ForwardOut(*(None if t is None else t[:b] for t in out))

    @torch.no_grad()
    def prompt(self, tokens: torch.Tensor, lens: torch.Tensor,
               aux_ids: tuple[int, ...] = ()) -> ForwardOut:
        """Prefill: right-padded prompts [B, n] into cache slots 0..n-1 of rows 0..B-1. Returns
        the logits at lens - 1 [B, 1, V] and the aux states [B, n, k, H] (hidden left out).

        Eager, a prompt forward launches every kernel of every layer from the host (20-67 ms a
        batch-1 prefill on the H200, run 4, for a 1 ms decode step). With buckets on, the prompt
        is padded to the next bucket length and, with graphs, replays a graph captured for that
        (batch, bucket) on first use. Slots past a row's length get pad tokens' K/V either way;
        they lie ahead of every real position, and decoding overwrites each before reading it.
        Like every graphed forward's, the outputs are static: read them before any other graph
        of this runtime replays (they may share the pool's memory)."""
        b, n = tokens.shape
        self.check(b)
        if n > self.max_seq:  # its K/V would be written past the cache: an IndexError there
            raise DraftsmithError(f"a prompt of {n} tokens exceeds the runtime's max_seq "
                                  f"{self.max_seq}")
        q = self.bucket(b, n)
        if q is None:
            pos = torch.arange(n, device=tokens.device).repeat(b, 1)
            out = self.model(tokens, pos, self.caches_for(b), aux_ids=tuple(aux_ids),
                             logits_at=lens - 1)
            return ForwardOut(out.logits, out.aux, None)
        key = ("prompt", b, q, tuple(aux_ids))
        if key not in self._static:
            self._static[key] = {"tokens": torch.zeros(b, q, dtype=torch.long, device=self.device),
                                 "at": torch.zeros(b, dtype=torch.long, device=self.device)}
        static = self._static[key]
        fill_padded(static["tokens"], tokens)
        static["at"].copy_(lens - 1)
        logits, aux = run_keyed(self.graphs, key, lambda: self._prompt_fn(key))
        return ForwardOut(logits, None if aux is None else aux[:, :n], None)

    def bucket(self, b: int, n: int) -> int | None:
        """The padded length a prompt batch [b, n] runs at, or None: exact and eager (buckets off,
        or a batch big enough to be compute-bound, where padding would only add work)."""
        if not self.prompt_buckets or n > self.max_seq:
            return None
        q = min(next((k for k in PROMPT_BUCKETS if k >= n), self.max_seq), self.max_seq)
        return q if b * q <= PROMPT_GRAPH_TOKENS else None

    def _prompt_fn(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, b, q, aux_ids = key
        static = self._static[key]
        pos = torch.arange(q, device=self.device).repeat(b, 1)
        out = self.model(static["tokens"], pos, self.caches_for(b), None, None, aux_ids,
                         static["at"], True, self.compiled and self.graphs is not None)
        return out.logits, out.aux  # the hidden states stay in the pool, not held

    def capture(
        self,
        batch_sizes: list[int],
        q_sizes: list[int],
        aux_ids: tuple[int, ...] = (),
        with_slots: bool = False,
        with_mask: bool = False,
        want_logits: bool = True,
    ) -> None:
        """Capture forwards for every (batch, q), largest first so the shared pool is reused."""
        if self.graphs is None:
            return
        for q in sorted(q_sizes, reverse=True):
            flags = (q, tuple(aux_ids), with_slots, with_mask, want_logits)
            for b in sorted(batch_sizes, reverse=True):
                self.check(b)
                self._capture_one(b, flags)
                self._batches.setdefault(flags, []).append(b)

    def _capture_one(self, b: int, flags: tuple) -> None:
        q, aux_ids, with_slots, with_mask, want_logits = flags
        static = static_inputs(b, q, self.max_seq, self.device, with_slots, with_mask)
        caches = self.caches_for(b)

        def fn() -> ForwardOut:
            return self.model(
                static["tokens"],
                static["positions"],
                caches,
                static.get("slots"),
                static.get("mask"),
                aux_ids,
                None,
                want_logits,
                self.compiled,
            )

        with torch.no_grad():
            self.graphs.capture((b, *flags), fn)
        self._static[(b, *flags)] = static


# 1: engine compiles run in inductor's deterministic mode (see PIN_ROWS for which). Its reduction
# kernels keep one launch config by a fixed rule (for the one-token attention's score reduction:
# XBLOCK 8, 4 warps) instead of the fastest candidate timed at first launch; timing picked that
# kernel's slow XBLOCK 1 in 4 of 7 fresh caches on the H200 (run 12): 12-15 % fewer tokens a
# second at batch 1. Pinned, run 13's two fresh caches decoded within 0.5 % of the fast draw. The
# mode also skips pad_mm and some reduction autotuning. Default 1 where CUDA is (CPU kernels are
# not autotuned). Functions compiled once per process (the @cache'd phases) keep the value of
# their first compile.
PIN_REDUCTIONS = env_flag("DRAFTSMITH_PIN_REDUCTIONS", "1" if torch.cuda.is_available() else "0")

# With the pin on: the target's compiled forwards over more than this many token rows (batch x
# tokens), and a decode step's bookkeeping over more than this many sequences, compile unpinned,
# through a second compiled set. 1 (the default): of the target's forwards only a batch-1 decode
# step's stays pinned (the drafter and the speculative phases compile pinned). At 8 rows
# the pinned rule's XBLOCK 8 is the slow pick: pinned batch-8 baselines decoded at 4,191-4,203
# tok/s in three processes, timed picks of XBLOCK 32 at 5,031-5,032 in two (H200 run 15; one timed
# cache drew XBLOCK 8 and ran at the pinned speed), and batch 1 under 1 kept the pinned speed.
# 0: no limit, every compile pinned.
PIN_ROWS = env_count("DRAFTSMITH_PIN_ROWS", "1")

# 1: with the pin's second set in use, a one-token decode step over more than PIN_ROWS sequences
# runs its batch size's own unpinned set, compiled for that shape alone (dynamic=False). In the
# shared set the rows turn symbolic once verifies, prompts and other batches have passed through
# it, and its kernels keep the picks timed at the first shape: the plain batch-8 decode then ran
# at 4,231-4,413 tok/s when batch 1 had run first in the process (H200 run 19, three processes),
# against 5,032-5,039 where batch 8 came first (runs 15-16). Its own compile is timed at its own
# shape and draws like those did: 5,028 and 4,190 tok/s in two processes (run 19; the slow draw
# is the config the pin's rule picks). Costs one compile per batch size.
STEP_SETS = env_flag("DRAFTSMITH_STEP_SETS", "1")


def pinned_at(rows: int) -> bool:
    """Whether a compile for `rows` token rows runs pinned."""
    return PIN_REDUCTIONS and (not PIN_ROWS or rows <= PIN_ROWS)


# 1: the engine's GEMMs (linears over more than SMALL_LINEAR_ROWS rows: verifies, drafter depths,
# prompts) may compile as inductor's Triton GEMM templates, timed against cuBLAS at first launch.
# A template can take its neighbours (residual add, activation) into the GEMM's epilogue. On the
# default target they lost (H200 run 14: a 25-row verify 1.22-1.39 ms against 1.15, the tree 6 %
# slower), so 0; kept for larger targets, whose GEMMs are not launch-bound. Needs
# DRAFTSMITH_PIN_REDUCTIONS=0, because the pinned mode takes cuBLAS without timing.
GEMM_TEMPLATES = env_flag("DRAFTSMITH_GEMM_TEMPLATES", "0")


# 1: every engine compile specializes on each shape it meets (torch.compile dynamic=False).
# Otherwise dynamo makes a dimension symbolic the second time it changes: the layers, compiled
# once for every forward of more than PIN_ROWS rows (verifies of 2-64 tokens, drafter depths,
# prompt buckets, batches 1-32), run kernels generic in the rows, each autotuned once at the
# first shape it saw. Costs a compile per shape (the recompile limit rises to 256). H200 run 17,
# fresh caches, batch 1, tree 7/4/24: 2,144 tok/s against 2,116 (verify 1.135 against 1.156 ms),
# one pair and within run-to-run spread (run 15's default: 2,131), so 0.
STATIC_SHAPES = env_flag("DRAFTSMITH_STATIC_SHAPES", "0")


def inductor_options(raw: dict[str, str], name: str = "DRAFTSMITH_INDUCTOR_OPTIONS") -> dict:
    """torch.compile options from `key=value` strings, each value read as that inductor option's
    own type (bools 1 or 0); a key inductor lacks or a value it cannot take is refused here, before
    any compile."""
    if not raw:
        return {}
    import torch._inductor.config as inductor

    known = inductor.get_config_copy()
    out: dict = {}
    for key, value in raw.items():
        if key not in known:
            raise DraftsmithError(f"{name}: inductor has no option {key!r} (dotted for a section, "
                                  "e.g. triton.enable_pdl)")
        out[key] = option_value(name, key, value, option_type(inductor, key, known[key]))
    return out


def option_type(inductor, key: str, current: object) -> type:
    """The type an inductor option holds: its current value's, or for an option unset by
    default (None) the first of bool, int, float, str its declared type admits."""
    if current is not None:
        return type(current)
    entry = getattr(inductor, "_config", {}).get(key)
    admits = typing.get_args(getattr(entry, "value_type", None))
    return next((t for t in admits if t in (bool, int, float, str)), type(None))


def option_value(name: str, key: str, value: str, kind: type) -> bool | int | float | str:
    """`value` as an option of type `kind` holds it."""
    try:
        if kind is bool:
            return {"1": True, "0": False}[value]
        if kind in (int, float, str):
            return kind(value)
    except (KeyError, ValueError):
        pass
    what = f"{'an' if kind.__name__[0] in 'aeiou' else 'a'} {kind.__name__}"
    if kind not in (bool, int, float, str):
        raise DraftsmithError(f"{name}: {key} takes {what}, not settable here")
    raise DraftsmithError(f"{name}: {key}={value!r}: that option takes "
                          + ("1 or 0" if kind is bool else what))


# Extra inductor options for every engine compile: `key=value,...` in torch.compile's keys
# (dotted for a section); `none`: none. Default `combo_kernels=1` where CUDA is (independent
# kernels of one graph launched as one): H200 run 23, one call, fresh caches, `.kept19`, chat,
# faster on both sides at every batch timed: baseline +10 % at batch 1 (1,410 against 1,278
# tok/s), +4 % at batches 8 and 32; speculative +3 % (tree 7/4/24 at batch 1 2,689 against
# 2,617); the engine's 20 GPU tests passed under it. `triton.enable_pdl=1` (programmatic
# dependent launch) lost: the verify 5 % slower (run 22).
INDUCTOR_OPTIONS = inductor_options(env_assignments(
    "DRAFTSMITH_INDUCTOR_OPTIONS", "combo_kernels=1" if torch.cuda.is_available() else "none"))


def compile_options(pinned: bool = True) -> dict | None:
    """inductor options for the engine's compiles under the switches above; pinned=False: one
    that `PIN_ROWS` leaves unpinned."""
    if GEMM_TEMPLATES and PIN_REDUCTIONS:
        raise DraftsmithError("DRAFTSMITH_GEMM_TEMPLATES=1 needs DRAFTSMITH_PIN_REDUCTIONS=0 as "
                              "well: the pinned mode picks cuBLAS without timing a template")
    options: dict = {"deterministic": True} if PIN_REDUCTIONS and pinned else {}
    if GEMM_TEMPLATES:
        options |= {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON,ATEN"}
    return (options | INDUCTOR_OPTIONS) or None


def engine_compile(fn: Callable, pinned: bool = True, **kwargs) -> Callable:
    """torch.compile for the decode engine, under the switches' options."""
    raise_recompile_limit(256 if STATIC_SHAPES else 64)
    if STATIC_SHAPES:
        kwargs.setdefault("dynamic", False)
    return torch.compile(fn, options=compile_options(pinned), **kwargs)


def raise_recompile_limit(at_least: int = 64) -> None:
    """Each setting and batch size specializes the engine's compiled functions once (fullgraph:
    hitting dynamo's default limit of 8 would raise, not fall back)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, at_least)


def compile_layers(model) -> None:
    """torch.compile each decoder layer (fusing its elementwise work) for graphed shapes; the
    layers share one compiled artifact because parameters are graph inputs. Eager calls (a
    prompt that fits no bucket) keep the plain layers, so they never trigger a recompile;
    bucketed prompts compile once per new length until dynamo makes the length dynamic."""
    if model.compiled:
        return
    model.compiled = compiled_parts(model)
    if PIN_REDUCTIONS and PIN_ROWS:
        model.compiled["over"] = (PIN_ROWS, compiled_parts(model, pinned=False))
        if STEP_SETS:
            model.compiled["step"] = (partial(compiled_parts, model, False, dynamic=False), {})


def compiled_parts(model, pinned: bool = True, **kwargs) -> dict:
    """The decoder layers, prologue, finish and aux stack, each torch.compile'd (kwargs:
    torch.compile's, e.g. dynamic=False)."""
    kw = {"fullgraph": True, **kwargs}
    return {
        "layers": [engine_compile(layer.split, pinned, **kw) for layer in model.layers],
        "prologue": engine_compile(model.prologue, pinned, **kw),
        "finish": engine_compile(model.finish, pinned, **kw),
        "aux": engine_compile(model.stack_aux, pinned, **kw),
    }
