"""`draftsmith tune`: measure costs and acceptance, predict every setting, sweep the best ones
and their neighbours on the real engine, and recommend a setting per batch size."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from draftsmith.errors import DraftsmithError
from draftsmith.options import COMPILE, DEVICE, DTYPE, TARGET, check_folder, given, int_list
from draftsmith.tune.cost_model import DEEPEST
from draftsmith.tune.partial import PARTIAL, Partial  # noqa: F401 (PARTIAL: the file's name)

if TYPE_CHECKING:
    from collections.abc import Callable

    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.models.eagle3 import Eagle3Config
    from draftsmith.models.parallel import TP
    from draftsmith.tune.cost_model import Measurement, Prediction, SpecSetting
    from draftsmith.tune.measure import Engine

    # a swept setting that failed: its batch, setting, why (one line) and the error
    Failure = tuple[int, SpecSetting, str, Exception]

console = Console()


def say(text: str) -> None:
    """A line as it is: paths and flags unread as rich markup (a `[x]` in a path vanished, a
    `[/x]` raised after the whole tune) and never wrapped (a flags line broke at 80 columns
    when piped, at the terminal's width otherwise, into lines that paste as separate
    commands)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def tune(
    drafter: Path = typer.Option(..., "--drafter", help="A draftsmith drafter folder"),
    target: str = TARGET,
    prompts: str = typer.Option(None, "--suite", "--prompts", show_default=False,
                                help="chat, humaneval, or a prompt file  [default: chat]"),
    num_prompts: int = typer.Option(0, "--num-prompts", help="The first N prompts only; 0 = all "
                                    "(fewer: a quicker, noisier tune)"),
    batch_sizes: str = typer.Option("1,8,32", "--batch-sizes", "--batch-size",
                                    help="Batch sizes to tune for, comma-separated"),
    max_steps: int = typer.Option(7, "--max-steps", help="Deepest chain to measure and sweep"),
    max_topk: int = typer.Option(8, "--max-topk", help="Widest tree to consider (1 = chains)"),
    max_draft_tokens: int = typer.Option(32, "--max-draft-tokens",
                                         help="Most tokens a tree may verify (the root counted)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n",
                                       help="New tokens per prompt"),
    temperature: float = typer.Option(0.0, "--temperature", help="Tune for sampled decoding at "
                                      "this temperature (0: greedy); baselines sample alike"),
    top_p: float = typer.Option(1.0, "--top-p", help="With --temperature: nucleus sampling"),
    top_k: int = typer.Option(0, "--top-k", help="With --temperature: the k likeliest only"),
    seed: int = typer.Option(0, help="Seeds the sampling (every TP rank alike)"),
    top: int = typer.Option(3, help="Predicted settings to sweep (plus neighbours)"),
    refill: bool = typer.Option(False, "--refill", help="Price and sweep refilled rows (an "
                                "ended row takes the next prompt: continuous batching, as SGLang "
                                "and vLLM serve) instead of static batches"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    compile: bool = COMPILE,
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (spawned; the drafter is "
                           "replicated on each)"),
    nccl_sweep: bool = typer.Option(False, "--nccl-sweep", help="With --tp: then time the chosen "
                                    "verify shapes under NCCL settings, each in fresh processes"),
    nccl_grid: str = typer.Option(None, "--nccl-grid",
                                  help="With --nccl-sweep: quick (6 settings, the default) or full "
                                  "(14)"),
    out: Path = typer.Option(Path("runs/tune"), "--out", "-o",
                             help="Folder for tune.json, tune.md, tune.png"),
) -> None:
    """Pick the fastest steps/topk/draft tokens per batch size (or no speculation)."""
    from draftsmith.cli import device_dtype

    if max_steps < 1 or max_topk < 1:
        raise DraftsmithError(f"--max-steps and --max-topk must be >= 1, got {max_steps} and "
                              f"{max_topk}")
    if max_steps > DEEPEST:  # SpecSetting's limit, met only after minutes of loading otherwise
        raise DraftsmithError(f"--max-steps must be at most {DEEPEST}, got {max_steps}")
    if max_draft_tokens < 2:
        raise DraftsmithError(f"--max-draft-tokens must be >= 2, got {max_draft_tokens}")
    if top < 1:
        raise DraftsmithError(f"--top must be >= 1 (settings swept per batch size), got {top}")
    if num_prompts < 0:
        raise DraftsmithError(f"--num-prompts must be >= 0 (0 = all), got {num_prompts}")
    if max_new_tokens < 2:  # the first token comes from the prefill: no cycle to measure
        raise DraftsmithError(f"--max-new-tokens must be >= 2 (a speculative cycle needs a "
                              f"token after the prefill's), got {max_new_tokens}")
    check_folder(out, "--out")
    if tp < 1:
        raise DraftsmithError(f"--tp must be >= 1 (tensor-parallel ranks), got {tp}")
    if nccl_sweep and tp < 2:
        raise DraftsmithError(f"--nccl-sweep needs --tp 2 or more (NCCL settings matter only "
                              f"across ranks), got --tp {tp}")
    if nccl_grid is not None and not nccl_sweep:
        raise DraftsmithError("--nccl-grid picks the settings --nccl-sweep times: give "
                              "--nccl-sweep with it")
    nccl_grid = nccl_grid or "quick"
    if nccl_sweep:  # refused now, not after the whole tune
        if nccl_grid not in ("quick", "full"):
            raise DraftsmithError(f"--nccl-grid {nccl_grid!r}: use quick or full")
        check_folder(out / "nccl", "--out")
    from draftsmith.cli import sampling_params
    from draftsmith.models.eagle3 import check_drafter
    from draftsmith.options import check_compile, check_seed

    params = sampling_params(temperature, top_p, top_k, bool(given(tune, seed=seed)))
    check_seed(seed)
    dev, dt = device_dtype(device, dtype)
    check_compile(compile, dev)  # before TP ranks are spawned
    batches = sorted(set(int_list(batch_sizes, "--batch-sizes")))
    suite_path = None if prompts is None else Path(prompts)
    args = (drafter, target, suite_path, batches, max_steps, max_new_tokens, top, dev, dt, compile,
            out, max_topk, params, seed, max_draft_tokens, refill, num_prompts, nccl_sweep)
    _one_group(tp)
    if tp == 1:
        report = run_tune(*args)
    else:
        from draftsmith.dist import launch_tp
        from draftsmith.tune.tp_targets import refuse_split

        if nccl_sweep and "WORLD_SIZE" in os.environ:
            raise DraftsmithError("--nccl-sweep spawns fresh processes per setting: run "
                                  "`draftsmith tune --tp N --nccl-sweep` without torchrun")
        refuse_split(target, tp)
        # before ranks spawn (each rank's run_tune checks both again): a rank's refusal came
        # back only after every rank had started, prefixed `rank 0:`
        check_topk(max_topk, check_drafter(drafter))
        suite(suite_path)  # an empty or unreadable --prompts: one line too, not `rank 0: ...`
        report = launch_tp(_tune_rank, tp, *args, device=dev)
    if "recommendations" not in report:  # a torchrun rank other than 0: rank 0 reports
        return
    for text in report["texts"]:
        say(text)
    say(f"wrote {out}/tune.json, tune.md, tune.png")
    if nccl_sweep:
        attach_nccl(out, _nccl_for(report, tp, target, dev, dt, nccl_grid, out / "nccl",
                                   drafter))
        (out / PARTIAL).unlink(missing_ok=True)  # kept till now: a stopped sweep's rerun


def _one_group(tp: int) -> None:
    """Under torchrun tune times one TP group made of every process: --tp 1 in each of N
    processes (or N / tp groups) would time the same settings side by side on shared devices,
    each writing --out."""
    from draftsmith.dist import torchrun_ranks

    world = torchrun_ranks()[1]  # half a torchrun environment refused here too
    if ("RANK" in os.environ or "WORLD_SIZE" in os.environ) and world != tp:
        raise DraftsmithError(f"--tp {tp} under torchrun with WORLD_SIZE={world}: tune times "
                              f"one tensor-parallel group of every process; give --tp {world}, "
                              f"or run --tp {tp} without torchrun")


def writes_out(tp: TP | None) -> bool:
    """Whether this process writes --out: the world's rank 0 alone (under torchrun every
    process runs tune, and another TP group's rank 0 is no writer either)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    from draftsmith.dist import torchrun_ranks

    return torchrun_ranks()[0] == 0 and (tp is None or tp.rank == 0)


def _tune_rank(tp, *args) -> dict:
    """One TP rank of `tune`: every rank measures the same settings in step (the collectives
    pair up); rank 0 prints and writes the report."""
    console.quiet = tp.rank != 0
    return run_tune(*args, tp=tp)


# what `tune --nccl-sweep` writes into out/nccl (and a stopped sweep's timings)
NCCL_FILES = ("nccl.json", "nccl.md", "nccl.partial.json")


def drop_stale_nccl(out: Path, sweeps: bool = False) -> None:
    """An earlier `tune --nccl-sweep`'s files in out/nccl timed that run's verify shapes: a new
    tune's report replaces that run's, so they go with it (the folder too, where left empty).
    `sweeps`: this run sweeps too, so a stopped sweep's timings stay for it to take up where
    they are its own (`_nccl_for` drops another's)."""
    folder = out / "nccl"
    for name in NCCL_FILES[:2] if sweeps else NCCL_FILES:
        (folder / name).unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def attach_nccl(out: Path, res: dict) -> None:
    """This run's NCCL sweep, named in its tune.json and its recommendation added to tune.md."""
    from draftsmith.data.atomic import atomic_write
    from draftsmith.tune import nccl

    path, md = out / "tune.json", out / "tune.md"
    report = json.loads(path.read_text())
    report["nccl"] = {"file": "nccl/nccl.json", "recommendation": res["recommendation"]}
    lines = "\n".join(nccl.recommendation_lines(res))
    kept = "it keeps the tune's report without the sweep, which nccl/nccl.json holds"
    atomic_write(path, json.dumps(report, indent=1, default=str).encode(), kept)
    text = f"{md.read_text()}\nNCCL sweep (nccl/nccl.json, nccl/nccl.md):\n\n{lines}\n"
    atomic_write(md, text.encode(), kept)


def _nccl_for(report: dict, tp: int, target: str, dev: str, dt, kind: str,
              out: Path, drafter: Path) -> dict:
    """The NCCL settings sweep on the verify shapes the recommendations use, capturing the
    drafter's aux layers as its verifies do."""
    from draftsmith.models.eagle3 import read_drafter_config
    from draftsmith.tune import nccl

    aux = read_drafter_config(drafter).aux_layer_ids  # a config changed since: one line
    shapes = sorted({(r["batch"], r["verify_tokens"]) for r in report["recommendations"]})
    res = nccl.run_nccl_sweep(tp, target, nccl.grid(kind), shapes, dev, nccl.dtype_key(dt), 20,
                              nccl.NOISE_PCT, 300.0, out,
                              log=say, aux=aux,
                              replace_other=True)
    nccl.print_report(res)
    say(f"wrote {out}/nccl.json, nccl.md")
    return res


def run_tune(
    drafter_dir,
    target,
    prompts_path,
    batches,
    max_steps,
    new,
    top,
    dev,
    dt,
    compile,
    out: Path,
    max_topk: int = 8,
    params: SamplingParams | None = None,
    seed: int = 0,
    max_draft: int = 32,
    refill: bool = False,
    num_prompts: int = 0,
    sweeps_nccl: bool = False,
    tp=None,
) -> dict:
    """The whole tune; `sweeps_nccl`: an NCCL sweep follows, so tune.partial.json stays after
    tune.json until it ends (`tune`): a sweep stopped partway is rerun without measuring the
    tune again, and its timings are taken up."""
    import torch

    from draftsmith.bench import load
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.generate import check_positions
    from draftsmith.engine.refill import PREFILL_ROWS
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.models.eagle3 import check_drafter, load_drafter
    from draftsmith.options import check_compile
    from draftsmith.targets import load_target, served_folder
    from draftsmith.tune import measure, partial
    from draftsmith.tune.cost_model import recommend
    from draftsmith.tune.flags import export_paths, recommendation_text

    check_compile(compile, dev)
    texts = suite(prompts_path)  # before minutes of loading: an empty file is refused
    texts = texts[:num_prompts] if num_prompts else texts
    dcfg = check_drafter(drafter_dir)  # a mistyped or damaged --drafter
    check_topk(max_topk, dcfg)
    torch.manual_seed(seed)
    t = load_target(target)
    if mismatch := check_pair_of(drafter_dir, dcfg, t):
        say(mismatch)
    if deeper := past_training(drafter_dir, max_steps):
        say(deeper)
    if repeats := few_prompts(len(texts), batches):
        say(repeats)
    if tp is not None:
        dev = str(tp.device)
    ids = [t.chat_ids([{"role": "user", "content": p}]) for p in texts]
    # the acceptance runs decode --max-new-tokens past each prompt: refused before the weights
    check_positions(ids, new, t.cfg.max_position_embeddings, "--max-new-tokens",
                    t.cfg.sliding_window)
    # and the costs, timed within its positions (and its sliding window: the decode probes are
    # requests, which the engine keeps within it)
    most = min(filter(None, (t.cfg.max_position_embeddings, t.cfg.sliding_window)), default=None)
    measure.cost_room(most, ids, measure.cost_width(max_steps, max_topk, max_draft))
    params = params or SamplingParams()
    rank0 = writes_out(tp)
    kept = Partial(out if rank0 else None, {
        "drafter": str(drafter_dir), "target": target, "prompts": str(prompts_path),
        **(_identity(t, drafter_dir, ids, dev, dt, compile, tp, seed) if rank0 else {}),
        "batches": batches, "new_tokens": new, "max_steps": max_steps, "max_topk": max_topk,
        "max_draft_tokens": max_draft, "refill": refill,
        "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                     "top_k": params.top_k}})
    was = partial.agreed(tp, kept.resume)  # another tune's kept figures: refused before loading
    if was:
        say(f"resuming from {kept.path}: what it measured is not measured again")
    model = t.build(dt, dev, tp)
    # under TP the target's embedding is sharded: the drafter takes the whole one
    embed = model.embed.weight if tp is None or tp.size == 1 else t.weights.get(
        "model.embed_tokens.weight")
    drafter = load_drafter(drafter_dir, dev, dt, embed=embed)
    # the widest verify (the tree acceptance run's or the costs' widest) past the longest row,
    # and past position 64, where the costs are timed
    max_seq = max(max(len(p) for p in ids) + new, 64) + 64 + verify_width(max_steps, max_topk,
                                                                         max_draft)
    rt = Runtime(model, max(batches), max_seq + 40, compile=compile,
                 kept=max(len(p) for p in ids) + new)  # the costs' timing keeps no output
    # room for the widest tree's frontier slots beyond the target's scratch region
    drt = DrafterRuntime(drafter, max(batches), max_seq + 40 + 64 * max_steps, rt.graphs or False,
                         compile=compile)
    eng = measure.Engine(rt, drt, drafter, params)
    eos: list[int] = []  # the sweep: fixed-length rows, so batches stay full (as modelled)
    # other work on the cores skews costs and sweep unevenly: the report says so, as bench's
    with kept.on_failure(say), load.watching() as machine:
        acc, mix = _acceptance(eng, kept, was, ids, (max_steps, max_topk, max_draft), new,
                               t.eos_ids)
        rows = min(max(batches), PREFILL_ROWS)  # the refills' prompt passes' widest
        costs = partial.kept_costs(was, batches, rows)
        eng.costs = measure.CostLog(shapes := partial.kept_shapes(was),
                                    lambda f: kept.save(cost_shapes=f), say)
        if todo := partial.missing(costs, batches):  # another --batch-sizes: the new ones
            say("measuring costs ..." + (f" ({len(shapes)} shapes timed before it stopped)"
                                         if shapes else ""))
            costs = partial.joined(costs, measure.cost_table(eng, todo, ids, max_topk, max_steps,
                                                             max_draft, most), batches)
            kept.save(costs=costs.to_dict())
        refilled = refill_plan(new, batches) if refill else None
        if refill and not costs.refill:
            before = sum(measure.refill_key(k, rows, spec) in shapes
                         for k, spec in measure.refill_shapes(rows))
            say("measuring refills' prompt passes ..." + (
                f" ({before} timed before it stopped)" if before else ""))
            base, spec = measure.refill_costs(eng, batches, ids)
            costs = dataclasses.replace(costs, refill=base, spec_refill=spec)
            kept.save(costs=costs.to_dict(), refill_rows=rows)
        if tp is not None and tp.size > 1:  # ranks time alike, not equal: plan on rank 0's costs,
            costs, acc, mix = _from_rank0(tp, (costs, acc, mix))  # or their sweeps would part
        preds, meas, done = [], [], partial.kept_measured(was)
        failed: list[Failure] = []
        swept = time.perf_counter()
        limits = (max_steps, max_topk, max_draft)
        for b in batches:
            ranked, todo = plan_batch(costs, acc, b, limits, mix, refilled,
                                      None if refill else new, top)
            preds += ranked
            for i, s in enumerate(todo, 1):
                where = f"batch {b}, setting {i}/{len(todo)}: {s}"
                if (m := done.get((b, s))) is not None:
                    console.print(f"{where} (measured before it stopped)")
                    meas.append(m)
                    continue
                console.print(f"{where} ({time.perf_counter() - swept:.0f} s into the sweep)")
                m = sweep_run(eng, tp, failed, lambda s=s, b=b: measure.run_setting(
                    eng, s, ids, b, new, eos, refilled.waves if refilled else 0), b, s)
                if m is not None:
                    meas.append(m)
                    kept.save(measured=[partial.measured_row(m) for m in meas])
        if failed and not meas:  # nothing swept at all: no report of predictions alone
            raise failed[0][3]
        recs = recommend(choices(preds, meas, failed), meas)
        texts = [recommendation_text(r, str(drafter_dir), refilled=refill,
                                     exports=export_paths(drafter_dir),
                                     tp=1 if tp is None else tp.size, limits=limits,
                                     target=served_folder(t))
                 for r in recs]
        texts = batch_texts(batches, {r.batch: x for r, x in zip(recs, texts, strict=True)},
                            failed)
        if refill:
            texts.insert(0, "rows refilled as they end (continuous batching): tokens/s over the "
                            "whole run, prompt passes included, baselines alike")
        if not eng.params.greedy:
            p = eng.params
            texts.insert(0, f"tuned for sampling at temperature {p.temperature:g}, top-p "
                            f"{p.top_p:g}, top-k {p.top_k or 'off'}: acceptance, baselines and "
                            "sweep all sampled")
        if mismatch:
            texts.append(mismatch)
        texts += [x for x in (deeper, repeats) if x]
        machine_load = machine.result()
        if note := load.busy_note(machine_load):
            texts.append(f"{note} (predicted and measured tok/s both)")
        if not rank0:
            return {"texts": texts}  # launch_tp hands back rank 0's report
        report = write_report(out, acc, costs, preds, meas, recs, texts, batches, dev,
                              1 if tp is None else tp.size, eng.params, refill, mix, new,
                              sweeps_nccl, machine_load, failed)
    if sweeps_nccl:
        kept.save(status="tune.json written; kept until the NCCL sweep (nccl/) ends: the same "
                         "tune run again takes these figures up")
    else:
        kept.drop()  # tune.json holds it all
    report["texts"] = texts
    return report


def sweep_run(eng: Engine, tp: TP | None, failed: list[Failure],
              run: Callable[[], Measurement], batch: int,
              setting: SpecSetting) -> Measurement | None:
    """One swept setting's measurement, or None where it failed (out of memory at a large
    batch, any error not ours): said, recorded in `failed` and the sweep goes on, so the other
    settings and batch sizes keep their figures. Our own refusals stop the tune (the same for
    every setting), as a failure under TP does (a rank going on alone would hang its peers)
    and one that leaves the device unusable."""
    import torch

    try:
        return run()
    except DraftsmithError:
        raise
    except Exception as e:
        if tp is not None and tp.size > 1:
            raise
        if eng.device.type == "cuda":
            try:
                torch.cuda.synchronize(eng.device)
                torch.cuda.empty_cache()
            except Exception:  # a sticky CUDA error: nothing after it would run
                raise e from None
        why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        failed.append((batch, setting, why, e))
        say(f"batch {batch}, {setting} failed ({why}); the sweep goes on without it")
        return None


def choices(preds: list[Prediction], meas: list[Measurement],
            failed: list[Failure]) -> list[Prediction]:
    """The predictions a recommendation may pick from: none of a setting seen failing, and
    none at a batch where nothing was measured (every swept setting failed), whose best
    prediction was a setting nobody ran: that batch is said to have no choice."""
    bad = {(b, s) for b, s, _, _ in failed}
    none_ran = {b for b, _ in bad} - {m.batch for m in meas}
    return [p for p in preds if p.batch not in none_ran and (p.batch, p.setting) not in bad]


def few_prompts(count: int, batches: list[int]) -> str | None:
    """A note where a batch has more rows than the prompts: `prompt_groups` fills it by
    repeating them, so its figures are those prompts' (the default 1,8,32 over the 22-prompt
    chat suite too)."""
    over = [b for b in batches if b > count]
    if not over:
        return None
    sizes = ", ".join(map(str, over))
    one = len(over) == 1
    has, its = ("has", "its") if one else ("have", "their")
    rows = f"{over[0]} distinct requests'" if one else "as many distinct requests'"
    return (f"note: batch {sizes} {has} more rows than the {count} prompts tuned on, so {its} "
            f"rows repeat prompts: {its} figures are those prompts', not {rows}; give at least "
            f"{over[-1]} prompts (--prompts, --num-prompts) for distinct rows")


def batch_texts(batches: list[int], said: dict[int, str], failed: list[Failure]) -> list[str]:
    """Each batch's text in batch order, its failed settings under it: a batch where nothing
    ran said in its place (it came after every other batch's)."""
    return [said.get(b, f"batch {b}: no setting ran, so none is recommended")
            + failed_lines(b, failed) for b in batches]


def failed_lines(batch: int, failed: list[Failure]) -> str:
    """The settings at `batch` the sweep could not run, each with why: the choice is the best
    of the rest."""
    return "".join(f"\n  failed: {s!s:<40} {why}" for b, s, why, _ in failed if b == batch)


def _identity(t, drafter_dir: Path, ids: list[list[int]], dev: str, dt, compile: bool, tp,
              seed: int) -> dict:
    """What makes a stopped tune's measurements this tune's, besides its options: the very
    target, drafter and prompts, timed on the same device, dtype, compile and ranks."""
    from draftsmith.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE
    from draftsmith.tune.partial import files_digest, ids_digest

    return {"target_fingerprint": t.fingerprint,
            "drafter_digest": files_digest(Path(drafter_dir), (CONFIG_FILE, WEIGHTS_FILE)),
            "prompt_digest": ids_digest(ids), "device": device_name(dev), "dtype": str(dt),
            "compile": compile, "tp": 1 if tp is None else tp.size, "seed": seed}


def _acceptance(eng, kept: Partial, was: dict, ids: list[list[int]], limits: tuple[int, ...],
                new: int, eos: list[int]):
    """The chain's acceptance, then the tree's (where --max-topk > 1), each measured unless a
    stopped run of this tune kept it."""
    from draftsmith.tune import measure
    from draftsmith.tune.partial import kept_acceptance

    max_steps, max_topk, max_draft = limits
    stage, acc, mix = kept_acceptance(was, not eng.params.greedy, eng.rt.max_batch)
    if stage is None:
        console.print("measuring acceptance (chain of", max_steps, "steps) ...")
        acc, mix = measure.chain_acceptance(eng, ids, max_steps, new, eos)  # real answers
        kept.acceptance(acc, mix, "chain")
    if max_topk > 1 and stage != "tree":
        console.print(f"measuring tree acceptance (steps {max_steps}, topk {max_topk}) ...")
        acc, mix = measure.tree_acceptance(eng, ids, max_steps, max_topk, new, eos, acc, mix,
                                           max(32, max_draft))
        kept.acceptance(acc, mix, "tree", eng.rt.max_batch)
    return acc, mix


def check_topk(max_topk: int, drafter_cfg: Eagle3Config) -> None:
    """--max-topk within the drafter's draft vocabulary, before loading: the tree acceptance
    run refused it only after the target loaded and the chain's acceptance ran."""
    vocab = drafter_cfg.draft_vocab_size
    if max_topk > vocab:
        raise DraftsmithError(f"--max-topk {max_topk} exceeds the drafter's draft vocabulary of "
                              f"{vocab}: give --max-topk {vocab} or less")


def trained_depth(drafter_dir: Path) -> int | None:
    """The TTT steps the drafter was trained with (its draftsmith.json's training config), or
    None where it does not say (an imported drafter)."""
    from draftsmith.models.eagle3 import read_drafter_meta

    training = read_drafter_meta(drafter_dir).get("training")
    config = training.get("config") if isinstance(training, dict) else None
    depth = config.get("ttt_steps") if isinstance(config, dict) else None
    return depth if type(depth) is int and depth >= 1 else None


def past_training(drafter_dir: Path, max_steps: int) -> str | None:
    """A note where --max-steps sweeps drafts deeper than the drafter was trained to draft:
    allowed (they are measured as any), but their acceptance is untrained, and said so."""
    depth = trained_depth(drafter_dir)
    if depth is None or max_steps <= depth:
        return None
    return (f"note: --max-steps {max_steps} sweeps drafts past the drafter's trained depth "
            f"({depth} TTT steps, its draftsmith.json): {_steps(depth + 1, max_steps)} "
            "measured, not trained for")


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"


def check_pair_of(drafter_dir: Path, dcfg: Eagle3Config, t) -> str | None:
    """A drafter of another target's shapes refused before the target's weights load (the
    engine refused it only once they and the drafter had, as the acceptance began); the
    warning for one made for another target of these shapes (said first and in the report:
    its acceptance is this pair's, likely low), else None."""
    from draftsmith.engine.speculative import check_pair, other_target

    try:
        check_pair(t.cfg, dcfg)
    except DraftsmithError as e:
        raise DraftsmithError(f"--drafter {drafter_dir}: {e}: give the --target it was trained "
                              "for") from None
    if not (other := other_target(dcfg, t.fingerprint)):
        return None
    return f"warning: {other}: acceptance and the recommendation are this pair's, and may be low"


def plan_batch(costs, acc, batch: int, limits: tuple[int, int, int], mix=None, refilled=None,
               new: int | None = None, top: int = 3) -> tuple[list, list[SpecSetting]]:
    """(predictions, settings to sweep) at one batch: every setting within `limits` (max
    steps, topk, draft tokens) ranked, then the best `top`, their neighbours and every chain
    to sweep. A neighbour off the grid (a chain's topk-2 tree of steps + 1 tokens, a capped
    budget a step deeper) is priced too: its row read "predicted -", and where it won the
    choice had no model error."""
    from draftsmith.tune import cost_model as cm

    grid = [s for s in cm.tune_grid(*limits) if within(s, *limits)]
    ranked = cm.rank_settings(costs, acc, batch, grid, mix, refilled, new)
    chain = [cm.SpecSetting(s, 1, s + 1) for s in range(1, limits[0] + 1)]
    near = cm.sweep_plan(ranked, top, cm.tune_topks(limits[1]), cm.tune_budgets(limits[2]))
    plan = dict.fromkeys([*near, *chain])
    todo = [s for s in plan if within(s, *limits)]
    priced = {p.setting for p in ranked}
    if extra := [s for s in todo if s not in priced]:
        more = cm.rank_settings(costs, acc, batch, extra, mix, refilled, new)
        ranked = sorted([*ranked, *(p for p in more if p.setting not in priced)],
                        key=lambda p: (-p.tokens_per_s, p.setting.steps, p.setting.topk,
                                       p.setting.num_draft_tokens))
    return ranked, todo


def within(s: SpecSetting, max_steps: int, max_topk: int, max_draft: int) -> bool:
    """Whether tune's limits allow a setting: --max-draft-tokens bounds trees only, so every
    chain up to --max-steps is priced and swept."""
    return s.steps <= max_steps and s.topk <= max_topk and (
        s.topk == 1 or s.num_draft_tokens <= max_draft)


def verify_width(max_steps: int, max_topk: int, max_draft: int) -> int:
    """The most tokens one verify of the run takes: a chain's, `measure.cost_table`'s widest
    and `measure.tree_acceptance`'s tree."""
    from draftsmith.tune.measure import cost_width

    return max(cost_width(max_steps, max_topk, max_draft), 32 if max_topk > 1 else 0)


def refill_plan(new: int, batches: list[int]):
    """The refill model at the engines' default spacings (`bench --refill`'s): speculative
    cycles by `refill_every_for`, the baseline's steps by `step_spacing` of the same."""
    from draftsmith.engine.refill import step_spacing
    from draftsmith.engine.spec_refill import refill_every_for
    from draftsmith.tune.refill_model import Refill

    every = {b: refill_every_for(b) for b in batches}
    return Refill(new, every, {b: step_spacing(e, new) for b, e in every.items()})


def _from_rank0(tp, obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return box[0]


def suite(path: Path | None) -> list[str]:
    """The first user turn of each prompt: the built-in chat suite by default or by name (as
    bench's `--suite chat`), HumanEval by name, else a prompt file."""
    from draftsmith.bench.suites import CHAT_SUITE, builtin_chat
    from draftsmith.data.prompts import read_prompts

    if path is None:
        path = CHAT_SUITE
    elif str(path) == "chat":  # a file named chat here too is refused, as bench refuses it
        path = builtin_chat()
    if not (convs := read_prompts(path, flag="--prompts")):
        raise DraftsmithError(f"--prompts {path}: no conversations in it")
    return [c.first_user() for c in convs]


# what every figure of a tune run assumes, said in its report
FIXED_LENGTH = ("Priced and swept with every row decoding --max-new-tokens tokens (no stop at "
                "EOS): where answers end early, rows idle in static batches (or refill sooner), "
                "which these figures do not price")


def write_report(out: Path, acc, costs, preds, meas, recs, texts, batches, dev, tp_size: int,
                 params: SamplingParams, refill: bool = False, mix=None,
                 new: int | None = None, sweeps_nccl: bool = False,
                 machine_load: dict | None = None, failed: list | None = None) -> dict:
    """tune.json, tune.md and tune.png; `machine_load` (`bench.load`) how busy the machine was
    over the timed runs, flagged in the PNG's title where busy (the texts carry the note)."""
    from draftsmith.bench.cli import say_replaced
    from draftsmith.data.atomic import atomic_write, make_folder

    make_folder(out)
    say_replaced(out / "tune.json", say)
    drop_stale_nccl(out, sweeps_nccl)
    rows = []
    for r in recs:
        for c in r.rows:
            rows.append(
                {
                    "batch": r.batch,
                    "setting": str(c.setting),
                    "predicted_tok_s": c.predicted_tps,
                    "measured_tok_s": c.measured_tps,
                    "error_pct": c.error_pct,
                    "extrapolated": c.extrapolated,
                }
            )
    report = {
        "device": device_name(dev),
        "tp": tp_size,
        "refill": refill,
        "new_tokens": new,
        "answers": FIXED_LENGTH,
        "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                     "top_k": params.top_k},
        "acceptance": acc.to_dict(),
        # each prompt's own, in the prompts' order: what the idle rows and paces came from
        "prompt_acceptance": [] if mix is None else [a.to_dict() for a in mix.prompts],
        "prompt_tree_counts": [] if mix is None else [
            {"reached": r, "accepted": a} for r, a in mix.tree_counts],
        "costs": costs.to_dict(),
        "recommendations": [
            {
                "batch": r.batch,
                "setting": str(r.setting),
                "verify_tokens": 1 if r.setting.is_baseline else r.setting.num_draft_tokens,
                "tokens_per_s": r.tokens_per_s,
                "baseline_tok_s": r.baseline_tps,
                "speedup": r.speedup,
                "error_pct": r.error_pct,
                "cause": r.cause,
                "busy": r.busy,
                "best_measured_tok_s": best_measured(meas, r.batch),
                # the model's pick and what serving it would have lost (0: it was the best)
                "predicted_best": None if r.predicted_best is None else str(r.predicted_best),
                "predicted_best_measured_tok_s": r.predicted_best_measured_tps,
                "regret_tok_s": r.regret_tps,
                "regret_pct": r.regret_pct,
            }
            for r in recs
        ],
        "rows": rows,
        # settings the sweep could not run (out of memory, ...): the choice is the rest's best
        "failed": [{"batch": b, "setting": str(s), "error": why}
                   for b, s, why, _ in failed or ()],
        "phases": _phase_rows(preds, meas),
        "nccl": None,  # this run's NCCL sweep, where it ran one (`attach_nccl`)
        "machine_load": machine_load,
    }
    md = f"{FIXED_LENGTH}.\n\n" + "\n\n".join(f"```\n{t}\n```" for t in texts) + "\n"
    atomic_write(out / "tune.json", json.dumps(report, indent=1, default=str).encode(),
                 "the report there before is unchanged")
    atomic_write(out / "tune.md", md.encode(), "the report there before is unchanged")
    plot(out / "tune.png", plot_series(preds, meas, batches, failed or []),
         bool((machine_load or {}).get("busy")))
    return report


def plot_series(preds: list[Prediction], meas: list[Measurement], batches: list[int],
                failed: list[Failure]) -> dict[int, dict[str, dict]]:
    """tune.png's data per batch: chains and trees (`steps_series`), a setting that failed at
    a batch off its predicted curve and marked apart (the curve drew a point no sweep ran)."""
    from draftsmith.tune.cost_model import steps_series

    out = {}
    for b in batches:
        bad = {s for fb, s, _, _ in failed if fb == b}
        out[b] = {"chains": steps_series(preds, meas, b, failed=bad),
                  "trees": steps_series(preds, meas, b, topk=None, failed=bad)}
    return out


def _phase_rows(preds, meas) -> list[dict]:
    """Per measured setting: predicted and profiled ms per cycle by phase, tokens per cycle
    (row-cycle) and the share of row slots decoding, predicted and measured, and the engine's
    own cycle time: where the model and the engine part ways."""
    pred = {(p.batch, p.setting): p for p in preds}
    out = []
    for m in meas:
        p = pred.get((m.batch, m.setting))
        row = {"batch": m.batch, "setting": str(m.setting),
               "measured_phases_ms": dict(m.phases or {}), "measured_accept": m.accept_length,
               "predicted_phases_ms": dict(p.phases) if p else None,
               "predicted_tokens_per_cycle": p.tokens_per_cycle if p else None,
               "predicted_cycle_ms": p.cycle_ms if p else None,
               "predicted_busy": p.busy if p else None, "measured_busy": m.busy,
               "predicted_kept": p.kept if p else None}
        if m.cycle_ms is not None:
            row["measured_cycle_ms"] = m.cycle_ms
        out.append(row)
    return out


def best_measured(meas, batch: int) -> float | None:
    vals = [m.tokens_per_s for m in meas if m.batch == batch]
    return max(vals) if vals else None


def device_name(dev: str) -> str:
    import torch

    return torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"


def _plot_label(kind: str, name: str) -> str:
    if name == "failed":
        return f"{kind} failed in the sweep (predicted, not run)"
    return f"{kind} {name}" + (" (best topk and budget)" if kind == "trees" else "")


def plot(path: Path, series: dict, busy: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
    # failed settings as bare crosses, no line: no measured point to set them against
    styles = {("chains", "predicted"): ("--o", "C0"), ("chains", "measured"): ("-s", "C0"),
              ("trees", "predicted"): ("--^", "C1"), ("trees", "measured"): ("-D", "C1"),
              ("chains", "failed"): ("x", "C3"), ("trees", "failed"): ("X", "C3")}
    for ax, (b, kinds) in zip(axes[0], series.items(), strict=True):
        for (kind, name), (style, color) in styles.items():
            # trees past the baseline only: steps 0 is the chains' point too
            pts = [p for p in sorted(kinds.get(kind, {}).get(name, []))
                   if kind == "chains" or p[0] > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                        label=_plot_label(kind, name))
        ax.set_title(f"batch {b} (steps 0 = no speculation)")
        ax.set_xlabel("draft steps (tree depth)")
        ax.set_ylabel("tokens/s")
        ax.legend()
    if busy:  # a plot shared alone says it too
        fig.suptitle("BUSY MACHINE while timing: tokens/s skewed (see tune.md)", color="C3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune_nccl(
    tp: int = typer.Option(2, "--tp", help="Tensor-parallel size (ranks spawned per setting)"),
    target: str = typer.Option(
        None, "--target",
        help="default, random-8b (Llama-3-8B shape, random weights: timing only; the default on "
             "CUDA), tiny (a small random Llama; the default on CPU, where gloo makes the sweep "
             "a smoke test) or a path"),
    grid: str = typer.Option("full", "--grid", help="full (14 settings) or quick (6)"),
    batch_sizes: str = typer.Option("1,8", "--batch-sizes", "--batch-size",
                                    help="Batch sizes, comma-separated"),
    tokens: str = typer.Option("1,4,8", "--tokens", help="Verify widths to time"),
    iters: int = typer.Option(20, "--iters", help="Timed forwards per repeat (3 repeats)"),
    noise_pct: float = typer.Option(3.0, "--noise-pct",
                                    help="Least gain over defaults that counts"),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds per setting"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    out: Path = typer.Option(Path("runs/tune_nccl"), "--out", "-o",
                             help="Folder for nccl.json, nccl.md"),
) -> None:
    """Sweep NCCL protocol/algorithm/P2P level under TP, each in fresh processes (NVLS off)."""
    from draftsmith.cli import dtype_name, dtype_of
    from draftsmith.tune import nccl

    if tp == 1:  # every setting timed in fresh processes, for a note that none can matter
        raise DraftsmithError("--tp 1 runs no collective, so NCCL settings do not apply: give "
                              "--tp 2 or more")
    dev = sweep_device(device, tp)
    dt = nccl.dtype_key(dtype_of(dtype_name(dev, dtype)))
    target = target or sweep_target(dev)
    if target == "random-8b" and not dev.startswith("cuda"):
        raise DraftsmithError("--target random-8b on cpu: 8B random parameters over the ranks "
                              "take minutes a setting there, past its --timeout, and gloo takes "
                              "no NCCL setting; give --target tiny (a smoke test) or run on CUDA")
    shapes = [(b, n) for b in int_list(batch_sizes, "--batch-sizes")
              for n in int_list(tokens, "--tokens")]
    report = nccl.run_nccl_sweep(tp, target, nccl.grid(grid), shapes, dev, dt, iters, noise_pct,
                                 timeout, out,
                                 log=say)
    nccl.print_report(report)
    say(f"wrote {out}/nccl.json, nccl.md")


def sweep_device(device: str, tp: int) -> str:
    """tune-nccl's --device (checked as parsed, `options.checked_device`): auto is cuda where
    there is a GPU a rank, else cpu, said where a GPU host lacks enough of them (it went to a
    gloo smoke test without a word)."""
    import torch

    if device != "auto":
        return device
    if (n := torch.cuda.device_count()) >= tp:
        return "cuda"
    if n:
        console.print(f"tune-nccl: {n} CUDA device(s) here, --tp {tp} needs {tp}: sweeping on "
                      "cpu (gloo, a smoke test); give --tp at most the GPU count", markup=False)
    return "cpu"


def sweep_target(dev: str) -> str:
    """tune-nccl's target where none is given: random-8b on CUDA; on CPU, where gloo takes no
    NCCL setting, the tiny one (an 8B forward there takes about a second a rank: a setting's
    hundreds of them would pass its --timeout, and every setting fail)."""
    if dev.startswith("cuda"):
        return "random-8b"
    console.print("tune-nccl on cpu: timing the tiny random target (random-8b is for GPUs); "
                  "give --target for another", markup=False)
    return "tiny"
