"""Ready-to-paste serving flags for a chosen setting: SGLang and vLLM."""

from __future__ import annotations

import json
import shlex
from os import PathLike
from pathlib import Path
from typing import NamedTuple

from draftsmith.tune.cost_model import DEEPEST, Recommendation, SpecSetting, tree_capacity


class VllmConfig(NamedTuple):
    json: str  # the value of --speculative-config; empty for no speculation
    note: str | None  # what differs from the chosen setting, if anything


def tp_world(tp: int | None = None) -> int:
    """`tp`, or where None the tensor-parallel world this process runs in: a tune under `--tp
    N` is one TP group of every process (spawned or torchrun), else 1."""
    if tp is not None:
        return tp
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sglang_flags(setting: SpecSetting, draft_model_path: str | PathLike | None = None,
                 tp: int = 1) -> str:
    """SGLang server flags (`--tp-size N` where tp > 1, the target and draft sharded as
    tuned); no --speculative-* for no speculation (empty at tp 1)."""
    flags = [f"--tp-size {tp}"] if tp > 1 else []
    if setting.is_baseline:
        return " ".join(flags)
    flags += [
        "--speculative-algorithm EAGLE3",
        f"--speculative-num-steps {setting.steps}",
        f"--speculative-eagle-topk {setting.topk}",
        f"--speculative-num-draft-tokens {setting.num_draft_tokens}",
    ]
    if draft_model_path is not None:
        flags.append(f"--speculative-draft-model-path {shlex.quote(str(draft_model_path))}")
    return " ".join(flags)


UNNAMED = "TARGET"  # the launch lines' stand-in where no target is known


def launch_command(engine: str, target: str, flags: str) -> str:
    """The whole command that serves `target` (an HF folder or hub id; UNNAMED where "") with
    `flags`: SGLang's launch_server or `vllm serve`."""
    head = {"sglang": "python -m sglang.launch_server --model-path", "vllm": "vllm serve"}[engine]
    return f"{head} {shlex.quote(target or UNNAMED)} {flags}".rstrip()


def vllm_speculative_config(setting: SpecSetting, model_path: str | PathLike) -> VllmConfig:
    """vLLM's --speculative-config JSON. vLLM's EAGLE-3 drafts a chain, so a tree setting
    becomes the chain of the same depth, and the note says so."""
    if setting.is_baseline:
        return VllmConfig("", "no speculation: serve without --speculative-config")
    config = {"method": "eagle3", "model": str(model_path), "num_speculative_tokens": setting.steps}
    note = None
    if setting.topk > 1:
        note = (
            f"vLLM drafts a chain: topk {setting.topk} with {setting.num_draft_tokens} draft "
            f"tokens becomes a chain of {setting.steps}; its speed was not what was predicted "
            "or measured here (tune with --max-topk 1 for vLLM)"
        )
    return VllmConfig(json.dumps(config), note)


def vllm_flags(setting: SpecSetting, model_path: str | PathLike, tp: int = 1) -> str:
    """`--speculative-config '<json>'`, quoted for a POSIX shell, after `--tensor-parallel-size
    N` where tp > 1; no --speculative-config for no speculation (empty at tp 1)."""
    config = vllm_speculative_config(setting, model_path).json
    flags = [f"--tensor-parallel-size {tp}"] if tp > 1 else []
    if config:
        flags.append(f"--speculative-config {shlex.quote(config)}")
    return " ".join(flags)


