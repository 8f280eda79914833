"""`draftsmith bench` as a function: the baseline engine and speculative settings side by side.

Every setting decodes the same full batches of the same prompts (the last topped up with repeats
of the first: timed and counted in tok/s, `padding_rows`, but not in agreement); an untimed
warm-up of every distinct batch captures the CUDA graphs and shows the eager prefill each prompt
shape once before anything is timed. Tokens/s counts prefill and decode, in unprofiled runs (the
phase profiler, when on, runs each setting again; refilled rows have one wall rate and no
decode-only one). Each run starts from the seed, so a sampled row does not hang on the runs
before it. In greedy mode each real prompt's speculative completion is compared with the
baseline's, and every divergence is located and measured (the gap between the two candidate
logits there, from one full forward). A ctrl-C keeps the rows finished (`BenchInterrupted`).
With `repeats` > 1 each (suite, batch) runs in rotated rounds (`_rounds`) and keeps its rows
to the group's end: an interrupted group is not run, the groups before it kept.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.bench import load
from draftsmith.bench.suites import (
    fill_batches,
    prompt_ids,
    repeated_suites,
    suite_labels,
    suite_prompts,
)
from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import check_max_new, check_positions, run_generation, sync
from draftsmith.engine.params import whole
from draftsmith.engine.profiler import PhaseSummary, env_on
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_state import SpecResult
from draftsmith.engine.speculative import SpecDecoder, check_draft_vocab, check_pair, reads_drafts
from draftsmith.engine.tree import TreeShape, most_tokens
from draftsmith.errors import DraftsmithError
from draftsmith.options import check_chain_tokens, check_compile, count
from draftsmith.tune.cost_model import DEEPEST

Setting = tuple[int, int, int]  # steps, topk, num_draft_tokens (root included)
# how `_run_grid` times: said in meta and a note, as runs in a fixed order, each once, give
# no spread, and drift (clocks, heat) falls on the later settings
TIMING = ("each suite and batch: the baseline first, then each setting in grid order, each run "
          "timed once after its own untimed warm-up (not interleaved, not repeated)")
# one timed run's row (no phases), its tokens and, speculative, its result
Round = tuple[dict[str, Any], list[list[int]], SpecResult | None]
# a timed row's figures per batch (`batch_figures`), for `by_category`: taken off before the
# row is kept, never written
EACH = "_each"


def timing(repeats: int) -> str:
    """`meta.timing`: `TIMING` for one round; for more, the rounds and their rotation."""
    if repeats == 1:
        return TIMING
    return (f"each suite and batch: the baseline and each setting warmed up once, untimed, then "
            f"{repeats} timed rounds of them all, round 1 in the grid's order (baseline first), "
            f"each round after it that order rotated one run further (round r starts at run r, "
            f"counting from 1, wrapping round); each figure the median over the rounds (min-max "
            f"its range), each speedup the median of the rounds' own ratios")


@dataclass
class BenchConfig:
    target: str = "default"
    drafter: str = ""  # a draftsmith drafter folder, or "random" (a machinery check)
    suites: list[str] = field(default_factory=lambda: ["chat"])
    num_prompts: int = 16
    steps: list[int] = field(default_factory=lambda: [1, 3, 5])
    topk: list[int] = field(default_factory=lambda: [1])
    num_draft_tokens: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    max_new_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    profile: bool | None = None
    seed: int = 0
    compile: bool = False  # torch.compile the target's layers: baseline and verify alike
    # rows refilled: a finished row takes the next prompt (engine/refill.py, spec_refill.py),
    # baseline and speculative alike; tokens/s is then wall time, prefills included
    refill: bool = False
    # refill ended rows at most every this many cycles (decode steps); 0: by rows, as
    # spec_refill.refill_every_for (4 below 32 rows, 8 from 32)
    refill_every: int = 0
    # timed rounds of each (suite, batch), rotated: a spread, drift spread over the runs
    repeats: int = 1

    def __post_init__(self) -> None:
        self._check_counts()  # a Python caller's, as the CLI's int_list refuses them
        self.settings()  # a grid that runs nothing is refused before any loading
        check_compile(self.compile, self.device)

    def _check_counts(self) -> None:
        """Every grid value a whole number >= 1 and max_new >= 1: steps 0 was refused by the
        decoder after the baseline had run, batch 0 was a ZeroDivisionError after loading."""
        for flag, values in (("--steps", self.steps), ("--topk", self.topk),
                             ("--num-draft-tokens", self.num_draft_tokens),
                             ("--batch-size", self.batch_sizes)):
            if not values and flag != "--num-draft-tokens":
                raise DraftsmithError(f"{flag}: give at least one value")
            if bad := [v for v in values if not whole(v) or v < 1]:
                raise DraftsmithError(f"{flag} must be whole numbers >= 1, got {bad[0]!r}")
        if not self.suites:
            raise DraftsmithError("--suite: give at least one (humaneval, chat or a prompt file)")
        check_max_new(self.max_new_tokens)
        count(self.repeats, "--repeats")
        if not isinstance(self.num_prompts, int) or self.num_prompts < 0:
            raise DraftsmithError(f"--num-prompts must be >= 0 (0 = all), got "
                                  f"{self.num_prompts!r}")
        if not whole(self.refill_every) or self.refill_every < 0:
            raise DraftsmithError(f"--refill-every must be a whole number >= 0 (0: by batch "
                                  f"size), got {self.refill_every!r}")
        if self.refill_every and not self.refill:  # it was ignored, the rows run static
            raise DraftsmithError("--refill-every applies to refilled rows: give --refill "
                                  "with it")

    def settings(self) -> list[Setting]:
        """Every (steps, topk, tokens) of the grid that can run: a chain per steps, a tree
        per token count that fits it (`unfit` names the others)."""
        if (deepest := max(self.steps, default=0)) > DEEPEST:  # as tune's --max-steps and serve
            raise DraftsmithError(f"--steps must be at most {DEEPEST}, got {deepest}")
        if all(k == 1 for k in self.topk):  # as serve and SGLang: a chain's is steps + 1
            check_chain_tokens(self.steps, self.num_draft_tokens)
        if any(k > 1 for k in self.topk) and not self.num_draft_tokens:
            k = next(k for k in self.topk if k > 1)
            raise DraftsmithError(f"--topk {k} drafts a tree: give --num-draft-tokens")
        out = [(s, k, s + 1 if k == 1 else n) for s, k, n in self._grid()
               if k == 1 or 2 <= n <= most_tokens(k, s)]
        if not out:
            raise DraftsmithError("no setting of this grid can run: " + "; ".join(self.unfit()))
        return list(dict.fromkeys(out))

    def unfit(self) -> list[str]:
        """The grid's trees that cannot run, each with the token counts its shape takes."""
        return [f"tree {s}/{k}/{n}: --steps {s}, --topk {k} verify 2 to {most_tokens(k, s)} "
                f"tokens, not {n}" for s, k, n in self._grid()
                if k > 1 and not 2 <= n <= most_tokens(k, s)]

    def _grid(self) -> list[Setting]:
        """Each (steps, topk, tokens) once: a value given twice names one setting."""
        return list(dict.fromkeys((s, k, n) for s in self.steps for k in self.topk
                                  for n in (self.num_draft_tokens if k > 1 else [s + 1])))


