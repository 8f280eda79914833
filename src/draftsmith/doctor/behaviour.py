"""A short speculative run: per-position acceptance against what the training log promised."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.doctor.report import Finding
from draftsmith.measured import figure

PROMPTS = [
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer briefly.",
    "List three uses of speculative decoding.",
]
ERROR_RATIO, WARN_RATIO = 0.5, 0.8  # measured / promised at draft position 0
# a gap is only called when so few accepts out of the drafts measured would be this unlikely
# at the promised rate (binomial lower tail): a short run of a few prompts can miss a low
# promise by chance (0 of 16 at a promised 6.2% happens 36% of the time)
ERROR_P, WARN_P = 0.001, 0.05
PROMPT_SCAN = 16  # samples read at most for each prompt the run wants from the data


def below_chance(accepted: int, reached: int, rate: float) -> float:
    """P(at most `accepted` of `reached` drafts accepted) when each is accepted at `rate`."""
    if reached <= 0 or rate <= 0.0:
        return 1.0
    if rate >= 1.0:
        return 0.0 if accepted < reached else 1.0
    lp, lq = math.log(rate), math.log1p(-rate)
    return min(1.0, sum(math.exp(math.lgamma(reached + 1) - math.lgamma(i + 1)
                                 - math.lgamma(reached - i + 1) + i * lp + (reached - i) * lq)
                        for i in range(min(accepted, reached) + 1)))


def promised(folder: Path, last: int = 5) -> dict[str, Any] | None:
    """Mean of the last `last` training-log rows: per-position conditional accuracy, accept length.

    `cond_acc[k]` is the share of step-k drafts matching the target's argmax given steps < k did,
    which is what a greedy chain's per-position acceptance measures. A position is averaged over
    the rows that measured it; None where none of them did (no chain reached it)."""
    from draftsmith.train.report import LOG, read_log

    folder, upto = _log_folder(folder)
    rows = [r for r in read_log(folder) if r.get("cond_acc") and (upto is None or
                                                                   r["step"] <= upto)]
    if not rows:
        return None
    rows = rows[-last:]
    for r in rows:  # a hand edit was a TypeError traceback, the whole report lost
        _check_row(r, folder)
    k = min(len(r["cond_acc"]) for r in rows)
    cond = [_mean([r["cond_acc"][i] for r in rows]) for i in range(k)]
    accept = [r["accept_length"] for r in rows if r.get("accept_length") is not None]
    return {"cond_acc": cond, "accept_length": sum(accept) / len(accept) if accept else None,
            "steps": [r.get("step") for r in rows], "source": str(folder / LOG)}


def _log_folder(folder: Path) -> tuple[Path, int | None]:
    """(where the training log of `folder` is, the last step it promises for): a training
    checkpoint's (`OUT/checkpoints/step-N`) is its run's, up to step N (rows after it were
    trained after those weights); any other folder's its own, whole."""
    from draftsmith.train.checkpoint import CHECKPOINTS
    from draftsmith.train.report import LOG

    folder = Path(folder)
    own = (folder / LOG).is_file() or folder.parent.name != CHECKPOINTS
    if own or not re.fullmatch(r"step-\d+", folder.name):
        return folder, None
    return folder.parent.parent, int(folder.name.split("-")[1])


