"""Speculative decoding with an EAGLE-3 drafter: chains (topk 1) and EAGLE-2 dynamic trees.

A cycle is four phases, each one CUDA graph on GPU (and all four one more graph, replayed
where nothing reads between them: `CYCLE_GRAPH`) and the same code eagerly on CPU:
  draft   chain: the first token from the last extend, then S-1 drafter steps;
          tree: top-k expansion over S depths, then the root + best N-1 nodes
  verify  one target forward over [last token, drafts] with aux capture (a tree sits in scratch
          slots past the committed cache, under an ancestor mask)
  accept  greedy matching or rejection sampling; emit tokens; a tree's accepted path is copied
          into the committed target cache by position
  extend  the drafter re-runs over the S+1 positions from the old length with the target's aux
          states; its output at the accept length starts the next cycle
The host reads one flag per cycle (every row done), a cycle late, so the next cycle is always
queued behind the one it checks. The target cache holds positions < L and
the last emitted token x_L is verified at position L; the drafter pair (x_{p+1}, h_p) sits at p.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from functools import cache, partial

import torch

from draftsmith.engine import tree as trees
from draftsmith.engine import verify
from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import (
    _trim,
    check_eos,
    check_max_new,
    check_positions,
    check_prompts,
    check_spec_eos,
    distinct_eos,
    eos_list,
    padded,
    row_params,
    sync,
)
from draftsmith.engine.graphs import LateFlag
from draftsmith.engine.params import whole
from draftsmith.engine.profiler import PHASES, make_clock, make_profiler
from draftsmith.engine.runtime import Runtime, check_sizes, check_window, engine_compile
from draftsmith.engine.sampling import SamplingParams, check_kinds, draw, probs
from draftsmith.engine.spec_state import SpecResult, SpecState
from draftsmith.errors import DraftsmithError
from draftsmith.layers import validate
from draftsmith.models.eagle3 import Eagle3Drafter, shared_target
from draftsmith.models.llama import Transformer
from draftsmith.switches import env_choice, env_flag

# A compiled engine runs these phases each as one compiled function (drafter forwards, picks
# and buffer writes fused): "draft" (trees), "accept", "extend" (drawn sampled drafts: the
# extend alone, `SAMPLED_DRAFTS`); the rest are
# compiled in parts (the drafter, each pick) with eager glue between them. "0" fuses none.
# H200 run 9 (draft only): tree 7/4/24's draft phase 0.58 -> 0.46 ms, decode-only 2.16x -> 2.28x
# at batch 1. Run 10, accept and extend fused too, same lease: +1.1 % decode tok/s (7/4/24),
# +2.5 % (7/8/48). Where inductor fails to compile one (2.11, run 9: the tree 3/4/8 draft at
# batch 32, before each batch size got static shapes), that batch size runs that phase in
# parts, with a warning.
PHASES_FUSABLE = ("draft", "accept", "extend")
# Sampled decoding's drafts. "topk" (the default): greedy decoding's own drafts (a tree's top-k
# expansion, a chain's argmax), then the target draws its token at every verified position and
# the accept walks the drafts that match those draws, as the greedy accept walks its argmaxes.
# What it emits is ancestral sampling from the target, so it is exact whatever the drafts are
# (SGLang's target-only rule); its draft, accept and extend are greedy's graphs. "drawn": drafts
# drawn from the drafter's distribution, accepted by rejection sampling (Leviathan et al.;
# SpecInfer's multi-round rule in trees): H200 run 26, chat, T 0.7, batch 1: tree 7/4/24 0.57x
# (draft 1.07 ms, accept 1.25) and chain 3 1.05x of the sampled baseline.
SAMPLED_DRAFTS = env_choice("DRAFTSMITH_SAMPLED_DRAFTS", "topk", ("topk", "drawn"))


def fused_phases(value: str) -> frozenset[str]:
    """DRAFTSMITH_FUSED_PHASES: a comma list of PHASES_FUSABLE, "all", or "0"/"none"."""
    v = value.strip().lower()
    if v in ("0", "none", ""):
        return frozenset()
    names = PHASES_FUSABLE if v == "all" else tuple(x.strip() for x in v.split(","))
    if bad := [x for x in names if x not in PHASES_FUSABLE]:
        raise DraftsmithError(f"DRAFTSMITH_FUSED_PHASES={value!r}: unknown phase(s) {bad}; use "
                              f"{', '.join(PHASES_FUSABLE)}, all or 0")
    return frozenset(names)


FUSED_PHASES = fused_phases(os.environ.get("DRAFTSMITH_FUSED_PHASES", "all"))


# 0: every run ends on the late flag alone, one inert cycle later (the A/B of the exact end).
EXACT_END = env_flag("DRAFTSMITH_EXACT_END", "1")
# One CUDA graph a cycle ("1"): the four phases captured once more as one graph, replayed where
# nothing reads between them (no profiler marks, no `tune` rank counts); those keep the four
# phase graphs. Meant to save the GPU's gaps between four graph replays a cycle (~25 us, H200
# run 26's estimate). Off until a GPU lease times it ("0": the phase graphs alone, each batch
# size captured once, not twice).
CYCLE_GRAPH = env_flag("DRAFTSMITH_CYCLE_GRAPH", "0")


def check_drafting(steps: int, topk: int, num_draft_tokens: int | None) -> None:
    """The drafting a SpecDecoder takes: a chain (topk 1) verifies steps + 1 tokens, a tree
    (topk > 1) the num_draft_tokens it is given. Front ends call it before loading a model."""
    given = {"steps": steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
    if bad := {k: v for k, v in given.items() if not (v is None and k == "num_draft_tokens")
               and not whole(v)}:
        raise DraftsmithError("steps, topk and num_draft_tokens must be whole numbers, got "
                              + ", ".join(f"{k} {v!r}" for k, v in bad.items()))
    if steps < 1 or topk < 1:
        raise DraftsmithError(f"steps and topk must be >= 1, got steps {steps}, topk {topk}")
    if topk == 1 and num_draft_tokens not in (None, steps + 1):
        raise DraftsmithError(
            f"with topk 1 num_draft_tokens is steps + 1 = {steps + 1}, got {num_draft_tokens}")
    if topk > 1 and num_draft_tokens is None:
        raise DraftsmithError("a tree (topk > 1) needs num_draft_tokens (--num-draft-tokens)")


def check_pair(tc, dc) -> tuple[int, ...]:
    """A target config and a drafter config that fit (vocab, hidden size, aux layers in range);
    the drafter's aux layer ids. Front ends call it before timing anything."""
    if dc.vocab_size != tc.vocab_size or dc.target_hidden_size != tc.hidden_size:
        raise DraftsmithError(
            f"drafter expects vocab {dc.vocab_size} / hidden {dc.target_hidden_size}, the "
            f"target has vocab {tc.vocab_size} / hidden {tc.hidden_size}"
        )
    return tuple(validate(list(dc.aux_layer_ids), tc.num_layers))