def setting_name(s: Setting) -> str:
    return f"chain {s[0]}" if s[1] == 1 else f"tree {s[0]}/{s[1]}/{s[2]}"


class BenchInterrupted(KeyboardInterrupt):
    """A ctrl-C after some settings were timed: `report` holds those (its meta `partial`, and
    `not_run` naming the others); the CLI writes it and exits 130, as train does."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("bench interrupted")
        self.report = report


class BenchFailed(Exception):
    """An error after some settings were timed (a tree out of GPU memory at the largest batch):
    `report` holds those, its meta `failed` naming the run and the error; the CLI writes it,
    then raises `error` as it came."""

    def __init__(self, report: dict[str, Any], error: Exception) -> None:
        super().__init__(str(error))
        self.report, self.error = report, error


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The report: `meta` and a row per (suite, batch, setting), baseline first. A ctrl-C once
    a row is timed raises `BenchInterrupted` with the rows finished (before that, a plain
    KeyboardInterrupt), an error `BenchFailed`."""
    from draftsmith.bench.drafters import get_drafter
    from draftsmith.targets import load_target

    early = [f"skipped {why}" for why in cfg.unfit()] + repeated_suites(cfg.suites)
    read = {s: suite_prompts(s, cfg.num_prompts, early.append)  # skipped records: once
            for s in suite_labels(cfg.suites)}
    messages = {s: [m for m, _ in p] for s, p in read.items()}
    categories = {label: [c for _, c in read[s]] for s, label in suite_labels(cfg.suites).items()}
    early += short_suites(messages, cfg.num_prompts) + uncategorised(read, cfg)
    for w in early:  # said before the minutes of loading
        log(f"warning: {w}")
    profiling(cfg)  # a DRAFTSMITH_PROFILE it refuses: now, not after the first rows' minutes
    torch.manual_seed(cfg.seed)
    early_pair(cfg.target, cfg.drafter)
    target = load_target(cfg.target)
    suites = {label: prompt_ids(target, messages[s], f"--suite {s}")
              for s, label in suite_labels(cfg.suites).items()}
    check_positions([p for ps in suites.values() for p in ps], cfg.max_new_tokens,
                    target.cfg.max_position_embeddings, "--max-new-tokens",
                    target.cfg.sliding_window)  # before the weights
    model = target.build(cfg.dtype, cfg.device)
    drafter, warnings = get_drafter(cfg.drafter, target, model)
    check_pair(model.cfg, drafter.cfg)  # before the baseline's minutes, not after
    settings = cfg.settings()
    check_topk(settings, drafter.cfg.draft_vocab_size)
    check_draft_vocab(drafter, model.cfg.vocab_size,  # as SpecDecoder would, after the baseline
                      not cfg.params.greedy and any(reads_drafts(k) for _, k, _ in settings))
    for w in warnings:
        log(f"warning: {w}")
    warnings += early
    rows: list[dict[str, Any]] = []
    now: list[str] = []  # the run under way, where rounds keep a group's rows to its end
    with load.watching() as machine:  # other work on the cores skews the rows unevenly
        try:
            _run_grid(model, drafter, suites, cfg, settings, target.eos_ids, rows, log, now,
                      categories)
        except KeyboardInterrupt:
            if not rows:
                raise
            raise BenchInterrupted(_report(cfg, target, drafter, warnings, suites, settings,
                                           rows, machine.result())) from None
        except Exception as e:  # the hour of rows timed before it outlives it
            if not rows:
                raise
            report = _report(cfg, target, drafter, warnings, suites, settings, rows,
                             machine.result())
            report["meta"]["failed"] = {"run": now[-1] if now else _running(cfg, suites,
                                                                             settings, rows),
                                        "error": one_line(e)}
            raise BenchFailed(report, e) from e
    return _report(cfg, target, drafter, warnings, suites, settings, rows, machine.result())