def _check_row(row: dict[str, Any], folder: Path) -> None:
    """A row's rates as training writes them, else one line naming the row."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.report import LOG

    if (bad := _row_fault(row)) is not None:
        key, want = bad
        raise DraftsmithError(f"{folder / LOG}: the row of step {row['step']} holds {key} "
                              f"{row[key]!r}, not {want} as training writes it")


def _row_fault(row: dict[str, Any]) -> tuple[str, str] | None:
    """(the key, what it should hold) of the first value no training writes, None if none:
    cond_acc a list of rates in 0..1 (null where no chain reached a position), accept_length
    a finite number >= 1 or absent."""
    cond, length = row["cond_acc"], row.get("accept_length")
    if not (isinstance(cond, list) and all(r is None or _number(r, 0.0, 1.0) for r in cond)):
        return "cond_acc", "a list of rates in 0..1 (null where unmeasured)"
    if length is not None and not _number(length, 1.0, math.inf):
        return "accept_length", "a number >= 1"
    return None


def _number(v: Any, low: float, high: float) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and low <= v <= high


def _mean(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def promise_words(promise: dict[str, Any], steps: int) -> str:
    """Where the promised figures come from, so they can be traced in train_log.jsonl."""
    from draftsmith.train.objective import cut_short, measured

    rows = promise.get("steps") or []
    if not rows:
        return "the training log's cond_acc (per position)"
    span = f"step {rows[0]}" if len(rows) == 1 else f"steps {rows[0]}..{rows[-1]}"
    source = promise.get("source") or "train_log.jsonl"
    cond = promise.get("cond_acc") or []
    n, upto = len(cond), min(steps, len(cond))
    m, short = measured(cond[:upto]), cut_short(cond[:upto])
    words = (f"the mean of cond_acc per position over the last {len(rows)} rows of {source} "
             f"({span}); its accept length from those means at positions 0..{upto - 1}, not "
             f"the log's accept_length (all {n} positions)")
    if short:  # the promise stops where the log's measurement does
        words += (f"; no chain in those rows reached position {m}, so the promised accept "
                  f"length counts positions 0..{m - 1} only" if m else
                  "; those rows measured no position, so nothing is promised")
    return words


def promised_length(promise: dict[str, Any], steps: int) -> float | None:
    """The accept length the log promises a chain of `steps` drafts: its own `accept_length`
    counts every training-time-test step (7 by default), more drafts than the run makes. It
    stops at the first position the log never measured (None); None where it measured none."""
    from draftsmith.train.objective import accept_length, measured

    cond = promise.get("cond_acc") or []
    if not cond:
        return promise.get("accept_length")
    if not measured(cond[:steps]):
        return None
    return accept_length(cond[:steps])


def data_prompts(dataset: Any, n: int, max_len: int) -> tuple[list[list[int]], int]:
    """(prompts, samples read): each sample's tokens before its first assistant token, the
    data's own template (none from a shard that does not read: the shard check names it). At
    most `PROMPT_SCAN` samples a prompt are read, their tokens only: a dataset whose prefixes
    are all longer than `max_len` is not read whole."""
    from safetensors import SafetensorError

    from draftsmith.errors import DraftsmithError

    out: list[list[int]] = []
    scanned = min(len(dataset), PROMPT_SCAN * n)
    for i in range(scanned):
        try:
            ids, mask = dataset.tokens(i)
        except (DraftsmithError, SafetensorError):
            continue
        if not mask.any():
            continue
        first = int(mask.nonzero()[0])
        if 0 < first <= max_len:
            out.append(ids[:first].tolist())
        if len(out) >= n:
            return out, i + 1
    return out, scanned


def template_prompts(target: Any, n: int) -> list[list[int]]:
    return [target.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS[:n]]


@torch.no_grad()
def spec_run(model: Any, drafter: Any, prompts: list[list[int]], steps: int, max_new: int,
             eos: list[int], aux_ids: list[int] | None = None,
             done: Callable[[], None] | None = None) -> dict[str, Any]:
    """Greedy chain decoding one prompt at a time; `aux_ids` overrides what the drafter is fed;
    `done` is called after each prompt (the progress shown)."""
    from draftsmith.engine.speculative import SpecDecoder

    cfg = drafter.cfg
    if aux_ids is not None:
        drafter.cfg = replace(cfg, aux_layer_ids=list(aux_ids))
    try:
        max_seq = max(len(p) for p in prompts) + max_new + 4 * steps + 8
        # profile=False: doctor times no phase, and DRAFTSMITH_PROFILE is bench's to read
        dec = SpecDecoder(model, drafter, steps=steps, max_seq=max_seq, profile=False)
        reached, accepted, lengths, new, secs = [0] * steps, [0] * steps, [], 0, 0.0
        for p in prompts:
            r = dec.generate([p], max_new, eos)
            reached = [a + b for a, b in zip(reached, r.reached, strict=True)]
            accepted = [a + b for a, b in zip(accepted, r.accepted, strict=True)]
            lengths.append((r.mean_accept_length, r.cycles))
            new, secs = new + r.new_tokens, secs + r.prefill_s + r.decode_s
            if done is not None:
                done()
    finally:
        drafter.cfg = cfg
    cycles = sum(c for _, c in lengths)
    return {
        "aux_layer_ids": list(aux_ids if aux_ids is not None else cfg.aux_layer_ids),
        "prompts": len(prompts), "steps": steps, "new_tokens": new,
        # None: a position no cycle reached (not measured, not rejected)
        "position_rates": [a / r if r else None for a, r in zip(accepted, reached, strict=True)],
        "reached": reached, "accepted": accepted,
        # None: no cycle ran, so no accept length was measured (not one of 0)
        "mean_accept_length": sum(m * c for m, c in lengths) / cycles if cycles else None,
        "tokens_per_s": new / secs if secs else 0.0,
    }


def gap_findings(runs: dict[str, dict[str, Any]], promise: dict[str, Any] | None,
                 where: str, wired: bool = False, why_steps: str = "") -> list[Finding]:
    """The first run is the drafter as configured; later ones (other layer sets) explain a gap.
    `wired`: the live match proved the run fed the drafter the layers its data holds, so a gap
    is the drafter's, not the wiring's; `why_steps` says where the run's draft steps came from."""
    label, run = next(iter(runs.items()))
    if promise is None or not run["position_rates"] or not promise["cond_acc"]:
        return []
    got, want = run["position_rates"][0], promise["cond_acc"][0]
    if want is None:
        return [Finding("info", "behaviour", f"{label}: the training log's last rows measured "
                        "no draft position (no chain reached one), so they promise nothing to "
                        "hold the run against", where, "")]
    if want <= 0.05:
        return []
    if got is None:
        return [Finding("warning", "behaviour", f"{label}: no cycle drafted a token, so nothing "
                        "measures acceptance", where,
                        "run more --num-prompts or --max-new-tokens")]
    ratio = got / want
    steps = len(run["position_rates"])
    what = (f"{label}, draft position 0 was accepted {got:.1%} of the time, the training log "
            f"promised {want:.1%} (accept length {figure(run['mean_accept_length'], '.2f')} vs "
            f"{figure(promised_length(promise, steps), '.2f')} at {steps} draft steps)"
            + (f"; {steps} draft steps: {why_steps}" if why_steps else "")
            + f"; promised: {promise_words(promise, steps)}")
    n, k = (run.get("reached") or [0])[0], (run.get("accepted") or [0])[0]
    chance = below_chance(k, n, want) if "reached" in run else 0.0
    if ratio < ERROR_RATIO and chance >= ERROR_P:
        return [Finding("warning", "behaviour", what + f": {k} of {n} drafts, too few to tell "
                        "wiring from chance", where,
                        "run more --num-prompts or --max-new-tokens")]
    if ratio < WARN_RATIO and chance >= WARN_P:
        return []  # within what so few drafts vary by
    if ratio < ERROR_RATIO and wired:
        return [_not_wiring(what, where)]
    if ratio < ERROR_RATIO:
        return [Finding("error", "behaviour", what + ": a gap this large is usually wiring "
                        "(wrong hidden states) or a different chat template" + _explained(
                            runs, want), where, "fix the wiring findings above; check the data "
                        "and the serving template hash")]
    if ratio < WARN_RATIO:
        return [Finding("warning", "behaviour", what, where, "compare prompts like the training "
                        "data; a modest gap is normal on new prompts")]
    return []


def _not_wiring(what: str, where: str) -> Finding:
    return Finding("warning", "behaviour", what + ": the live match passed (the run fed the "
                   "drafter the layers its data holds), so this is not wiring; likely causes: a "
                   "drafter overfit on little data, the log's rates measured on the training "
                   "rows' own answers while this run drafts the target's greedy ones (here or on "
                   "other prompts), or training answers sampled at a temperature > 0", where,
                   "train on more data (`draftsmith data make` with a larger --n, and "
                   "--temperature 0 where the engine decodes greedily); nothing to rewire")


def _explained(runs: dict[str, dict[str, Any]], want: float) -> str:
    for label, r in list(runs.items())[1:]:
        if r["position_rates"] and (r["position_rates"][0] or 0.0) >= WARN_RATIO * want:
            return (f"; {label} {r['aux_layer_ids']} it reaches {r['position_rates'][0]:.1%}:"
                    " the wiring is the cause")
    return ""
