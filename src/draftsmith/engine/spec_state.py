"""What a speculative run returns (`SpecResult`) and the static buffers of one batch size
(`SpecState`) that the graphed phases of `SpecDecoder` read and write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.engine import tree as trees
from draftsmith.engine.profiler import PhaseSummary
from draftsmith.engine.sampling import RowSampling
from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    from draftsmith.engine.speculative import SpecDecoder

# eos ids a speculative batch checks: a fixed size, so graphed cycles keep static shapes (a
# [rows, tokens, MAX_EOS] compare a cycle: nothing measurable at 64, which llama.cpp's
# end-of-generation ids and a config's own fit in with room)
MAX_EOS = 64


@dataclass
class SpecResult:
    tokens: list[list[int]]  # new tokens per prompt, eos excluded
    prefill_s: float
    decode_s: float
    # cycles launched: a static run leaves out its last, inert one; a refilled run counts the
    # cycles its late done flags let run idle too (they cost wall time; tune's model counts them)
    cycles: int
    steps: int
    # [k]: row-cycles whose verify accepted k - 1 drafts (k = 0..steps+1), counted whole where
    # EOS or max_new cut the answer inside them: the drafter's acceptance, not tokens kept
    accept_hist: list[int]
    reached: list[int]  # [i]: row-cycles in which draft position i+1 was verified
    accepted: list[int]  # [i]: ... and accepted
    phases: PhaseSummary | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def merged(cls, parts: list[SpecResult]) -> SpecResult:
        """One result over several runs of one decoder: tokens and times added up, histogram
        and position counts summed column by column, `extra` kept (`merged_extra`; phases are
        left to the caller); results of no run, or of decoders drafting other depths, refused."""
        if not parts:
            raise DraftsmithError("no speculative results to merge")
        if len(depths := {p.steps for p in parts}) > 1:
            raise DraftsmithError(f"results of decoders drafting {sorted(depths)} steps cannot "
                                  "merge into one: merge each decoder's own")

        def summed(key: str) -> list[int]:
            return [sum(c) for c in zip(*(getattr(p, key) for p in parts), strict=True)]

        return cls([t for p in parts for t in p.tokens], sum(p.prefill_s for p in parts),
                   sum(p.decode_s for p in parts), sum(p.cycles for p in parts), parts[0].steps,
                   summed("accept_hist"), summed("reached"), summed("accepted"),
                   extra=cls.merged_extra(parts))

    @classmethod
    def merged_extra(cls, parts: list[SpecResult]) -> dict[str, Any]:
        """The runs' `extra` as one: the host clock's over every run (`merged_host`), a value
        every run shares kept, one that differs as the list of each run's (in order)."""
        out: dict[str, Any] = {}
        for key in dict.fromkeys(k for p in parts for k in p.extra):
            values = [p.extra.get(key) for p in parts]
            if key == "host":
                out[key] = cls.merged_host(values)
            else:
                out[key] = values[0] if all(v == values[0] for v in values) else values
        return out

    @staticmethod
    def merged_host(clocks: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """HostClock summaries (DRAFTSMITH_HOST_TIMING=1) of several runs as one: iterations
        added up, each `<lap>_ms` the mean over all of them (every run's time summed, over the
        summed count); None where no run was clocked."""
        clocks = [c for c in clocks if c]
        if not clocks:
            return None
        n = sum(c["iterations"] for c in clocks)
        keys = dict.fromkeys(k for c in clocks for k in c if k.endswith("_ms"))
        return {"iterations": n, **{k: sum(c.get(k, 0.0) * c["iterations"] for c in clocks) / n
                                    for k in keys if n}}

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)

    @property
    def measured_accept_length(self) -> float | None:
        """Tokens a row-cycle made, on average; None when no cycle ran."""
        n = sum(self.accept_hist)
        return sum(k * c for k, c in enumerate(self.accept_hist)) / n if n else None

    @property
    def mean_accept_length(self) -> float:
        """`measured_accept_length`, 0.0 when no cycle ran (for callers that do arithmetic)."""
        return self.measured_accept_length or 0.0

    @property
    def accept_rate(self) -> float:
        """Accept length over its maximum, steps + 1 (as SGLang and the seed report it)."""
        return self.mean_accept_length / (self.steps + 1)

    @property
    def measured_position_rates(self) -> list[float | None]:
        """P(draft position i accepted | position i reached); None where no cycle reached it
        (a tree's depth never drafted, a run of no cycle): not measured, not rejected."""
        return [a / r if r else None for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def position_rates(self) -> list[float]:
        """`measured_position_rates` with 0.0 for a position never reached (for callers that
        format floats: reports should show the measured view)."""
        return [r or 0.0 for r in self.measured_position_rates]

    def accept_stats(self) -> dict[str, Any]:
        """The acceptance figures as reports write them: None where nothing was measured."""
        length = self.measured_accept_length
        return {"mean_accept_length": length,
                "accept_rate": None if length is None else length / (self.steps + 1),
                "accept_hist": self.accept_hist, "reached": self.reached,
                "accepted": self.accepted, "position_rates": self.measured_position_rates}

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "tokens_per_s": self.tokens_per_s, "cycles": self.cycles,
            **self.accept_stats(),
            "phases": self.phases.to_dict() if self.phases else None, **self.extra,
        }