def early_pair(target: str, drafter: str) -> None:
    """A drafter folder sized for another target refused from the target's config.json alone:
    `load_target` reads every weight (minutes for an 8B) before `check_pair` could run. A GGUF,
    the default or a folder whose config does not read are left to that later check."""
    folder = Path(target)
    if drafter in ("", "random") or not (folder / "config.json").is_file():
        return
    from draftsmith.export.sglang import is_sglang
    from draftsmith.export.speculators import is_speculators
    from draftsmith.models.config import ModelConfig
    from draftsmith.models.eagle3 import read_drafter_config
    from draftsmith.targets import hf

    try:
        raw = hf.read_config(folder)
        if is_sglang(raw) or is_speculators(raw):  # a drafter as --target: load_target says so
            return
        tc = ModelConfig.from_hf(raw)
    except Exception:  # noqa: BLE001 (load_target names what is wrong with it, as it did)
        return
    check_pair(tc, read_drafter_config(drafter))


def short_suites(messages: dict[str, list[Any]], limit: int) -> list[str]:
    """A line for each suite of fewer prompts than --num-prompts asks: its rows say how many
    ran, the table does not, so 64 asked of the chat suite's 22 read as 64 measured."""
    return [f"--suite {s} has {len(m)} prompts with a user turn, fewer than --num-prompts "
            f"{limit}: all {len(m)} run" for s, m in messages.items() if len(m) < limit]


def uncategorised(read: dict[str, list[tuple[Any, str | None]]], cfg: BenchConfig) -> list[str]:
    """A line for each suite whose prompts carry categories where no run is timed per prompt:
    a batch of several rows mixes them, refilled rows share their cycles."""
    if 1 in cfg.batch_sizes and not cfg.refill:
        return []
    return [f"--suite {s}: its prompts carry categories; per-category figures are timed at "
            f"--batch-size 1 without --refill only (a batch mixes categories)"
            for s, p in read.items() if any(c is not None for _, c in p)]


def grouped(categories: dict[str, list[str | None]] | None, suite: str, b: int,
            cfg: BenchConfig) -> list[str | None] | None:
    """Each prompt's category where this (suite, batch) is timed a prompt a run: batch 1,
    unrefilled, some prompt categorised; else None."""
    cats = (categories or {}).get(suite)
    if b != 1 or cfg.refill or not cats or all(c is None for c in cats):
        return None
    return cats


def _add_by_category(row: dict[str, Any], cats: list[str | None] | None,
                     base: list[Any], spec: list[Any], greedy: bool) -> None:
    """`row["by_category"]` where `cats` and every round's per-prompt figures are there."""
    rounds = [*base, *spec]
    if cats and rounds and all(r is not None and len(r) == len(cats) for r in rounds):
        row["by_category"] = by_category(cats, base, spec, greedy)


def by_category(cats: list[str | None], base: list[list[dict[str, Any]]],
                spec: list[list[dict[str, Any]]], greedy: bool) -> list[dict[str, Any]]:
    """Per category (first seen first; None: prompts of none), over its prompts' runs: decode
    rates as decoded tokens over decode seconds, summed over every round (`base`, `spec`: a
    round's `batch_figures`, one a prompt), their ratio, and acceptance pooled over its
    row-cycles as the row's is (greedy: round 1's; sampled: every round's)."""
    out = []
    for cat in dict.fromkeys(cats):
        mine = [i for i, c in enumerate(cats) if c == cat]
        hist = [sum(col) for col in zip(*(spec_round[i]["accept_hist"] for spec_round in
                                          (spec[:1] if greedy else spec) for i in mine),
                                        strict=True)]
        cycles = sum(hist)
        b_rate, s_rate = _decode_rate(base, mine), _decode_rate(spec, mine)
        out.append({"category": cat, "prompts": len(mine),
                    "new_tokens": sum(spec[0][i]["new_tokens"] for i in mine),
                    "baseline_decode_tokens_per_s": b_rate, "decode_tokens_per_s": s_rate,
                    "decode_speedup": _over(s_rate, b_rate), "cycles": cycles,
                    "mean_accept_length": (sum(k * n for k, n in enumerate(hist)) / cycles
                                           if cycles else None),
                    "accept_hist": hist})
    return out