def vllm_choice(rec: Recommendation) -> tuple[SpecSetting, str | None]:
    """The setting vLLM's flags take, and a note where it is not the choice. vLLM's EAGLE-3
    drafts a chain, so for a chosen tree: the fastest chain among the recommendation's rows,
    or no speculation where that beat them, by measured figures where a chain was measured
    (`tune` sweeps every chain), else by predicted ones; not the chain of the tree's depth,
    which may be far slower."""
    if rec.setting.topk == 1:
        return rec.setting, None
    for source in ("measured", "predicted"):
        tps = {r.setting: v for r in rec.rows if r.setting.topk == 1
               and (v := r.measured_tps if source == "measured" else r.predicted_tps) is not None}
        if any(not s.is_baseline for s in tps):
            best = min(tps, key=lambda s: (-tps[s], s.steps))
            what = ("no chain beat no speculation" if best.is_baseline
                    else f"the fastest chain {source} here is {best}")
            return best, (f"vLLM drafts a chain, not topk {rec.setting.topk}: {what} ({source} "
                          f"{tps[best]:.1f} tok/s)")
    return SpecSetting(rec.setting.steps), vllm_speculative_config(rec.setting, "").note


def model_pick_line(rec: Recommendation) -> list[str]:
    """Whether the model's pick (the fastest predicted setting) is the sweep's best, and where
    not, its own measured figure and the tokens/s lost had it been served (the regret)."""
    regret, pick = rec.regret_tps, rec.predicted_best
    if regret is None or pick is None:
        return []
    if pick == rec.setting or regret <= 0:  # a tie is no loss
        return ["  model's pick: the measured best" + ("" if pick == rec.setting else
                                                       f" (tied: {pick})")]
    pred = next((r.predicted_tps for r in rec.rows if r.setting == pick), None)
    said = "" if pred is None else f" (predicted {pred:.1f} tok/s)"
    return [f"  model's pick: {pick}{said} measured "
            f"{rec.predicted_best_measured_tps:.1f} tok/s: {regret:.1f} tok/s "
            f"({rec.regret_pct:.1f} %) below the measured best"]


IDLE_HINT = 0.1  # idle share of row slots from which the text points at refilled rows


def export_paths(drafter: str | PathLike) -> dict[str, str]:
    """Where the flags of a tuned draftsmith folder point: the engine layouts `draftsmith
    export` writes beside it (neither engine loads the draftsmith layout itself). A folder
    named `.` or `..` is named by its absolute path: `.-sglang` would lie inside it, where
    export refuses to write."""
    p = Path(drafter)
    p = p.resolve() if p.name in ("", "..") else p
    return {fmt: f"{p}-{fmt}" for fmt in ("sglang", "speculators")}


def edge_notes(setting: SpecSetting, limits: tuple[int, int, int]) -> list[str]:
    """Where the choice sits at one of tune's limits (--max-steps, --max-topk,
    --max-draft-tokens) that could be raised: a faster setting may lie past it, never tried."""
    max_steps, max_topk, max_draft = limits
    if setting.is_baseline:
        return []
    out = []
    if setting.steps == max_steps < DEEPEST:
        out.append(f"--max-steps {max_steps}: no deeper draft was tried; rerun with "
                   f"--max-steps {min(2 * max_steps, DEEPEST)}")
    if setting.topk == max_topk > 1:
        out.append(f"--max-topk {max_topk}: no wider tree was tried; rerun with "
                   f"--max-topk {2 * max_topk}")
    if setting.topk > 1 and setting.num_draft_tokens == max_draft < tree_capacity(
            setting.steps, setting.topk):
        out.append(f"--max-draft-tokens {max_draft}: no larger tree was tried; rerun with "
                   f"--max-draft-tokens {2 * max_draft}")
    return [f"  limit:  the choice is at {n}" for n in out]


