"""The drafter's runtime: a static KV cache addressed by slot, like `Runtime` for the target.

The speculative engine captures whole phases (all draft steps, the re-extend) as CUDA graphs that
call `drafter(...)` on `caches_for(b)`; `forward` and `capture` here graph single forwards for
other users (doctor, tune), in the same shared pool when a `Graphs` object is passed.
"""

from __future__ import annotations

import torch

from draftsmith.engine.graphs import Graphs, fill, fill_padded, pad_to, run_keyed, static_inputs
from draftsmith.engine.runtime import check_sizes, engine_compile
from draftsmith.errors import DraftsmithError
from draftsmith.models import triton_draft_layer
from draftsmith.models.eagle3 import Eagle3Drafter
from draftsmith.models.llama import KVCache


class DrafterRuntime:
    def __init__(
        self,
        drafter: Eagle3Drafter,
        max_batch: int,
        max_seq: int,
        graphs: Graphs | bool | None = None,
        compile: bool = False,
    ) -> None:
        max_batch, max_seq = check_sizes(max_batch, max_seq, "DrafterRuntime")
        p = drafter.fc.weight
        self.drafter, self.device, self.dtype = drafter, p.device, p.dtype
        self.fn = drafter  # what graphed forwards call: the drafter, or its compiled wrapper
        self.max_batch, self.max_seq = max_batch, max_seq
        att = drafter.layers[0].self_attn
        shape = (max_batch, att.kv_heads, max_seq, att.d)
        self.caches = [
            KVCache(torch.zeros(shape, dtype=p.dtype, device=p.device),
                    torch.zeros(shape, dtype=p.dtype, device=p.device))
            for _ in drafter.layers
        ]
        if isinstance(graphs, Graphs):
            self.graphs: Graphs | None = graphs
        else:
            use = p.device.type == "cuda" if graphs is None else graphs
            self.graphs = Graphs(p.device) if use else None
        self.gkey = None if self.graphs is None else self.graphs.owner(self)
        self._static: dict[tuple, dict[str, torch.Tensor]] = {}
        if triton_draft_layer.MODE != "off" and len(drafter.layers) == 1:
            triton_draft_layer.prepare(drafter)  # the folded weights its compiled calls read
        self._batches: dict[tuple, list[int]] = {}
        if compile:
            self.compile()

    @property
    def compiled(self) -> bool:
        return self.fn is not self.drafter

    def compile(self) -> None:
        """torch.compile the drafter for graphed shapes, once per runtime (eager calls of other
        shapes keep the plain module, so they never recompile it)."""
        if not self.compiled:
            self.fn = engine_compile(self.drafter, fullgraph=True)

    @torch.no_grad()
    def prompt(self, tokens: torch.Tensor, aux: torch.Tensor, lens: torch.Tensor,
               q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's pass over right-padded prompt rows (tokens [b, n], the target's aux
        states [b, n, k, H]) into cache slots 0..q-1, padded to the target's bucket q. Returns the
        logits and hidden at lens - 1 ([b, 1, ...]: the first draft step's inputs). With graphs it
        replays one graph per (b, q), as the target's prompt does. Eager, the drafter launched
        each kernel from the host: a batch-1 speculative prefill took 3.3-4.8 ms on the H200,
        against the baseline's 1.8 (run 13).
        Slots past a row's length get pad K/V that drafting overwrites before reading."""
        b = tokens.shape[0]
        if q > self.max_seq:
            raise DraftsmithError(f"a {q}-token prompt pass exceeds the drafter's {self.max_seq}")
        key = (self.gkey, "drafter-prompt", b, q)
        static = self._static.get(key)
        if static is None:
            static = self._static[key] = {
                "tokens": torch.zeros(b, q, dtype=torch.long, device=self.device),
                "aux": torch.zeros(b, q, *aux.shape[2:], dtype=aux.dtype, device=self.device),
                "at": torch.zeros(b, dtype=torch.long, device=self.device)}
        fill_padded(static["tokens"], tokens)
        fill_padded(static["aux"], aux)
        static["at"].copy_(lens - 1)
        return run_keyed(self.graphs, key, lambda: self._prompt_fn(key))

    def _prompt_fn(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, b, q = key
        static = self._static[key]
        pos = torch.arange(q, device=self.device).repeat(b, 1)
        hidden = self.drafter.fuse(static["aux"])
        return self.drafter(static["tokens"], hidden, pos, self.caches_for(b), at=static["at"])

    def caches_for(self, b: int) -> list[KVCache]:
        if b > self.max_batch:
            raise DraftsmithError(f"batch {b} exceeds the drafter's max_batch {self.max_batch}")
        return [KVCache(c.k[:b], c.v[:b]) for c in self.caches]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, hidden to feed back); replays a captured graph when one fits."""
        b, q = tokens.shape
        caches = self.caches_for(b)
        flags = (q, slots is not None, mask is not None)
        bp = pad_to(b, self._batches.get(flags, []))
        if bp is None:
            return self.drafter(tokens, hidden, positions, caches, slots, mask)
        static = self._static[(bp, *flags)]
        fill(static, b, tokens=tokens, hidden=hidden, positions=positions, slots=slots,
             mask=mask)
        logits, h = self.graphs.replay((self.gkey, "drafter", bp, *flags))
        return logits[:b], h[:b]

    def capture(
        self, batch_sizes: list[int], q_sizes: list[int], with_slots: bool = False,
        with_mask: bool = False,
    ) -> None:
        if self.graphs is None:
            return
        for q in sorted(q_sizes, reverse=True):
            flags = (q, with_slots, with_mask)
            for b in sorted(batch_sizes, reverse=True):
                self._capture_one(b, flags)
                self._batches.setdefault(flags, []).append(b)

    def _capture_one(self, b: int, flags: tuple) -> None:
        q, with_slots, with_mask = flags
        static = static_inputs(b, q, self.max_seq, self.device, with_slots, with_mask)
        static["hidden"] = torch.zeros(b, q, self.drafter.cfg.hidden_size, dtype=self.dtype,
                                       device=self.device)
        caches = self.caches_for(b)

        def fn() -> tuple[torch.Tensor, torch.Tensor]:
            return self.fn(
                static["tokens"], static["hidden"], static["positions"], caches,
                static.get("slots"), static.get("mask"),
            )

        with torch.no_grad():
            self.graphs.capture((self.gkey, "drafter", b, *flags), fn)
        self._static[(b, *flags)] = static