def _decode_rate(rounds: list[list[dict[str, Any]]], mine: list[int]) -> float:
    """Decoded tokens over decode seconds of prompts `mine`, every round summed (as `_speed`)."""
    runs = [r[i] for r in rounds for i in mine]
    return sum(x["decoded"] for x in runs) / max(sum(x["decode_s"] for x in runs), 1e-9)


def _run_grid(model, drafter, suites: dict[str, list[list[int]]], cfg: BenchConfig,
              settings: list[Setting], eos: list[int], rows: list[dict[str, Any]],
              log: Callable[[str], None], now: list[str] | None = None,
              categories: dict[str, list[str | None]] | None = None) -> None:
    """Time every (suite, batch): the baseline, then each setting; each row appended to
    `rows` as it is finished (with rounds, a group's rows at its end: `_rounds`); at batch 1
    a suite's `categories` give each setting's `by_category`."""
    rt, drt = _runtimes(model, drafter, suites, cfg, settings)
    run_base, run_spec = (_baseline_refill, _speculative_refill) if cfg.refill else (
        _baseline, _speculative)
    for name, prompts in suites.items():
        for b in sorted(set(cfg.batch_sizes), reverse=True):
            batches = fill_batches(prompts, b)
            sizes = {"prompts": len(prompts), "padding_rows": len(batches) * b - len(prompts)}
            cats = grouped(categories, name, b, cfg)
            if cfg.repeats > 1:
                rows.extend(_rounds((model, rt, drt), (name, b, sizes), prompts, batches, cfg,
                                    settings, eos, log, now if now is not None else [], cats))
                continue
            log(f"{name}: batch {b}, {len(batches)} batches, baseline")
            torch.manual_seed(cfg.seed)  # each run's draws its own: not the runs' before it
            base, base_tokens = run_base(rt, batches, cfg, eos)
            base_each = base.pop(EACH, None)
            rows.append({"suite": name, "batch": b, "setting": "baseline", **sizes, **base})
            for s in settings:
                log(f"{name}: batch {b}, {setting_name(s)}")
                torch.manual_seed(cfg.seed)
                row, tokens = run_spec(rt, drt, s, batches, cfg, eos)
                each = row.pop(EACH, None)
                row["speedup"] = _over(row["tokens_per_s"], base["tokens_per_s"])
                row["decode_speedup"] = _over(row["decode_tokens_per_s"],
                                              base["decode_tokens_per_s"])
                if cfg.params.greedy:  # each real prompt once, not the rows padding repeats
                    n = len(prompts)
                    row["agreement"] = agreement(model, [prompts], base_tokens[:n],
                                                 tokens[:n], eos)
                _add_by_category(row, cats, [base_each], [each], cfg.params.greedy)
                rows.append({"suite": name, "batch": b, "setting": setting_name(s),
                             "steps": s[0], "topk": s[1], "num_draft_tokens": s[2], **sizes,
                             **row})


@dataclass
class Prepared:
    """One run warmed up: `timed()` times it once more (a `Round`), `phases(result)` profiles
    it (None: a baseline, or unprofiled)."""

    timed: Callable[[], Round]
    phases: Callable[[SpecResult], dict[str, Any] | None] = lambda _m: None