def recommendation_text(rec: Recommendation, model_path: str | PathLike, top: int = 5,
                        refilled: bool = False, exports: dict[str, str] | None = None,
                        tp: int | None = None, limits: tuple[int, int, int] | None = None,
                        target: str | None = None) -> str:
    """A few lines for the terminal: the choice, the measured settings (or the top predicted
    ones when nothing was measured) with both figures side by side, and the flags; the hint
    at refilled rows only where they were not already the measure (`refilled`). With
    `exports` (`export_paths`), the flags name those folders and a line says how to write
    them from `model_path`. `tp`: the tensor-parallel size tuned (None: `tp_world`), which
    the engines' flags name where over 1. `limits`: tune's (max steps, topk, draft tokens),
    a choice at one of them said so (`edge_notes`). `target`: the folder the engines serve,
    named in whole launch commands after the flags (None: flags only)."""
    tp = tp_world(tp)
    lines = [f"batch {rec.batch}: {rec.setting} ({rec.source} {rec.tokens_per_s:.1f} tok/s)"]
    if rec.speedup is not None and rec.speculate:
        lines[0] += f", {rec.speedup:.2f}x over no speculation"
    lines += edge_notes(rec.setting, limits) if limits else []
    measured = [r for r in rec.rows if r.measured_tps is not None]
    shown = measured or rec.rows[:top]
    for row in shown:
        pred = "-" if row.predicted_tps is None else f"{row.predicted_tps:.1f}"
        pred += "*" if row.extrapolated else ""
        meas = "-" if row.measured_tps is None else f"{row.measured_tps:.1f}"
        err = "" if row.error_pct is None else f" ({row.error_pct:+.1f} %)"
        lines.append(f"  {row.setting!s:<40} predicted {pred:>8}  measured {meas:>8}{err}")
    if any(r.extrapolated for r in shown):
        lines.append("  * predicted past what was measured (a depth beyond the measured "
                     "acceptance or costs: the last measured value reused)")
    if rec.error_pct is not None:
        lines.append(f"  model error on the choice: {rec.error_pct:+.1f} %; cause: {rec.cause}")
    lines += model_pick_line(rec)
    if not refilled and rec.busy is not None and rec.busy < 1 - IDLE_HINT:
        lines.append(
            f"  idle rows: {1 - rec.busy:.0%} of row slots idle (a static batch runs until its "
            "slowest row ends); refilled rows take them back: tune for them with `draftsmith "
            "tune --refill`, measure with `draftsmith bench --refill` (H200: 1.08-1.35x over "
            "static batches at batch 8, benchmarks/spec_refill.md)")
    if rec.speculate:
        sg, sp = (exports or {}).get("sglang", model_path), (exports or {}).get(
            "speculators", model_path)
        chain, note = vllm_choice(rec)
        lines.append(f"  SGLang: {sglang_flags(rec.setting, sg, tp)}")
        vllm = vllm_flags(chain, sp, tp)
        if chain.is_baseline:
            vllm = f"{vllm} (serve without --speculative-config)".lstrip()
        lines.append(f"  vLLM:   {vllm}")
        if target is not None:
            lines += _commands(target, sglang_flags(rec.setting, sg, tp), vllm_flags(chain, sp, tp))
        if note:
            lines.append(f"  note:   {note}")
        if exports:
            q = shlex.quote
            line = (f"  export: draftsmith export {q(str(model_path))} --format sglang --out "
                    f"{q(str(sg))}")
            if not chain.is_baseline:
                line += (f"; draftsmith export {q(str(model_path))} --format speculators "
                         f"--speculative-tokens {chain.steps} --out {q(str(sp))}")
            lines.append(line)
    else:  # the engines' plain serving won: say so rather than print no deploy line at all
        tp_flag = f" {sglang_flags(rec.setting, None, tp)}" if tp > 1 else ""
        lines.append(f"  SGLang: no --speculative-* flags{tp_flag} (no speculation was fastest "
                     "at this batch)")
        lines.append("  vLLM:   serve without --speculative-config"
                     + (f" ({vllm_flags(rec.setting, model_path, tp)})" if tp > 1 else ""))
        if target is not None:
            lines += _commands(target, sglang_flags(rec.setting, None, tp),
                               vllm_flags(rec.setting, model_path, tp))
    return "\n".join(lines)


def _commands(target: str, sglang: str, vllm: str) -> list[str]:
    """The whole launch commands, and where the target is unknown, what to put in its place."""
    lines = [f"  SGLang command: {launch_command('sglang', target, sglang)}",
             f"  vLLM command:   {launch_command('vllm', target, vllm)}"]
    if not target:
        lines.append(f"  {UNNAMED}: the target model's folder (the one the drafter was "
                     "trained for)")
    return lines
