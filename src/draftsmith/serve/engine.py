"""The server's adapter over the engine: one target runtime, baseline or speculative decoding,
driven step by step so a caller can watch tokens as they come and stop a batch early.

The baseline driver is `run_generation`'s loop with a watch point added; the speculative driver
is `SpecDecoder`'s step API (`start`, `cycle`, `finished`) with the same watch point per cycle.
`open(rows, params)` gives the scheduler's continuous batches instead: a set of rows that new
requests join as others end (`LiveRows`: the refilling states of `engine/refill.py` and
`engine/spec_refill.py`). Rows sample each with its own request's setting: a batch holds the
settings whose keys merge (`batch_key`, `merged`), so requests of different settings decode
together.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.engine.generate import check_request, decoder, distinct_eos, prefill
from draftsmith.engine.refill import padded_rows, prefill_runtime, warm_prompts
from draftsmith.engine.runtime import PROMPT_BUCKETS, Runtime
from draftsmith.engine.sampling import KINDS, SamplingParams, widest
from draftsmith.engine.spec_state import MAX_EOS
from draftsmith.errors import DraftsmithError
from draftsmith.options import at_least_one
from draftsmith.serve.protocol import ApiError
from draftsmith.serve.text import TextSide

CHECK_EVERY = 16  # read the done flags (and the stream's stop watch) every 16 steps
# sampled settings whose speculative decoders stay warm (buffers and CUDA graphs) besides greedy,
# where each setting needs its own: drafts drawn from the drafter (`SAMPLED_DRAFTS=drawn`)
MAX_DECODERS = 4

# A setting of each kind of sampling: a batch of a kind opens with it, and `warmup` captures the
# kind's graphs with it (every setting of the kind, and of the kinds before it, then replays them).
KIND_SETTINGS = {"greedy": SamplingParams(), "temperature": SamplingParams(1.0),
                 "filtered": SamplingParams(1.0, top_p=0.9)}

# Rows' tokens so far (eos not trimmed) -> True to stop the batch now.
Watch = Callable[[list[list[int]]], bool]


@dataclass(slots=True)
class EngineConfig:
    max_batch: int = 8
    max_prompt_tokens: int = 2048
    max_tokens: int = 1024
    steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    compile: bool = False  # torch.compile the target's layers (and the drafter's phases)
    # every batch opens at max_batch rows: a row's kernels (picked by the row count) and so its
    # greedy answer no longer follow how many requests were waiting (serve_h200.md)
    fixed_rows: bool = False

    def __post_init__(self) -> None:
        names = ("max_batch", "max_prompt_tokens", "max_tokens", "steps", "topk")
        at_least_one({name: getattr(self, name) for name in names})

    @property
    def spec_margin(self) -> int:
        """Cache slots a speculative decoder needs beyond prompt + completion."""
        verify = self.num_draft_tokens or self.steps + 1
        return 2 * self.steps + 3 + verify


@dataclass
class RunResult:
    rows: list[list[int]]  # per row: tokens generated (eos and what follows not trimmed)
    seconds: float
    accept_hist: list[int] | None = None  # speculative: row-cycles that emitted k tokens


class ServeEngine:
    """Target + optional drafter; `run` executes one static batch. Not thread-safe: one worker
    thread calls `run`; `chat_ids` / `text_ids` / `decode` may be called from any thread."""

    def __init__(self, target: Any, model: Any, drafter: Any = None,
                 cfg: EngineConfig | None = None) -> None:
        self.target, self.cfg, self.drafter = target, cfg or EngineConfig(), drafter
        c = self.cfg
        self.eos = distinct_eos(target.eos_ids)
        if drafter is not None and len(self.eos) > MAX_EOS:  # else every batch failed to open
            raise DraftsmithError(f"the target has {len(self.eos)} eos ids; speculative decoding "
                                  f"takes at most {MAX_EOS}")
        margin = c.spec_margin if drafter is not None else 1
        # rows' prompts prefill in the prefill runtime below, never in this one's rows: no bucket
        # padding here, where the cache is sized up front for prompt + completion
        self.rt = Runtime(model, c.max_batch, c.max_prompt_tokens + c.max_tokens + margin,
                          compile=c.compile, prompt_buckets=False,
                          kept=c.max_prompt_tokens + c.max_tokens)
        # the rows' prompt passes: a cache only as long as the longest prompt, graphed per
        # (rows, bucket) on CUDA (`warmup` captures them: a capture on first use stalls a request)
        prefill_runtime(self.rt, c.max_prompt_tokens, buckets=self.rt.graphs is not None)
        self.vocab_size = target.cfg.vocab_size
        self._text_tools(target)
        self._spec: OrderedDict[Any, Any] = OrderedDict()
        self._drt = None
        # why sampled requests are refused (400), checked here: their decoders are built on a
        # kind's first request, too late to refuse it as the request's fault
        self.greedy_only: str | None = None
        if drafter is not None:
            self._spec_for(SamplingParams())
            self.greedy_only = self._sampled_refusal()

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def max_len(self) -> int:
        return self.cfg.max_prompt_tokens + self.cfg.max_tokens

    # ---- text ----------------------------------------------------------------------------------

    def _text_tools(self, target: Any) -> None:
        # A tokenizer is not safe to share between threads ("Already borrowed"), hence the
        # locks (the text side's own for parsing); the batch loop detokenizes with its own copy,
        # so it never waits behind the request threads' chat templates (py-spy saw it waiting in
        # serve_host).
        self.text_side = TextSide(target.tokenizer, self.vocab_size, self.max_len)
        self._detok_lock = threading.Lock()
        self._detok = copy.deepcopy(target.tokenizer)

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]:
        return self.text_side.chat_ids(messages, most)

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        return self.text_side.text_ids(text, most)

    def decode(self, ids: list[int]) -> str:
        with self._detok_lock:
            return self._detok.decode(ids, skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------------------------

    def batch_key(self, params: SamplingParams) -> Any:
        """The key of a request's setting (`merged` says which keys share a batch): its kind of
        sampling (`SamplingParams.kind`), or the setting itself where the speculative decoder
        draws its drafts from the drafter under it. A sampled setting on a server that decodes
        greedily only (`greedy_only`) is refused here, as the scheduler queues it: a 400."""
        if self.greedy_only is not None and not params.greedy:
            raise ApiError(400, f"this server decodes greedily only, send temperature 0: "
                                f"{self.greedy_only}", "temperature", "greedy_only")
        return params if self._drawn(params) else params.kind

    @staticmethod
    def merged(a: Any, b: Any) -> Any:
        """The key of a batch that holds requests of keys a and b, or None: kinds merge into the
        wider (`sampling.KINDS`: its code serves the kinds before it), a setting only with
        itself."""
        if isinstance(a, str) and isinstance(b, str):
            return max(a, b, key=KINDS.index)
        return a if a == b else None

    @staticmethod
    def template(key: Any) -> SamplingParams:
        """The setting a batch of `key` opens with."""
        return KIND_SETTINGS[key] if isinstance(key, str) else key

    def _sampled_refusal(self) -> str | None:
        """Why this drafter cannot decode sampled requests (`check_draft_vocab`: a d2t sending
        two draft ids to one target token, under trees or drawn drafts), or None."""
        from draftsmith.engine.speculative import check_draft_vocab, reads_drafts

        if not reads_drafts(self.cfg.topk):
            return None
        try:
            check_draft_vocab(self._drt.drafter, self.vocab_size, sampled=True)
        except DraftsmithError as e:
            return str(e)
        return None

    def _drawn(self, params: SamplingParams) -> bool:
        from draftsmith.engine.speculative import SAMPLED_DRAFTS

        return self.speculative and not params.greedy and SAMPLED_DRAFTS == "drawn"

    def run(self, prompts: list[list[int]], max_new: int,
            params: SamplingParams | list[SamplingParams], watch: Watch | None = None,
            every: int = 1) -> RunResult:
        """Generate for one batch, each row under its entry of `params` (one setting: all rows;
        settings whose keys merge); `watch` sees the rows every `every` steps (or cycles)."""
        if len(prompts) > self.cfg.max_batch:
            raise DraftsmithError(f"batch {len(prompts)} exceeds max_batch {self.cfg.max_batch}")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        self._check_key(params)
        t0 = time.perf_counter()
        if self.speculative:
            rows, hist = self._run_spec(prompts, max_new, params, watch, every)
        else:
            rows, hist = self._run_baseline(prompts, max_new, params, watch, every), None
        return RunResult(rows, time.perf_counter() - t0, hist)

    def open(self, rows: int, params: SamplingParams) -> LiveRows:
        """`rows` idle rows that prompts join (`add`, each with a setting whose key merges into
        params') and leave (`drop`) while others decode."""
        if not 1 <= rows <= self.cfg.max_batch:
            raise DraftsmithError(f"rows {rows} outside 1..max_batch {self.cfg.max_batch}")
        if self.speculative:
            return _SpecRows(self, rows, params)
        return _BaselineRows(self, rows, params)

    def _check_key(self, params: list[SamplingParams]) -> None:
        key = self.batch_key(params[0])
        for p in params[1:]:
            if (key := self.merged(key, self.batch_key(p))) is None:
                raise DraftsmithError(f"one batch cannot hold settings {params[0]} and {p} "
                                      "(drafts drawn from the drafter: one setting a batch)")

    def warmed_kinds(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        """The kinds of sampling `warmup` warms of `kinds`: greedy, and the sampled ones whose
        warmed decoder would serve requests (none where drafts are drawn from the drafter, one
        decoder a setting; none where the server decodes greedily only)."""
        if bad := [k for k in kinds if k not in KIND_SETTINGS]:
            raise DraftsmithError(f"unknown kind(s) of sampling {bad}; use "
                                  f"{', '.join(KIND_SETTINGS)}")
        return tuple(k for k in dict.fromkeys(("greedy", *kinds))
                     if not self._drawn(p := KIND_SETTINGS[k])
                     and (self.greedy_only is None or p.greedy))

    def warmup(self, batch_sizes: list[int] | None = None,
               kinds: tuple[str, ...] = ("greedy",)) -> None:
        """Open, fill and step rows of each kind of sampling (`KIND_SETTINGS`) at every size a
        batch opens at (`batch_rows`: powers of two up to max_batch), or at `batch_sizes`, and
        prefill rows at every row count and prompt bucket: on CUDA this captures (and compiles)
        their graphs up front, where the first request of a kind would otherwise wait for it.
        Sampled kinds are skipped where drafts are drawn from the drafter (`batch_key`: one
        decoder a setting there) and where the server decodes greedily only (`greedy_only`)."""
        tok = [self.eos[0] if self.eos else 0]
        c = self.cfg
        sizes = batch_sizes or opened_rows(c.max_batch, c.fixed_rows)
        for kind in self.warmed_kinds(kinds):
            params = KIND_SETTINGS[kind]
            for b in sorted(sizes, reverse=True):
                live = self.open(b, params)
                live.add(list(range(b)), [tok] * b, [params] * b)
                live.step(1)
        pre = prefill_runtime(self.rt)
        if pre.graphs is not None and pre.prompt_buckets:
            lens = [n for n in PROMPT_BUCKETS if n < c.max_prompt_tokens] + [c.max_prompt_tokens]
            live = self.open(max(sizes), SamplingParams())
            warm_prompts(pre, [tok * n for n in lens], live.add, live.rows)

    @torch.no_grad()
    def _run_baseline(self, prompts: list[list[int]], max_new: int,
                      params: list[SamplingParams], watch: Watch | None,
                      every: int) -> list[list[int]]:
        rt, eos = self.rt, self.eos
        check_request(rt, prompts, max_new)
        state, step = decoder(rt, len(prompts), eos, params)
        logits, lens = prefill(rt, prompts)
        state.reset(state.sampling.sample(logits), lens)
        n = 1
        for i in range(1, max_new):
            if watch is not None and i % every == 0 and watch(state.out[:, :n].tolist()):
                break
            step()
            n += 1
            if i % CHECK_EVERY == 0 and eos and bool(state.done.all()):
                break
        return state.out[:, :n].tolist()

    @torch.no_grad()
    def _run_spec(self, prompts: list[list[int]], max_new: int, params: list[SamplingParams],
                  watch: Watch | None, every: int) -> tuple[list[list[int]], list[int]]:
        dec, eos = self._spec_for(widest(params)), self.eos
        st = dec.start(prompts, max_new, eos, params)
        cycles = 0
        while cycles < max_new and not dec.finished(st):
            dec.cycle(st)
            cycles += 1
            if watch is not None and cycles % every == 0 and watch(_spec_rows(st, max_new)):
                break
        return _spec_rows(st, max_new), st.hist.tolist()

    # ---- decoders per sampling setting ---------------------------------------------------------

    def _spec_for(self, params: SamplingParams) -> Any:
        """The speculative decoder of params' batch key (made with params: every setting of the
        key then runs in it, each row its own)."""
        from draftsmith.engine.speculative import SpecDecoder

        key = self.batch_key(params)
        if key in self._spec:
            self._spec.move_to_end(key)
            return self._spec[key]
        c = self.cfg
        dec = SpecDecoder(self.rt, self._drt or self.drafter, c.steps, c.topk,
                          c.num_draft_tokens, params)
        if dec.capacity() < self.max_len:
            raise DraftsmithError(
                f"the speculative decoder holds {dec.capacity()} tokens, the server's limits need "
                f"{self.max_len} (--max-prompt-tokens + --max-tokens-limit)"
            )
        self._drt = dec.drt
        self._spec[key] = dec
        while len(self._spec) > MAX_DECODERS + 1:
            self._evict_spec()
        return dec

    def _evict_spec(self) -> None:
        key = next(k for k in self._spec if k != "greedy")
        dec = self._spec.pop(key)
        if dec.graphs is not None:
            dec.graphs.forget(dec.gkey)


class LiveRows:
    """Rows decoding together, each its own request's: `add` prefills prompts into idle rows,
    `step(n)` runs n decode steps (or speculative cycles) over all of them, `read` returns rows'
    tokens so far (eos not trimmed) and whether each ended (eos or the server's max_tokens),
    `drop` idles rows. An idle or ended row is inert: it emits nothing."""

    tokens_per_step = 1  # the most tokens a step can emit a row

    def __init__(self, eng: ServeEngine, rows: int) -> None:
        self.eng, self.rows = eng, rows

    def _idx(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, device=self.eng.rt.device)

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        """Prompts within max_prompt_tokens: the prefill runtime holds no more (a longer one
        was an IndexError in its pass)."""
        most = self.eng.cfg.max_prompt_tokens
        if (longest := max(map(len, prompts), default=0)) > most:
            raise DraftsmithError(f"prompt of {longest} tokens exceeds max_prompt_tokens {most}")

    def read(self, slots: list[int]) -> tuple[list[list[int]], list[bool]]:
        st, idx = self.state, self._idx(slots)
        cap = self.eng.cfg.max_tokens
        # two read-backs, and only the tokens written so far: a look at 32 rows of a server
        # with max_tokens 1024 once copied all 32K slots of `out` into Python ints
        counts, done = torch.stack((st.count[idx], st.done[idx].long())).tolist()
        counts = [min(c, cap) for c in counts]
        outs = st.out[idx, : max(counts, default=0)].tolist()
        return [o[:c] for o, c in zip(outs, counts, strict=True)], [bool(d) for d in done]

    def drop(self, slots: list[int]) -> None:
        if slots:
            self.state.done[self._idx(slots)] = True

    @property
    def hist(self) -> list[int] | None:
        return None


class _BaselineRows(LiveRows):
    def __init__(self, eng: ServeEngine, rows: int, params: SamplingParams) -> None:
        from draftsmith.engine.refill import _refiller

        super().__init__(eng, rows)
        self.state, self._step = _refiller(eng.rt, rows, eng.cfg.max_tokens, eng.eos, params)
        self.state.done.fill_(True)

    def add(self, slots: list[int], prompts: list[list[int]],
            params: list[SamplingParams] | None = None) -> None:
        check_request(self.eng.rt, prompts, self.eng.cfg.max_tokens)
        self._check_prompts(prompts)
        self.state.start(slots, prompts, params)

    @torch.no_grad()
    def step(self, n: int) -> None:
        for _ in range(n):
            self._step()


class _SpecRows(LiveRows):
    def __init__(self, eng: ServeEngine, rows: int, params: SamplingParams) -> None:
        from draftsmith.engine.spec_refill import _prefiller, _reset

        super().__init__(eng, rows)
        self.dec = eng._spec_for(params)
        self.tokens_per_step = self.dec.steps + 1
        self.state, self.pre = self.dec._state(rows), _prefiller(self.dec)
        _reset(self.state, eng.cfg.max_tokens, eng.eos)

    def add(self, slots: list[int], prompts: list[list[int]],
            params: list[SamplingParams] | None = None) -> None:
        self.dec._check_inputs(prompts, self.eng.cfg.max_tokens, self.eng.eos, batch=self.rows)
        self._check_prompts(prompts)
        self.pre.start(self.state, slots, prompts, params)

    @torch.no_grad()
    def step(self, n: int) -> None:
        for _ in range(n):
            self.dec.cycle(self.state)

    def drop(self, slots: list[int]) -> None:
        super().drop(slots)
        self.state.all_done.copy_(self.state.done.all())

    @property
    def hist(self) -> list[int]:
        return self.state.hist.tolist()


def _spec_rows(st: Any, max_new: int) -> list[list[int]]:
    out, counts = st.out[:, :max_new].tolist(), st.count.tolist()
    return [r[: min(c, max_new)] for r, c in zip(out, counts, strict=True)]


def batch_rows(need: int, max_batch: int, fixed: bool = False) -> int:
    """The rows a batch for `need` rows opens with: the next power of two, at most max_batch
    (a few sizes, each captured and compiled once; the spare rows take joiners or idle), or
    max_batch itself when `fixed`."""
    return max_batch if fixed else padded_rows(need, max_batch)


def opened_rows(max_batch: int, fixed: bool = False) -> list[int]:
    """Every row count a batch opens with (`batch_rows`), ascending: what the warm-up warms."""
    return sorted({batch_rows(k, max_batch, fixed) for k in range(1, max_batch + 1)})


def trim(row: list[int], eos: list[int]) -> tuple[list[int], bool]:
    """Tokens before the first eos, and whether an eos was there."""
    cut = next((i for i, t in enumerate(row) if t in eos), None)
    return (row, False) if cut is None else (row[:cut], True)


def check_limits(cfg: EngineConfig, most: int | None, window: int | None) -> None:
    """Every request's prompt + completion within the target's positions and sliding window
    (which the cached engine does not apply), before the weights load."""
    need = cfg.max_prompt_tokens + cfg.max_tokens
    for limit, what in ((most, f"max_position_embeddings {most}"),
                        (window, f"sliding window of {window} tokens, which draftsmith's cached "
                                 "engine does not apply")):
        if limit and need > limit:
            raise DraftsmithError(f"--max-prompt-tokens + --max-tokens-limit = {need} exceeds "
                                  f"the target's {what}")


def load_engine(target: str, drafter: str | Path | None, device: str, dtype: torch.dtype,
                cfg: EngineConfig, log: Callable[[str], None] = print) -> ServeEngine:
    from draftsmith.targets import load_target

    t = load_target(target)
    check_limits(cfg, t.cfg.max_position_embeddings, t.cfg.sliding_window)
    model = t.build(dtype, device)
    d, said = None, []
    if drafter is not None:
        from draftsmith.models.eagle3 import load_drafter

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            d = load_drafter(drafter, device, dtype, embed=model.embed.weight)
        fp = d.cfg.target_fingerprint
        if fp and fp != t.fingerprint:
            log(f"warning: {drafter} was trained for target {fp}, this target is {t.fingerprint}")
    eng = ServeEngine(t, model, d, cfg)
    for w in said:  # the refusal below names a shared d2t pair itself
        if eng.greedy_only is None or "d2t" not in str(w.message):
            log(f"warning: {w.message}")
    if eng.greedy_only is not None:
        log(f"warning: sampled requests will be refused (400), greedy ones served: "
            f"{eng.greedy_only}")
    return eng