def _rounds(engines, group: tuple[str, int, dict[str, int]], prompts: list[list[int]],
            batches, cfg: BenchConfig, settings: list[Setting], eos: list[int],
            log: Callable[[str], None], now: list[str],
            cats: list[str | None] | None = None) -> list[dict[str, Any]]:
    """One (suite, batch) in `cfg.repeats` rounds: every run warmed up once, then timed once a
    round in the grid's order rotated by the round (`rotated`). Each run draws on from its own
    random state (seeded before its warm-up, as one round's), never from the runs between;
    `cats` (batch 1) give `by_category` over every round."""
    model, rt, drt = engines
    name, b, sizes = group
    base_run, spec_run = (_baseline_refill_run, _speculative_refill_run) if cfg.refill else (
        _baseline_run, _speculative_run)
    labels = ["baseline", *map(setting_name, settings)]
    runs: dict[str, Prepared] = {}
    states: dict[str, Any] = {}
    for label, s in zip(labels, [None, *settings], strict=True):
        now[:] = [f"{name} batch {b}: {label} (warm-up)"]
        log(f"{name}: batch {b}, {len(batches)} batches, {label}: warm-up")
        torch.manual_seed(cfg.seed)
        runs[label] = (base_run(rt, batches, cfg, eos) if s is None
                       else spec_run(rt, drt, s, batches, cfg, eos))
        states[label] = _random_state()
    timed = _timed_rounds(runs, states, labels, cfg.repeats, (name, b), log, now)
    head = {"suite": name, "batch": b}
    base = timed["baseline"]
    out = [{**head, "setting": "baseline", **sizes, **summary([t[0] for t in base])}]
    for s, label in zip(settings, labels[1:], strict=True):
        now[:] = [f"{name} batch {b}: {label} (profiling)"]
        _set_random_state(states[label])
        row = _setting_row(runs[label], timed[label], base, cfg)
        if cfg.params.greedy:  # each real prompt once, from the first round (greedy: any)
            n = len(prompts)
            row["agreement"] = agreement(model, [prompts], base[0][1][:n], timed[label][0][1][:n],
                                         eos)
        _add_by_category(row, cats, [t[0].get(EACH) for t in base],
                         [t[0].get(EACH) for t in timed[label]], cfg.params.greedy)
        out.append({**head, "setting": label, "steps": s[0], "topk": s[1],
                    "num_draft_tokens": s[2], **sizes, **row})
    now.clear()
    return out


def _timed_rounds(runs: dict[str, Prepared], states: dict[str, Any], labels: list[str],
                  repeats: int, group: tuple[str, int], log: Callable[[str], None],
                  now: list[str]) -> dict[str, list[Round]]:
    """Each run's rounds, timed in `rotated` order, each from its own random state."""
    name, b = group
    timed: dict[str, list[Round]] = {label: [] for label in labels}
    for r in range(repeats):
        for label in rotated(labels, r):
            now[:] = [f"{name} batch {b}: {label} (round {r + 1} of {repeats})"]
            log(f"{name}: batch {b}, round {r + 1}/{repeats}, {label}")
            _set_random_state(states[label])
            timed[label].append(runs[label].timed())
            states[label] = _random_state()
    return timed


def rotated(labels: list[str], r: int) -> list[str]:
    """Round r's order: the grid's, started at run r mod len(labels)."""
    i = r % len(labels)
    return labels[i:] + labels[:i]


def _setting_row(run: Prepared, rounds: list[Round], base: list[Round],
                 cfg: BenchConfig) -> dict[str, Any]:
    """A setting's row over its rounds: rates as `summary`; acceptance the first round's
    (greedy: every round's) or, sampled, pooled over the rounds; speedups per round, paired
    with the baseline's round."""
    row = summary([t[0] for t in rounds])
    pooled = SpecResult.merged([t[2] for t in rounds]) if not cfg.params.greedy else rounds[0][2]
    if not cfg.params.greedy:
        row.update(pooled.accept_stats())
    row["phases"] = run.phases(pooled)
    for key, rate in (("speedup", "tokens_per_s"), ("decode_speedup", "decode_tokens_per_s")):
        ups = [_over(t[0][rate], b[0][rate]) for t, b in zip(rounds, base, strict=True)]
        row.update(spread(key, ups, keep_none=key == "speedup"))
        if key == "speedup":
            lo, hi = row["speedup_min"], row["speedup_max"]
            row["within_noise"] = None if lo is None else lo <= 1.0 <= hi
            for each, up in zip(row["rounds"], ups, strict=True):
                each["speedup"] = up
    row["rounds"] = row.pop("rounds")  # last, after the figures it lists
    return row


ROUND_KEYS = ("new_tokens", "seconds", "tokens_per_s", "decode_tokens_per_s",
              "mean_accept_length")


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A row over its rounds' rows: the first round's, its rates (and seconds) the medians, with
    `<rate>_min`/`_max`; host clocks over every round; each round's figures in `rounds`."""
    row = {k: v for k, v in rounds[0].items() if k != EACH}
    row["seconds"] = statistics.median(r["seconds"] for r in rounds)
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        row.update(spread(key, [r[key] for r in rounds], keep_none=False))
    if row.get("host"):
        row["host"] = SpecResult.merged_host([r.get("host") for r in rounds])
    row["rounds"] = [{k: r[k] for k in ROUND_KEYS if k in r} for r in rounds]
    return row