def other_target(dc, fingerprint: str) -> str:
    """'the drafter was trained for target A, this target is B' where the drafter config `dc`
    records another target fingerprint than `fingerprint`, else "" (front ends add what
    follows for them)."""
    fp = dc.target_fingerprint
    if not fp or fp == fingerprint:
        return ""
    return f"the drafter was trained for target {fp}, this target is {fingerprint}"


def reads_drafts(topk: int) -> bool:
    """Whether sampled decoding at `topk` reads the drafts themselves (a tree's siblings, or
    drafts drawn from the drafter's q: `SAMPLED_DRAFTS`), which a d2t of shared target ids
    biases (`check_draft_vocab`'s `sampled`)."""
    return topk > 1 or SAMPLED_DRAFTS == "drawn"


def check_draft_vocab(drafter: Eagle3Drafter, vocab: int, sampled: bool = False) -> None:
    """Every draft id's target id (id + d2t[id]) inside the target's vocabulary: one past it
    was an IndexError in the verify's embedding (on a GPU a device-side assert). sampled: a
    decoder whose sampling reads sibling drafts (a tree) or the drafter's q (drawn drafts), which
    two draft ids of one target token would bias, so such a d2t is refused there too."""
    d2t = drafter.d2t
    if d2t.device.type == "meta":  # not loaded yet: nothing to read
        return
    hot = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    bad = ((hot < 0) | (hot >= vocab)).nonzero()[:, 0].tolist()
    if bad:
        raise DraftsmithError(
            f"the drafter's d2t maps {len(bad)} draft id(s) outside the target's vocabulary of "
            f"{vocab} (draft id {bad[0]} -> {int(hot[bad[0]])}): its vocabulary mapping is not "
            f"this target's; use a drafter trained for this target")
    if sampled and (pair := shared_target(hot)) is not None:
        a, b = pair
        # sibling drafts of one token: the accept walks the deeper copy, and rejection sampling
        # weighs one copy's q; greedy decoding (and a chain matched against the target's
        # draws) emits the target's tokens whatever the drafts are
        raise DraftsmithError(
            f"the drafter's d2t maps draft ids {a} and {b} to one target id {int(hot[a])}: "
            f"sampled speculative decoding with it would not keep the target's distribution; "
            f"decode greedily or use a drafter whose draft ids map to distinct target tokens")


