"""Acceptance and speed of several drafters on the same prompts, in the same run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from typing import Any

import torch

from draftsmith.compare.paired import DEFINITION as PAIRED
from draftsmith.compare.paired import paired
from draftsmith.data.progress import stderr_line
from draftsmith.errors import DraftsmithError

BASELINE = "the target alone"


def _finish(runs: list[Any]) -> dict[str, Any]:
    from draftsmith.engine.spec_state import SpecResult

    m = SpecResult.merged(runs)
    secs = m.prefill_s + m.decode_s
    # None where nothing was measured: a position never reached, a run of no cycle
    return {**m.accept_stats(), "cycles": m.cycles, "new_tokens": m.new_tokens,
            "seconds": secs, "tokens_per_s": m.new_tokens / secs if secs else 0.0,
            "per_prompt_accept_length": [r.measured_accept_length for r in runs],
            "per_prompt_cycles": [r.cycles for r in runs],
            "per_prompt_tokens_per_s": [_rate(r) for r in runs]}


def _rate(r: Any) -> float | None:
    secs = r.prefill_s + r.decode_s
    return r.new_tokens / secs if secs else None


def paired_gaps(out: dict[str, dict[str, Any]], key: str = "per_prompt_accept_length"
                ) -> list[dict[str, Any]]:
    """Every drafter after the first against the first, prompt by prompt (`paired`), in the
    per-prompt figure `key`."""
    (ref, first), *rest = out.items()
    return [paired(k, v[key], ref, first[key]) for k, v in rest]


@torch.no_grad()
def measure(model: Any, drafters: dict[str, Any], prompts: list[list[int]], steps: int,
            max_new: int, eos: list[int], topk: int = 1, num_draft: int | None = None,
            say: Callable[[str], None] = stderr_line) -> dict[str, Any]:
    """Each prompt runs through the target alone and every drafter in turn (after a warm-up),
    so all see the same prompts under the same conditions; a chain of `steps`, or (topk > 1)
    a tree of `num_draft` tokens."""
    from draftsmith.bench import load
    from draftsmith.data.progress import Progress
    from draftsmith.engine.generate import run_generation
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder

    max_seq = max(len(p) for p in prompts) + max_new + 4 * steps + (num_draft or 0) + 8
    decs = {}
    for k, d in drafters.items():
        try:
            # profile=False: DRAFTSMITH_PROFILE=1 would sync every timed cycle
            decs[k] = SpecDecoder(model, d, steps=steps, topk=topk, num_draft_tokens=num_draft,
                                  max_seq=max_seq, profile=False)
        except DraftsmithError as e:  # which of the drafters does not fit the target
            raise DraftsmithError(f"drafter {k} with this --target: {e}") from None
    base_rt = Runtime(model, 1, max_seq, kept=max(len(p) for p in prompts) + max_new)
    warm = min(8, max_new)
    say(f"compare: warming up the target and {len(decs)} drafters")
    run_generation(base_rt, prompts[:1], warm, eos_ids=eos)
    for dec in decs.values():
        dec.generate(prompts[:1], warm, eos)
    runs: dict[str, list[Any]] = {k: [] for k in decs}
    base: list[Any] = []  # the target alone, prompt by prompt
    # the order rotates a step each prompt, so no run always goes first (a clock ramping up,
    # caches the run before it warmed)
    order: list[str | None] = [None, *decs]
    bar = Progress(len(prompts) * len(order), 0, "run", "compare", True, say)
    done, stopped = 0, False  # prompts every run finished; a ctrl-C came
    with load.watching() as machine, closing(bar):  # other work on the cores skews tok/s
        try:
            for i, p in enumerate(prompts):
                for k in order[i % len(order):] + order[:i % len(order)]:
                    bar.announce(f"prompt {i + 1}/{len(prompts)}: {k or BASELINE}")
                    with load.timed():
                        r = run_generation(base_rt, [p], max_new, eos_ids=eos) if k is None \
                            else decs[k].generate([p], max_new, eos)
                    bar.update(1)
                    (base if k is None else runs[k]).append(r)
                done = i + 1
        except KeyboardInterrupt:  # minutes measured outlive a ctrl-C: the prompts finished
            stopped = True
    res = {**_figures(runs, base, done), **_setting(base_rt, steps, topk, num_draft, max_new),
           "machine_load": machine.result()}
    if stopped:
        res["partial"] = {"prompts_finished": done, "prompts": len(prompts)}
        raise Interrupted(done, len(prompts), res if done else None)
    return res


class Interrupted(KeyboardInterrupt):
    """A ctrl-C while measuring: `result` holds the prompts every run finished (None where
    none did), marked `partial` with `finished` of `total` prompts."""

    def __init__(self, finished: int, total: int, result: dict[str, Any] | None) -> None:
        super().__init__("compare interrupted")
        self.finished, self.total, self.result = finished, total, result


def _figures(runs: dict[str, list[Any]], base: list[Any], done: int) -> dict[str, Any]:
    """Each drafter's figures and the target alone's rate over the first `done` prompts."""
    tokens = sum(r.new_tokens for r in base[:done])
    secs = sum(r.prefill_s + r.decode_s for r in base[:done])
    rate = tokens / secs if secs else 0.0
    out = {k: _finish(v[:done]) for k, v in runs.items()}
    for v in out.values():
        v["speedup"] = v["tokens_per_s"] / rate if rate else None
    return {"baseline_tokens_per_s": rate, "drafters": out, "paired": paired_gaps(out),
            "paired_tokens_per_s": paired_gaps(out, "per_prompt_tokens_per_s"),
            "prompts": done}


def _setting(rt: Any, steps: int, topk: int, num_draft: int | None, max_new: int
             ) -> dict[str, Any]:
    return {"decoding": "greedy", "steps": steps, "topk": topk,
            "num_draft_tokens": num_draft or steps + 1, "max_new_tokens": max_new,
            "device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."),
            "definitions": DEFINITIONS}


# what the per-drafter figures mean, in compare.json itself (`accept_rate` is easily read as
# the share of draft tokens accepted, vLLM's "draft acceptance rate", which it is not)
DEFINITIONS = {
    "mean_accept_length": "tokens a cycle makes on average, the target's own token included "
                          "(1 to steps + 1), over every cycle of every prompt: each prompt "
                          "weighted by its cycles, not the plain mean of "
                          "per_prompt_accept_length",
    "cycles": "the cycles run over every prompt (per_prompt_cycles: each prompt's)",
    "accept_hist": "[k]: the cycles that made k tokens; it sums to cycles",
    "accept_rate": "mean_accept_length / (steps + 1): the share of the most tokens a cycle can "
                   "make, as the profiler's accept rate; not accepted draft tokens / drafted ones",
    "position_rates": "P(draft position i accepted | position i reached); null where no cycle "
                      "reached it",
    "tokens_per_s": "new tokens over prefill and decode time, one prompt at a time, the "
                    "target alone and the drafters in an order rotated each prompt",
    "per_prompt_accept_length": "mean_accept_length of each prompt alone, in the suite's "
                                "order (null: no cycle ran)",
    "per_prompt_tokens_per_s": "tokens_per_s of each prompt alone, in the suite's order",
    "per_prompt_cycles": "the cycles each prompt ran, in the suite's order",
    "paired": PAIRED,
    "paired_tokens_per_s": "as paired, over per_prompt_tokens_per_s: each drafter's tokens/s "
                           "minus the first's on the same prompt",
    "decoding": "greedy: every drafter verified against the target's argmax",
    "partial": "only after a ctrl-C: prompts_finished of the prompts planned, those every run "
               "(the target alone and each drafter) finished; every figure is over them",
}