def spread(key: str, values: list[float | None], keep_none: bool) -> dict[str, Any]:
    """`key` as the median of `values` with `key_min`/`key_max`; where any round was not
    measured, `key` None and the range None too (`keep_none`) or left out."""
    if any(v is None for v in values):
        return {key: None, **({f"{key}_min": None, f"{key}_max": None} if keep_none else {})}
    return {key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)}


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _report(cfg: BenchConfig, target, drafter, warnings: list[str],
            suites: dict[str, list[list[int]]], settings: list[Setting],
            rows: list[dict[str, Any]], machine: dict[str, Any] | None) -> dict[str, Any]:
    """`meta` and the rows, smallest batch first; `partial` and `not_run` say what an
    interrupted run left out, `machine_load` how busy the machine was while timing."""
    done = {(r["suite"], r["batch"], r["setting"]) for r in rows}
    names = ["baseline", *map(setting_name, settings)]
    not_run = [f"{suite} batch {b}: {n}" for suite in suites for b in sorted(set(cfg.batch_sizes))
               for n in names if (suite, b, n) not in done]
    order = list(suites)  # batches ran largest first (graph pools reused); reported smallest first
    rows = sorted(rows, key=lambda r: (order.index(r["suite"]), r["batch"]))
    meta = {**_meta(cfg, target, drafter, warnings), "partial": bool(not_run),
            "not_run": not_run, "machine_load": machine}
    if any("by_category" in r for r in rows):
        from draftsmith.bench.report import category_definition

        meta["definitions"]["by_category"] = category_definition(meta)
    return {"meta": meta, "results": rows}


def one_line(e: BaseException) -> str:
    """The error as a record keeps it: its type and its message's first line."""
    said = str(e).strip().splitlines()
    return f"{type(e).__name__}: {said[0]}" if said else type(e).__name__


def _running(cfg: BenchConfig, suites: dict[str, list[list[int]]], settings: list[Setting],
             rows: list[dict[str, Any]]) -> str | None:
    """The run that stopped: the first, in the grid's order, with no row."""
    done = {(r["suite"], r["batch"], r["setting"]) for r in rows}
    names = ["baseline", *map(setting_name, settings)]
    return next((f"{suite} batch {b}: {n}" for suite in suites
                 for b in sorted(set(cfg.batch_sizes), reverse=True) for n in names
                 if (suite, b, n) not in done), None)


def check_topk(settings: list[Setting], draft_vocab: int) -> None:
    """Every tree's topk within the drafter's draft vocabulary: refused by the decoder only when
    its setting came up, after the baseline and the settings before it had run, their results
    lost."""
    if (k := max(s[1] for s in settings)) > draft_vocab:
        raise DraftsmithError(f"--topk {k} exceeds the drafter's draft vocabulary of "
                              f"{draft_vocab}")


def _over(rate: float | None, base: float | None) -> float | None:
    """A speedup; None where the baseline made nothing to divide by (--max-new-tokens 1 decodes
    nothing: 0 over 0 read 0.00x, as if the speculative run were the slower) or either rate
    was not measured (a refilled run has no decode-only rate)."""
    return rate / base if base and rate is not None else None


def _runtimes(model, drafter, suites, cfg: BenchConfig, settings: list[Setting]):
    longest = max(len(p) for ps in suites.values() for p in ps)
    s_max, n_max = max(s[0] for s in settings), max(s[2] for s in settings)
    max_seq = longest + cfg.max_new_tokens + 2 * s_max + 2 + n_max
    rt = Runtime(model, max(cfg.batch_sizes), max_seq, compile=cfg.compile,
                 kept=longest + cfg.max_new_tokens)
    fs = max((0 if k == 1 else TreeShape(k, st, n).frontier_slots) for st, k, n in settings)
    return rt, DrafterRuntime(drafter, rt.max_batch, max_seq + fs, rt.graphs or False,
                              compile=cfg.compile)


def _baseline(rt: Runtime, batches, cfg: BenchConfig, eos: list[int]):
    return _once(_baseline_run(rt, batches, cfg, eos))


def _once(run: Prepared) -> tuple[dict[str, Any], list[list[int]]]:
    """One round: a run's row (a setting's with its phases) and tokens."""
    row, tokens, m = run.timed()
    return (row if m is None else {**row, "phases": run.phases(m)}), tokens


def _baseline_run(rt: Runtime, batches, cfg: BenchConfig, eos: list[int]) -> Prepared:
    warm_each(lambda b: run_generation(rt, b, min(8, cfg.max_new_tokens), cfg.params, eos),
              batches)

    def timed() -> Round:
        with load.timed():
            gens = [run_generation(rt, batch, cfg.max_new_tokens, cfg.params, eos)
                    for batch in batches]
        rows = [t for g in gens for t in g.tokens]
        secs, decode = sum(g.prefill_s + g.decode_s for g in gens), sum(g.decode_s for g in gens)
        host = _host(SpecResult.merged_host([g.host for g in gens]))
        each = [batch_figures(g.tokens, g.decode_s) for g in gens]
        return {**_speed(rows, secs, decode), **host, EACH: each}, rows, None
    return Prepared(timed)


def _host(clock: dict[str, Any] | None) -> dict[str, Any]:
    """The host clock's figures (DRAFTSMITH_HOST_TIMING=1) as a row's `host`; none unclocked."""
    return {"host": clock} if clock else {}