class SpecDecoder:
    """Speculative generation with a target `Runtime` and an EAGLE-3 drafter.

    topk 1 drafts a chain of `steps` tokens (num_draft_tokens is steps + 1); topk > 1 drafts an
    EAGLE-2 tree and verifies `num_draft_tokens` tokens, the root included.
    """

    def __init__(
        self,
        target: Runtime | Transformer,
        drafter: Eagle3Drafter | DrafterRuntime,
        steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        params: SamplingParams = SamplingParams(),
        profile: bool | None = None,
        max_batch: int = 1,
        max_seq: int = 2048,
        fuse_bookkeeping: bool | None = None,
    ) -> None:
        """fuse_bookkeeping: torch.compile the greedy accept arithmetic and tree bookkeeping;
        None = whenever the engine runs compiled graphs (False: the eager ops, for an A/B)."""
        check_drafting(steps, topk, num_draft_tokens)
        if not isinstance(params, SamplingParams):
            raise DraftsmithError(f"params must be a SamplingParams, got {params!r}")
        self.steps, self.topk, self.params, self.profile = steps, topk, params, profile
        # drafts drawn from the drafter's distribution (sampling under "drawn"); otherwise the
        # drafts are greedy's and so are the draft, accept and extend phases
        self.drawn = not params.greedy and SAMPLED_DRAFTS == "drawn"
        self.shape = trees.TreeShape(topk, steps, num_draft_tokens) if topk > 1 else None
        self.n_verify = steps + 1 if self.shape is None else self.shape.tokens
        self.rt = target if isinstance(target, Runtime) else self._runtime(target, max_batch,
                                                                           max_seq)
        self.tbase = self.rt.max_seq - (0 if self.shape is None else self.n_verify)
        self._check_room(self.rt.max_seq)
        fs = 0 if self.shape is None else self.shape.frontier_slots
        if isinstance(drafter, DrafterRuntime):
            self.drt = drafter
        else:
            self.drt = DrafterRuntime(drafter, self.rt.max_batch, self.tbase + fs,
                                      self.rt.graphs or False)
        self.drafter = self.drt.drafter
        if topk > (dv := self.drafter.cfg.draft_vocab_size):
            raise DraftsmithError(f"topk {topk} exceeds the drafter's draft vocabulary of {dv}")
        # graphed phases run the drafter compiled when the target's layers are (its prompt pass
        # runs uncompiled: in a graph per bucket, like the target's prompt, or eager)
        self.compiled = self.rt.graph_compiled
        if self.compiled:
            self.drt.compile()
        self.draft_fn = self.drt.fn if self.compiled else self.drafter
        if self.drt.max_seq < self.tbase + fs:
            raise DraftsmithError(
                f"the drafter runtime holds {self.drt.max_seq} slots, this setting needs "
                f"{self.tbase + fs}"
            )
        self._check_pair()
        self.device = self.rt.device
        self.graphs = self.rt.graphs
        self.gkey = None if self.graphs is None else self.graphs.owner(self)
        self.ar = torch.arange(steps + 1, device=self.device)
        # set by `tune`: a tree's accepted nodes counted by depth and sibling rank, every cycle
        self.rank_counts: trees.RankCounts | None = None
        # sampling without top-k, top-p or top-nσ draws the target's tokens inside the accept,
        # at each row's temperature held as a tensor: every temperature shares one compiled accept
        self.accept_draws = params.kind == "temperature" and not self.drawn
        d = self.drafter.d2t
        self.hot = torch.arange(d.shape[0], device=d.device) + d
        self.states: dict[int, SpecState] = {}
        self.out_width = self.capacity() + steps + 2
        self.chain_pick, self.tree_pick, self.commit_values, self.chain_child = (
            verify.chain_greedy, tree_pick, commit_values, chain_child)
        self.bookkeeping_compiled = False
        fuse = self.compiled if fuse_bookkeeping is None else fuse_bookkeeping
        want = FUSED_PHASES if self.compiled and fuse else frozenset()
        self.fused: frozenset[str] = want & self.fusable()  # each run as one compiled function
        self.phase_fns: dict[str, Callable] = {p: compiled_phase(p) for p in self.fused}
        if fuse and not self.drawn:
            self.compile_bookkeeping()
        if self.shape is not None and trees.fuses_head(self.drafter, self.drafter.lm_head.weight,
                                                        topk):
            trees.draft_head(self.drafter)  # the int8 head made now, before any trace or capture

    def fusable(self) -> frozenset[str]:
        """The phases this engine can run as one compiled function: the extend; the accept unless
        drafts are drawn; a tree's draft unless drafts are drawn, and not under
        DRAFTSMITH_TREE_TOPK=max (inductor failed to compile its root pick)."""
        greedy_drafts, tree = not self.drawn, self.shape is not None
        return frozenset({"extend"} | ({"accept"} if greedy_drafts else set())
                         | ({"draft"} if greedy_drafts and tree and trees.TREE_TOPK != "max"
                            else set()))

    def _check_pair(self) -> None:
        self.aux_ids = check_pair(self.rt.model.cfg, self.drafter.cfg)
        sampled = not self.params.greedy and (self.shape is not None or self.drawn)
        check_draft_vocab(self.drafter, self.rt.model.cfg.vocab_size, sampled)

    # ---- public API ---------------------------------------------------------------------------

    def capacity(self) -> int:
        """The longest prompt + max_new_tokens this decoder can run."""
        return self.tbase - 2 * self.steps - 2

    def margin(self) -> int:
        """The slots past the capacity that drafting takes (a tree's verify scratch slots, and
        the drafts and extend past a row's last kept position)."""
        return (0 if self.shape is None else self.n_verify) + 2 * self.steps + 2

    def _check_room(self, max_seq: int) -> None:
        """max_seq holds a one-token prompt and one new token past the drafting margin."""
        if max_seq - self.margin() < 2:
            raise DraftsmithError(
                f"max_seq {max_seq} is too short for steps {self.steps} and {self.n_verify} "
                f"verify tokens: drafting takes {self.margin()} slots past prompt + answer, so "
                f"it needs at least {self.margin() + 2}")

    def _runtime(self, target: Transformer, max_batch: int, max_seq: int) -> Runtime:
        """The decoder's own runtime: its kept positions are its capacity, held to a sliding
        window (each request is checked against it), its margin past them drafts only."""
        max_batch, max_seq = check_sizes(max_batch, max_seq, "SpecDecoder")
        self._check_room(max_seq)  # before Runtime, whose own refusal names no drafting
        margin = self.margin()
        window = target.cfg.sliding_window
        kept = max_seq - margin if not window else min(max_seq - margin, window)
        return Runtime(target, max_batch, max_seq, kept=kept)

    def capture(self, batch_sizes: list[int]) -> None:
        """Allocate state and capture graphs for these batch sizes, largest first."""
        if bad := [b for b in batch_sizes if not whole(b) or b < 1]:
            raise DraftsmithError(f"batch sizes must be whole numbers >= 1, got {bad[0]!r}")
        for b in sorted(set(batch_sizes), reverse=True):
            if b > self.rt.max_batch:
                raise DraftsmithError(f"batch {b} exceeds max_batch {self.rt.max_batch}")
            self._state(b)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int] | None = None,
        params: list[SamplingParams] | None = None,
    ) -> SpecResult:
        """params: each prompt's setting (or one for all), of the decoder's kind or one before
        it (`KINDS`; default: its own). Sampled rows draw from torch's global generator, as
        `run_generation`'s do: a seeded run repeats only with the same batch of prompts."""
        eos = eos_list(eos_ids)
        prof = make_profiler(self.device, self.profile)
        self._check_inputs(prompts, max_new_tokens, eos)
        params = self.row_settings(params, len(prompts))  # refused before any capture
        st = self._state(len(prompts))  # a first call's capture is no prefill time (as baseline's)
        sync(self.rt)
        t0 = time.perf_counter()
        self._begin(st, prompts, max_new_tokens, eos, params)
        sync(self.rt)
        t1 = time.perf_counter()
        cycles = 0
        late = LateFlag(st.all_done, late=not prof.enabled, extra=(st.count, st.done))
        late.seen()  # posts the prefill's flag (a profiled run's flag is read exactly anyway)
        done = self.finished(st)  # the prefill may have ended every row; synced already
        host = make_clock()
        while not done and cycles < max_new_tokens:
            host.start()
            self.cycle(st, prof)
            host.lap("launch")
            cycles += 1
            done = late.seen()
            if done and late.late:  # it was done before this cycle, which changed nothing
                cycles -= 1
            elif late.late and self.may_end_all(*late.extra_seen, max_new_tokens):
                done = self.finished(st)  # read now: a next launch would be a whole inert cycle
            host.lap("wait")
        sync(self.rt)
        t2 = time.perf_counter()
        res = SpecResult(
            _trim(st.out[:, :max_new_tokens].tolist(), eos), t1 - t0, t2 - t1, cycles,
            self.steps, st.hist.tolist(), st.reached.tolist(), st.accepted.tolist(),
        )
        res.phases = prof.summary()
        if (clocked := host.summary()) is not None:
            res.extra["host"] = clocked
        if res.phases is not None:
            res.phases.accept_length, res.phases.accept_rate = (res.mean_accept_length,
                                                                res.accept_rate)
        return res

    # ---- step API (generate, and callers that stream per cycle) --------------------------------

    @torch.no_grad()
    def start(self, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
              params: list[SamplingParams] | None = None) -> SpecState:
        """Check the inputs, take this batch size's static state and prefill it; each row
        samples with its entry of `params` (default: the decoder's setting; drafts drawn from
        the drafter take the decoder's setting alone)."""
        eos = eos_list(eos)
        self._check_inputs(prompts, max_new_tokens, eos)
        params = self.row_settings(params, len(prompts))
        return self._begin(self._state(len(prompts)), prompts, max_new_tokens, eos, params)

    def _begin(self, st: SpecState, prompts: list[list[int]], max_new_tokens: int,
               eos: list[int], params: list[SamplingParams]) -> SpecState:
        """`start` past its checks (`params`: `row_settings`' one a row), into this batch
        size's state `st`."""
        st.sampling.set(st.rows, params)
        self._prefill(st, prompts, max_new_tokens, eos)
        return st

    @torch.no_grad()  # the fused draft mutates caches inside a compiled graph: no autograd there
    def cycle(self, st: SpecState, prof=None) -> None:
        """One speculative cycle: draft, verify, accept, extend (each a graph on CUDA)."""
        counts = self.rank_counts if st.tree is not None else None
        active = None if counts is None else ~st.done
        if counts is None and not getattr(prof, "enabled", False) and self._run(st, "cycle"):
            return
        if prof is not None:
            prof.start()
        for phase in PHASES:
            self._run(st, phase)
            if prof is not None:
                prof.mark(phase)
        if counts is not None:
            counts.add(st.tree, st.n, st.ext_tok, active, st.path)

    def row_settings(self, params: SamplingParams | list[SamplingParams] | None,
                     n: int) -> list[SamplingParams]:
        """The settings of n rows: `params` (one a row, or one for all, as `run_generation`
        takes them), or (None) the decoder's own; drafts drawn from the drafter take the
        decoder's setting alone."""
        rows = row_params(self.params if params is None else params, n)
        check_kinds(self.params.kind, rows)  # before a state (on a GPU, its capture) is made
        if self.drawn and any(p != self.params for p in rows):
            raise DraftsmithError(f"drafts drawn from the drafter (DRAFTSMITH_SAMPLED_DRAFTS="
                                  f"drawn) sample with the decoder's setting {self.params} "
                                  f"alone: give every row that setting, or unset "
                                  f"DRAFTSMITH_SAMPLED_DRAFTS (its default, topk, takes a "
                                  f"setting a row)")
        return rows

    def may_end_all(self, count: torch.Tensor, done: torch.Tensor, max_new: int) -> bool:
        """Whether the cycle after these output counts and done flags can bring every row still
        running to max_new (a cycle emits at most steps + 1 tokens a row). EOS may end a row
        sooner: then the batch ends on the late read, one inert cycle later, as before."""
        left = max_new - count[~done]
        return EXACT_END and bool(left.numel()) and int(left.max()) <= self.steps + 1

    def finished(self, st: SpecState) -> bool:
        """Every row done: the cycle's one read-back."""
        return bool(st.all_done)

    # ---- setup --------------------------------------------------------------------------------

    def _check_inputs(self, prompts: list[list[int]], max_new: int, eos: list[int],
                      batch: int | None = None) -> None:
        """batch: the rows the prompts run in (default: one row each)."""
        check_prompts(prompts, self.rt.model.cfg.vocab_size)
        check_eos(eos)
        check_spec_eos(eos)
        check_max_new(max_new)
        if (b := batch or len(prompts)) > self.rt.max_batch:
            raise DraftsmithError(f"batch {b} exceeds max_batch {self.rt.max_batch}")
        check_positions(prompts, max_new, self.rt.model.cfg.max_position_embeddings)
        need = max(len(p) for p in prompts) + max_new
        # the window first: past it no longer max_seq would do
        check_window(need, self.rt.model.cfg.sliding_window)
        if need > self.capacity():
            raise DraftsmithError(
                f"prompt + max_new_tokens = {need} exceeds this decoder's capacity "
                f"{self.capacity()} (runtime max_seq {self.rt.max_seq}, steps {self.steps}, "
                f"{self.n_verify} verify tokens); shorten the prompt or max_new_tokens, or "
                f"decode with a max_seq of at least {need + self.margin()}"
            )

    def _state(self, b: int) -> SpecState:
        if b in self.states:
            return self.states[b]
        st = self.states[b] = SpecState(self, b)
        if st.tree is not None and self.bookkeeping_compiled:
            st.tree.compile()
        if self.graphs is not None:
            with torch.no_grad():
                for phase in PHASES + (("cycle",) if CYCLE_GRAPH else ()):
                    fn = partial(getattr(self, "_" + phase), st)
                    out = self.graphs.capture((self.gkey, b, phase), fn)
                    if phase in ("verify", "cycle"):
                        st.vout = out
        return st

    def _run(self, st: SpecState, phase: str) -> bool:
        """Run one phase (its graph where captured); "cycle" runs only as its graph, and says
        whether it ran."""
        key = (self.gkey, st.b, phase)
        if self.graphs is not None and key in self.graphs:
            out = self.graphs.replay(key)
        elif phase == "cycle":
            return False
        else:
            out = getattr(self, "_" + phase)(st)
        if phase in ("verify", "cycle"):
            st.vout = out
        return True

    def _cycle(self, st: SpecState) -> object:
        """The four phases in order, called, not replayed (captured as one graph); the verify's
        output returned."""
        self._draft(st)
        st.vout = self._verify(st)
        self._accept(st)
        self._extend(st)
        return st.vout

    # ---- prefill ------------------------------------------------------------------------------

    def _prefill(self, st: SpecState, prompts: list[list[int]], max_new: int,
                 eos: list[int]) -> None:
        dev = self.device
        tokens, lens, pos = padded(prompts, dev)
        out = self.rt.prompt(tokens, lens, self.aux_ids)
        first = st.sampling.sample(out.logits[:, 0])
        ext = drafter_tokens(tokens, lens, first)
        q = self.rt.bucket(*tokens.shape)
        logits, hidden = drafter_prompt(self.drt, ext, out.aux, pos, lens, q, st.dcaches)
        st.root_logits.copy_(logits)
        st.root_hidden.copy_(hidden)
        st.L.copy_(lens)
        st.last.copy_(first)
        st.out.zero_()
        st.out[:, 0] = first
        st.count.fill_(1)
        st.max_new.fill_(max_new)
        set_eos(st, eos)
        st.done.copy_((first[:, None] == st.eos).any(-1) | (st.count >= st.max_new))
        st.all_done.copy_(st.done.all())
        for t in (st.hist, st.reached, st.accepted):
            t.zero_()

    # ---- the four phases (graph-captured on CUDA) ----------------------------------------------

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = probs(logits, self.params)
        return draw(q), q

    def _draft(self, st: SpecState) -> None:
        if st.tree is not None:
            return self._draft_tree(st)
        h = st.root_hidden[:, None]
        logits = st.root_logits
        for k in range(self.steps):
            if k:  # the pair (d_k, g_{k-1}) at position L + k - 1
                logits, h = self.draft_fn(st.vtok[:, k : k + 1], h, (st.L + k - 1)[:, None],
                                          st.dcaches)
                logits = logits[:, 0]
            if not self.drawn:
                ids, tok = self.chain_child(logits, self.drafter.d2t)
            else:
                ids, q = self._pick(logits)
                tok = self.drafter.to_target(ids)
                st.qbank[:, k] = q
            st.vdraft[:, k] = ids
            st.vtok[:, k + 1] = tok
        st.vtok[:, 0] = st.last
        st.vpos.copy_(st.L[:, None] + self.ar)

    def _draft_tree(self, st: SpecState) -> None:
        t, d2t = st.tree, self.drafter.d2t
        if not self.drawn:
            outs = t.nodes() + (st.vtok, st.vpos, st.vmask)
            args = (st.dcaches, st.root_logits, st.root_hidden, st.L, st.last, d2t, t.own,
                    t.ar_k, t.cand_depth, t.cand_qsrc, t.shape, self.tbase, self.drt.max_seq,
                    self.rt.max_seq, t.head_counts)
            if self._fused(st, "draft", outs, trees.GREEDY_FNS, self.drafter, *args):
                return None
            return greedy_tree_phase(outs, t.fns, self.draft_fn, *args)
        t.expand_root(st.root_logits, st.root_hidden, self.params, d2t)

        def call(tok, hidden, pos, slots, mask):
            return self.draft_fn(tok, hidden, pos, st.dcaches, slots, mask)

        for d in range(1, self.steps):
            t.step(d, call, st.L, self.tbase, self.drt.max_seq, self.params, d2t)
        write_tree(t.nodes() + (st.vtok, st.vpos, st.vmask), t.select(st.last), st.L, self.tbase,
                   self.rt.max_seq)

    def _verify(self, st: SpecState):
        tree = st.tree is not None
        return self.rt.model(
            st.vtok, st.vpos, st.tcaches, st.vslots if tree else None,
            st.vmask if tree else None, self.aux_ids, None, True, self.compiled,
        )

    def _accept(self, st: SpecState) -> None:
        if not self.drawn:  # greedy's drafts: sampling draws the target's tokens inside the
            # accept, or before it under top-k, top-p or top-nσ, each row under its own setting
            eager = self.params.kind == "filtered"
            picks = st.sampling.sample(st.vout.logits) if eager else None
            draws = self.accept_draws
            if not self._fused(st, "accept", st, verify.chain_greedy, tree_pick, commit_values,
                               self.steps, self.tbase, self.ar, picks, draws):
                greedy_accept(st, self.chain_pick, self.tree_pick, self.commit_values, self.steps,
                              self.tbase, self.ar, picks, draws)
            return
        logits, aux, t = st.vout.logits, st.vout.aux, st.tree
        if t is None:
            n, bonus = verify.chain_sampled(logits, st.vtok, st.vdraft, st.qbank, self.hot,
                                            self.params)
            path = self.ar.expand(st.b, -1)
        else:
            best, n, bonus = verify.tree_sampled(
                logits, t.node_tok, t.node_draft, t.node_parent, t.node_qsrc, t.node_depth,
                t.qbank, self.hot, self.params)
            path = trees.path_from(t.anc[st.rows, best], t.node_depth, self.steps)
            copy_path(st, path, self.tbase, self.ar)
            st.path.copy_(path)
        commit(st, self.commit_values, n, bonus, path, aux, self.ar)

    def _extend(self, st: SpecState) -> None:
        logits = not trees.root_by_head(self.drafter, not self.drawn, self.shape)
        if not self._fused(st, "extend", st, self.drafter, self.drafter, self.ar, logits):
            extend_phase(st, self.drafter, self.draft_fn, self.ar, logits)

    def _fused(self, st: SpecState, phase: str, *args) -> bool:
        """Run `phase` as its one compiled function when the engine fuses it; False when it does
        not, or when it failed to compile at this batch size (then it warns once, and this
        batch runs the phase in parts from now on)."""
        if phase not in self.fused or phase in st.unfused:
            return False
        try:
            self.phase_fns[phase](*args)
            return True
        # raised before anything ran; the limit: each batch size, setting and kind of pick (the
        # argmax, or sampled draws) is an entry of the process's one compiled phase
        except (torch._dynamo.exc.BackendCompilerFailed,
                torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            st.unfused.add(phase)
            first = str(e).strip().splitlines()[-1][:200]
            warnings.warn(f"the fused {phase} phase failed to compile at batch {st.b} ({first}); "
                          f"this batch runs it in compiled parts", stacklevel=2)
            return False

    def compile_bookkeeping(self, fuse: frozenset[str] | set[str] | None = None) -> None:
        """The greedy accept's arithmetic (and the trees' draft bookkeeping) torch.compile'd: a few
        fused kernels instead of ~50-80 small ones. The compiled engine does this on its own;
        tests call it to check the compiled functions on CPU. fuse: the phases (of
        PHASES_FUSABLE) to run each as one compiled function (None: those fused already), as far
        as `fusable` allows."""
        self.chain_pick, self.tree_pick, self.commit_values, self.chain_child = compiled_accept()
        self.fused = frozenset(self.fused if fuse is None else fuse) & self.fusable()
        self.phase_fns = {p: compiled_phase(p) for p in self.fused}
        for st in self.states.values():
            if st.tree is not None:
                st.tree.compile()
        self.bookkeeping_compiled = True


def set_eos(st: SpecState, eos: list[int]) -> None:
    """Write the eos ids, once each (a repeat would overrun the MAX_EOS buffer), into the
    state's buffer, -1 past them."""
    eos = distinct_eos(eos)
    st.eos.fill_(-1)
    if eos:
        st.eos[: len(eos)] = torch.tensor(eos, device=st.eos.device)


def drafter_tokens(tokens: torch.Tensor, lens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The drafter's prompt tokens: position p pairs token p+1 with the target's state at p, so
    each right-padded prompt moves left by one and its first new token goes at lens - 1."""
    return torch.cat([tokens[:, 1:], tokens[:, :1]], 1).scatter_(1, (lens - 1)[:, None],
                                                                 first[:, None])


def drafter_prompt(drt: DrafterRuntime, ext: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor,
                   lens: torch.Tensor, q: int | None,
                   caches: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's pass over prompt rows (`ext`: each prompt shifted by one, its first new
    token last) into `caches`: the root's logits and hidden at lens - 1 ([b, V], [b, H]).
    Graphed per (b, bucket q) by `drt.prompt` (which writes `drt`'s own first b rows, so
    `caches` must be those); eager in chunks otherwise (its logits over a long prompt are
    large)."""
    if q is not None and q <= drt.max_seq:
        logits, hidden = drt.prompt(ext, aux, lens, q)
        return logits[:, 0], hidden[:, 0]
    drafter, hidden = drt.drafter, drt.drafter.fuse(aux)
    (b, longest), rows = ext.shape, torch.arange(ext.shape[0], device=ext.device)
    chunk = max(1, 2**25 // (b * drafter.cfg.draft_vocab_size))
    root_l = root_h = None
    for s in range(0, longest, chunk):
        e = min(longest, s + chunk)
        logits, h = drafter(ext[:, s:e], hidden[:, s:e], pos[:, s:e], caches)
        idx = lens - 1 - s
        inside = ((idx >= 0) & (idx < e - s))[:, None]
        idx = idx.clamp(0, e - s - 1)
        pick_l, pick_h = logits[rows, idx], h[rows, idx]
        root_l = pick_l if root_l is None else torch.where(inside, pick_l, root_l)
        root_h = pick_h if root_h is None else torch.where(inside, pick_h, root_h)
    return root_l, root_h


def greedy_accept(st: SpecState, chain_pick: Callable, tree_pick_fn: Callable,
                  commit_fn: Callable, steps: int, tbase: int, ar: torch.Tensor,
                  picks: torch.Tensor | None = None, draws: bool = False) -> None:
    """The greedy accept phase: the longest matching prefix (chain) or path (tree) of the verify's
    output, the tree's accepted K/V moved into place, the commit. The fused engine compiles all
    of it as one function (with the plain picks); otherwise the picks come compiled apart.
    picks: the target's tokens [B, N] drawn by sampled decoding, matched in place of the
    logits' argmax (`SAMPLED_DRAFTS`); draws: draw them here instead, each row at its own
    temperature (plain temperature sampling: `st.sampling`), inside the fused accept's one
    compiled function."""
    if draws:
        picks = st.sampling.sample(st.vout.logits)
    logits, aux, t = st.vout.logits if picks is None else picks, st.vout.aux, st.tree
    if t is None:
        n, bonus = chain_pick(logits, st.vtok)
        path = ar.expand(st.b, -1)
    else:
        n, bonus, path = tree_pick_fn(logits, t.node_tok, t.node_parent, t.node_depth, t.anc,
                                      steps)
        copy_path(st, path, tbase, ar)
    commit(st, commit_fn, n, bonus, path, aux, ar)


def copy_path(st: SpecState, path: torch.Tensor, tbase: int, ar: torch.Tensor) -> None:
    """The accepted nodes' target K/V: scratch slot tbase + node -> slot L + depth."""
    rows = st.rows[:, None]
    src, dst = tbase + path, st.L[:, None] + ar
    st.tpool[:, :, rows, :, dst] = st.tpool[:, :, rows, :, src]  # all layers, K and V


def commit(st: SpecState, commit_fn: Callable, n: torch.Tensor, bonus: torch.Tensor,
           path: torch.Tensor, aux: torch.Tensor, ar: torch.Tensor) -> None:
    """Write one cycle's `commit_values` into the state's buffers."""
    kids = None if st.tree is None else trees.has_child(st.tree.node_parent, path, n)
    idx, emit, count, done, hist, accepted, reached, ext_aux, new_l, last, base = (
        commit_fn(st.vtok, path, n, bonus, st.done, st.count, st.max_new, st.eos, st.L, st.last,
                  aux, ar, st.out.shape[1], kids))
    st.out.scatter_(1, idx, emit)
    st.count.copy_(count)
    st.done.copy_(done)
    st.all_done.copy_(done.all())
    st.hist.add_(hist)
    st.accepted.add_(accepted)
    st.reached.add_(reached)
    st.base.copy_(base)
    st.n.copy_(n)
    st.ext_tok.copy_(emit)
    st.ext_aux.copy_(ext_aux)
    st.L.copy_(new_l)
    st.last.copy_(last)


def extend_phase(st: SpecState, drafter: Eagle3Drafter, forward: Callable,
                 ar: torch.Tensor, logits: bool = True) -> None:
    """The drafter over the S+1 positions from the old length with the target's aux states; its
    output at the accept length seeds the next draft. forward: the drafter or its compiled copy
    (the fused engine compiles this whole function around the plain drafter). Not `logits`: the
    draft forms the root's children from the hidden alone (`trees.root_by_head`), so the head's
    product is skipped and `root_logits` left as it was."""
    pos = st.base[:, None] + ar
    kw = {} if logits else {"logits": False}  # a subclass's forward may not take it
    out, h = forward(st.ext_tok, drafter.fuse(st.ext_aux), pos, st.dcaches, **kw)
    if logits:
        st.root_logits.copy_(out[st.rows, st.n])
    st.root_hidden.copy_(h[st.rows, st.n])


def greedy_tree_phase(outs: tuple[torch.Tensor, ...], fns: tuple, drafter, caches: list,
                      logits: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor,
                      last: torch.Tensor, d2t: torch.Tensor, own: torch.Tensor, ar_k: torch.Tensor,
                      cand_depth: torch.Tensor, cand_qsrc: torch.Tensor, shape: trees.TreeShape,
                      base: int, total: int, vtotal: int,
                      counts: torch.Tensor | None = None) -> None:
    """A greedy tree's draft phase: `trees.greedy_tree`, then the picked nodes and the verify's
    tokens, positions and mask written into `outs` (the tree's node buffers, then vtok, vpos,
    vmask). The fused engine compiles all of it as one function."""
    write_tree(outs, trees.greedy_tree(fns, drafter, caches, logits, hidden, lengths, last, d2t,
                                       own, ar_k, cand_depth, cand_qsrc, shape, base, total,
                                       counts),
               lengths, base, vtotal)


def write_tree(outs: tuple[torch.Tensor, ...], picked: tuple[torch.Tensor, ...],
               lengths: torch.Tensor, base: int, vtotal: int) -> None:
    """The picked nodes (`pick_nodes`' values) and the verify's tokens, positions and mask built
    from them, written into `outs` (the tree's node buffers, then vtok, vpos, vmask)."""
    tok, _, depth, _, _, anc = picked
    new = picked + trees.verify_inputs(tok, depth, anc, lengths, base, vtotal)
    for buf, value in zip(outs, new, strict=True):
        buf.copy_(value)


def tree_pick(logits: torch.Tensor, node_tok: torch.Tensor, node_parent: torch.Tensor,
              node_depth: torch.Tensor, anc: torch.Tensor,
              steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification: (accepted count, bonus token, accepted path by depth)."""
    best, n, bonus = verify.tree_greedy(logits, node_tok, node_parent, node_depth, steps)
    rows = torch.arange(anc.shape[0], device=anc.device)
    return n, bonus, trees.path_from(anc[rows, best], node_depth, steps)


def commit_values(vtok: torch.Tensor, path: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor,
                  done: torch.Tensor, count: torch.Tensor, max_new: torch.Tensor,
                  eos: torch.Tensor, length: torch.Tensor, last: torch.Tensor, aux: torch.Tensor,
                  ar: torch.Tensor, width: int,
                  kids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What one cycle's accept writes, as values (pure): output slots and tokens, new counts and
    done flags, the histogram's and per-position statistics' increments, the extend's inputs,
    new lengths, last tokens, and the extend's base (the old lengths). kids: a tree's rows whose
    accepted node has a child (`trees.has_child`); the position past it counts as reached only
    there (None: a chain, whose every accepted draft but the last has one). The histogram's is a sum
    of one-hot rows: an `index_add_` of int64 is no inductor kernel, and aten's took 11 kernels
    (a sort, bounds checks, asserts: ~20 us of the H200's 42 us accept, run 25's probe)."""
    nxt = torch.cat([vtok.gather(1, path[:, 1:]), bonus[:, None]], 1)
    emit = torch.where(ar < n[:, None], nxt, bonus[:, None])  # also the extend's tokens
    act = ~done
    valid = act[:, None] & (ar <= n[:, None])
    idx = torch.where(valid, count[:, None] + ar, width - 1)
    hit = (valid & (emit[..., None] == eos).any(-1)).any(1)  # isin may sync
    adv = torch.where(act, n + 1, 0)
    new_count = count + adv
    new_done = done | hit | (new_count >= max_new)
    bins = torch.arange(ar.shape[0] + 1, device=ar.device)  # accept lengths 0..S+1
    hist = ((bins == (n + 1)[:, None]) & act[:, None]).sum(0)
    accepted = ((n[:, None] >= ar[1:]) & act[:, None]).sum(0)
    tried = n[:, None] >= ar[:-1]
    if kids is not None:  # a leaf left the next position untried: not reached, not rejected
        tried = (n[:, None] >= ar[1:]) | (tried & kids[:, None])
    reached = (tried & act[:, None]).sum(0)
    ext_aux = aux.gather(1, path[:, :, None, None].expand(*path.shape, *aux.shape[2:]))
    new_l = length + adv
    # the extend's base is the old length, computed rather than the `length` input itself: the
    # fused accept writes both into buffers, and torch 2.13's inductor let the write of the new
    # length reach a buffer copied from the old one (CPU, test_compiled_bookkeeping_...)
    return (idx, emit, new_count, new_done, hist, accepted, reached, ext_aux,
            new_l, torch.where(act, bonus, last), new_l - adv)


def chain_child(logits: torch.Tensor, d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain draft step's greedy pick: (draft id, target token). Pure, so the compiled engine
    compiles it with the token lookup. Reducing 256-wide slices first, as the trees' chunked
    top-k does, left the H200's chain 3 draft phase at 0.15 ms (run 8), so it is one argmax."""
    ids = logits.argmax(-1)
    return ids, ids + d2t[ids]


@cache
def compiled_phase(phase: str) -> Callable:
    """One compiled function per fused phase and process (dynamo specializes per shape/state)."""
    fn = {"draft": greedy_tree_phase, "accept": greedy_accept, "extend": extend_phase}[phase]
    return engine_compile(fn, fullgraph=True, dynamic=False)  # each batch size its own graph


@cache
def compiled_accept() -> tuple:
    """One compiled set per process (dynamo specializes per shape)."""
    return tuple(engine_compile(f, fullgraph=True)
                 for f in (verify.chain_greedy, tree_pick, commit_values, chain_child))