class SpecState:
    """Static buffers of one batch size; graph phases read and write only these."""

    def __init__(self, dec: SpecDecoder, b: int) -> None:
        dev, s, n = dec.device, dec.steps, dec.n_verify
        cfg, ddt = dec.drafter.cfg, dec.drt.dtype
        z = dict(dtype=torch.long, device=dev)
        self.b = b
        self.rows = torch.arange(b, device=dev)
        self.tcaches, self.dcaches = dec.rt.caches_for(b), dec.drt.caches_for(b)
        self.tpool = dec.rt.pool_for(b)
        self.L, self.last, self.base, self.n, self.count = (torch.zeros(b, **z) for _ in range(5))
        self.root_logits = torch.zeros(b, cfg.draft_vocab_size, dtype=ddt, device=dev)
        self.root_hidden = torch.zeros(b, cfg.hidden_size, dtype=ddt, device=dev)
        self.vtok, self.vpos = torch.zeros(b, n, **z), torch.zeros(b, n, **z)
        self.vdraft = torch.zeros(b, s, **z)
        sampling = dec.drawn  # drafts drawn from the drafter's q: keep each q for the accept
        self.qbank = (torch.zeros(b, s, cfg.draft_vocab_size, device=dev)
                      if sampling and dec.shape is None else None)
        self.tree = None
        # a drawn tree's accepted nodes by depth, last cycle (`RankCounts`: siblings drawn from
        # one q may share a token, so the tokens alone do not name the accepted one)
        self.path = (torch.zeros(b, s + 1, **z) if sampling and dec.shape is not None
                     else None)
        self.unfused: set[str] = set()  # fused phases that failed to compile at this batch size
        if dec.shape is not None:
            self.tree = trees.TreeDraft(dec.shape, b, cfg.hidden_size, cfg.draft_vocab_size, ddt,
                                        dev, sampling)
            self.vslots = (dec.tbase + torch.arange(n, device=dev)).expand(b, n).contiguous()
            self.vmask = torch.zeros(b, 1, n, dec.rt.max_seq, dtype=torch.bool, device=dev)
        self.ext_tok = torch.zeros(b, s + 1, **z)
        naux, th = len(dec.aux_ids), cfg.target_hidden_size
        self.ext_aux = torch.zeros(b, s + 1, naux, th, dtype=dec.rt.dtype, device=dev)
        self.out = torch.zeros(b, dec.out_width, **z)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.all_done = torch.zeros((), dtype=torch.bool, device=dev)
        self.max_new = torch.zeros((), **z)
        self.eos = torch.full((MAX_EOS,), -1, **z)
        self.hist = torch.zeros(s + 2, **z)
        self.reached, self.accepted = torch.zeros(s, **z), torch.zeros(s, **z)
        self.vout: Any = None
        # each row's setting (of dec.params' kind or one before it; drawn drafts: dec.params alone)
        self.sampling = RowSampling(b, dev, dec.params)