def warm_each(fn: Callable[[list[list[int]]], Any], batches: list[list[list[int]]]) -> int:
    """Run `fn` untimed once on every distinct batch; return how many. Timing only the first
    batch's warm-up left the baseline, timed first, meeting each other prompt shape's eager
    prefill cold (H200 run 4: 37-67 ms a prefill against 20-30 ms in the rows after it)."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for b in batches:
        key = tuple(map(tuple, b))
        if key not in seen:
            seen.add(key)
            fn(b)
    return len(seen)


def _speed(rows: list[list[int]], secs: float, decode: float) -> dict[str, Any]:
    """Tokens/s over prefill + decode (the headline) and over decode alone, whose tokens leave
    out each row's first (the prefill made it)."""
    tokens, decoded = _counts(rows)
    return {"new_tokens": tokens, "seconds": secs, "tokens_per_s": tokens / max(secs, 1e-9),
            "decode_tokens_per_s": decoded / max(decode, 1e-9)}


def batch_figures(rows: list[list[int]], decode_s: float,
                  hist: list[int] | None = None) -> dict[str, Any]:
    """One batch's tokens, decoded tokens (less each row's first, as `_speed`), decode seconds
    and, speculative, its accept histogram."""
    tokens, decoded = _counts(rows)
    out = {"new_tokens": tokens, "decoded": decoded, "decode_s": decode_s}
    return out | ({"accept_hist": list(hist)} if hist is not None else {})


def _counts(rows: list[list[int]]) -> tuple[int, int]:
    """Rows' new tokens, and those the decode made: less each row's first (the prefill's)."""
    tokens = sum(map(len, rows))
    return tokens, tokens - sum(1 for r in rows if r)


def _refilled_speed(rows: list[list[int]], secs: float) -> dict[str, Any]:
    """Refilled rows: prompt passes run among the decode steps, so one rate covers both and
    there is no decode-only rate (None: the wall rate under a decode label read as one)."""
    tokens = sum(map(len, rows))
    return {"new_tokens": tokens, "seconds": secs, "tokens_per_s": tokens / max(secs, 1e-9),
            "decode_tokens_per_s": None}


def _speculative(rt, drt, s: Setting, batches, cfg: BenchConfig, eos):
    return _once(_speculative_run(rt, drt, s, batches, cfg, eos))


def _speculative_run(rt, drt, s: Setting, batches, cfg: BenchConfig, eos) -> Prepared:
    steps, topk, n = s
    dec = SpecDecoder(rt, drt, steps, topk, None if topk == 1 else n, cfg.params, False)
    dec.capture([len(batches[0])])
    warm_each(lambda b: dec.generate(b, min(8, cfg.max_new_tokens), eos), batches)

    def timed() -> Round:
        with load.timed():
            results = [dec.generate(batch, cfg.max_new_tokens, eos) for batch in batches]
        m = SpecResult.merged(results)
        each = [batch_figures(r.tokens, r.decode_s, r.accept_hist) for r in results]
        return {**_speed(m.tokens, m.prefill_s + m.decode_s, m.decode_s), **m.accept_stats(),
                **_host(m.extra.get("host")), EACH: each}, m.tokens, m

    return Prepared(timed, lambda m: profiled_phases(dec, cfg, m, lambda: [
        dec.generate(b, cfg.max_new_tokens, eos).phases for b in batches]))


def profiling(cfg: BenchConfig) -> bool:
    return cfg.profile if cfg.profile is not None else env_on("DRAFTSMITH_PROFILE")


def profiled_phases(dec: SpecDecoder, cfg: BenchConfig, timed: SpecResult,
                    run: Callable[[], list[PhaseSummary | None]]) -> dict[str, Any] | None:
    """Phases from a second, profiled run of the timed one's prompts: a profiled cycle reads
    its done flag at once (a host sync a cycle), which the timed tokens/s must not carry."""
    if not profiling(cfg):
        return None
    dec.profile = True
    try:
        with load.timed():
            parts = run()
    finally:
        dec.profile = False
    return merge_phases(parts, timed.mean_accept_length, dec.steps)


def _baseline_refill(rt: Runtime, batches, cfg: BenchConfig, eos: list[int]):
    return _once(_baseline_refill_run(rt, batches, cfg, eos))


def _baseline_refill_run(rt: Runtime, batches, cfg: BenchConfig, eos: list[int]) -> Prepared:
    from draftsmith.engine.refill import generate_refill, prepare
    from draftsmith.engine.spec_refill import refill_every_for

    flat, rows = [p for b in batches for p in b], len(batches[0])
    prepare(rt, rows, cfg.max_new_tokens, eos, cfg.params, flat)
    sync(rt)

    def timed() -> Round:
        with load.timed():
            t0 = time.perf_counter()
            tokens = generate_refill(rt, flat, cfg.max_new_tokens, cfg.params, eos, rows,
                                     cfg.refill_every or refill_every_for(rows))
            sync(rt)
            secs = time.perf_counter() - t0
        return _refilled_speed(tokens, secs), tokens, None
    return Prepared(timed)


def _speculative_refill(rt, drt, s: Setting, batches, cfg: BenchConfig, eos):
    return _once(_speculative_refill_run(rt, drt, s, batches, cfg, eos))


def _speculative_refill_run(rt, drt, s: Setting, batches, cfg: BenchConfig, eos) -> Prepared:
    from draftsmith.engine.spec_refill import generate_refill, warm_refill

    steps, topk, n = s
    flat, rows = [p for b in batches for p in b], len(batches[0])
    dec = SpecDecoder(rt, drt, steps, topk, None if topk == 1 else n, cfg.params, False)
    warm_refill(dec, flat, rows)

    def run() -> SpecResult:
        return generate_refill(dec, flat, cfg.max_new_tokens, eos, rows, cfg.refill_every or None)

    def timed() -> Round:
        with load.timed():  # wall time around the call, as the refilled baseline's
            t0 = time.perf_counter()
            m = run()  # synced at its end
            secs = time.perf_counter() - t0
        return {**_refilled_speed(m.tokens, secs), **m.accept_stats(), "refill": True}, \
            m.tokens, m

    return Prepared(timed, lambda m: profiled_phases(dec, cfg, m, lambda: [run().phases]))


def merge_phases(parts: list[PhaseSummary | None], accept_length: float,
                 steps: int) -> dict[str, Any] | None:
    parts = [p for p in parts if p is not None and p.cycles]
    if not parts:
        return None
    cycles = sum(p.cycles for p in parts)
    keys = dict.fromkeys(k for p in parts for k in p.ms)  # a refill phase only some parts had
    ms = {k: sum(p.ms.get(k, 0.0) * p.cycles for p in parts) / cycles for k in keys}
    total = sum(ms.values())
    pct = {k: 100 * v / total if total else 0.0 for k, v in ms.items()}
    return PhaseSummary(cycles, ms, pct, total, accept_length,
                        accept_length / (steps + 1)).to_dict()


@torch.no_grad()
def agreement(model, batches, base: list[list[int]], spec: list[list[int]],
              eos: list[int]) -> dict[str, Any]:
    """Greedy speculative vs baseline completions: identical count, and at each first
    divergence the two candidates' logit gap (a near-tie shows up as a tiny gap)."""
    prompts = [p for batch in batches for p in batch]
    divergent = []
    for i, (p, a, b) in enumerate(zip(prompts, base, spec, strict=True)):
        if a == b:
            continue
        j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        divergent.append({"prompt": i, "position": j, **_gap(model, p + a[:j], a, b, j, eos)})
    gaps = [d["gap"] for d in divergent if d["gap"] is not None]
    return {"prompts": len(prompts), "identical": len(prompts) - len(divergent),
            "max_gap": max(gaps, default=None if divergent else 0.0),
            "divergences": divergent[:20]}


def _gap(model, prefix: list[int], a: list[int], b: list[int], j: int,
         eos: list[int]) -> dict[str, float | None]:
    """The two candidates' logit gap at divergence j; None where one candidate is an end with
    no EOS id in the vocabulary to read its logit from."""
    dev = model.embed.weight.device
    ids = torch.tensor([prefix], device=dev)
    logits = model(ids, torch.arange(len(prefix), device=dev)[None]).logits[0, -1].float()
    top = logits.topk(2).values

    ends = [e for e in eos if 0 <= e < logits.numel()]  # an eos id may lie past the vocabulary

    def pick(seq: list[int]) -> float | None:
        if j < len(seq):
            return float(logits[seq[j]])
        return float(logits[ends].max()) if ends else None

    x, y = pick(a), pick(b)
    gap = None if x is None or y is None else abs(x - y)
    return {"gap": gap, "top2_gap": float(top[0] - top[1]),
            "relative_gap": None if gap is None else gap / max(float(logits.std()), 1e-9)}


def _meta(cfg: BenchConfig, target, drafter, warnings: list[str]) -> dict[str, Any]:
    from draftsmith.bench.report import definitions

    dev = torch.device(cfg.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name or dev.type, "dtype": str(cfg.dtype).replace("torch.", ""),
        "compile": cfg.compile,
        "torch": torch.__version__, "target": target.source,
        "target_fingerprint": target.fingerprint, "drafter": cfg.drafter or "",
        "aux_layer_ids": list(drafter.cfg.aux_layer_ids),
        "params": {"temperature": cfg.params.temperature, "top_p": cfg.params.top_p,
                   "top_k": cfg.params.top_k},
        "seed": None if cfg.params.greedy else cfg.seed,  # a greedy run draws nothing
        "max_new_tokens": cfg.max_new_tokens, "num_prompts": cfg.num_prompts,
        "suites": list(suite_labels(cfg.suites)), "warnings": warnings,
        "refill": cfg.refill,
        "refill_every": (cfg.refill_every or "by rows") if cfg.refill else None,
        "timing": timing(cfg.repeats), **({"repeats": cfg.repeats} if cfg.repeats > 1 else {}),
    }
    return {**meta, "definitions": definitions(meta)}
