"""`run_doctor(DoctorOptions) -> Report`: every check the doctor makes, in order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.data.progress import stderr_line
from draftsmith.doctor import behaviour, checks, verdict, wiring
from draftsmith.doctor.artifacts import DrafterInfo, load_noted, read_checked
from draftsmith.doctor.engines import engine_name
from draftsmith.doctor.report import Finding, Report
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS
from draftsmith.options import at_least_one

if TYPE_CHECKING:
    from draftsmith.data.progress import Progress

PROMPT_LEN = 512  # the longest data prompt the speculative run takes
MAX_STEPS = 5  # draft steps a run takes by default, however many positions the log records
NO_LOG_STEPS = 3  # draft steps without a log to take them from
LATER_S = 3.0  # a phase said only once it has run this long (a tiny target's is over by then)
MANIFEST, DRAFTER_CONFIG = "the data manifest", "the drafter config"  # where a target is recorded


@dataclass
class DoctorOptions:
    data: Path | None = None
    drafter: Path | None = None
    target: str | None = None
    engine: str | None = None
    samples: int = 4
    max_tokens: int = 256
    all_tokens: bool = False
    run: bool = True
    prompts: int = 4
    max_new: int = 32
    steps: int | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    full_verify: bool = False  # hash every shard, not only those samples are read from
    progress: bool = False  # the long phases said on stderr (stdout may carry --json)
    prompts_flag: str = "--prompts"  # the flag that gave `prompts`, as messages name it

    def __post_init__(self) -> None:
        from draftsmith.tune.cost_model import DEEPEST  # serve's and tune's deepest draft

        if self.data is None and self.drafter is None:
            raise DraftsmithError("give --data DIR and/or --drafter DIR to examine")
        if self.engine:
            self.engine = engine_name(self.engine)
        at_least_one({"--samples": self.samples, "--max-tokens": self.max_tokens,
                      self.prompts_flag: self.prompts, "--max-new-tokens": self.max_new})
        if self.steps is not None and self.steps < 1:
            raise DraftsmithError(f"--steps must be >= 1 (not given: from the training log), "
                                  f"got {self.steps}")
        if self.steps is not None and self.steps > DEEPEST:
            raise DraftsmithError(f"--steps must be at most {DEEPEST}, got {self.steps}")


def resolve_target(opts: DoctorOptions, manifest: dict | None,
                   info: DrafterInfo | None) -> tuple[Any, str]:
    from draftsmith.targets import load_target
    from draftsmith.train.sources import target_of_dataset

    if opts.target:
        return load_target(opts.target), "--target"
    if manifest is not None and (manifest.get("target") or {}).get("source"):
        return load_recorded_target(target_of_dataset(manifest), MANIFEST), MANIFEST
    src = drafter_target(info) if info is not None else None
    if src:
        return load_recorded_target(src, DRAFTER_CONFIG), DRAFTER_CONFIG
    raise DraftsmithError("no target known: pass --target PATH (or 'default')")


def load_recorded_target(src: str, how: str) -> Any:
    """The target `how` records: one moved or deleted since is named as that, with the fix. A
    relative path is relative to where the capture or training ran (a manifest never records a
    hub id: capture loads local targets only)."""
    from draftsmith.train.sources import load_recorded

    relative = not Path(src).is_absolute()
    if how == MANIFEST:
        hint = "a path relative to where the capture ran" if relative else "another machine's"
    else:
        hint = "a path relative to where the drafter was made, or a hub id" if relative else \
            "a hub id"
    return load_recorded(src, how, hint)


def drafter_target(info: DrafterInfo) -> str | None:
    """The target the drafter's config records: the embedded default by any of its names
    (`targets.is_default`: a conversion cache folder of it too, here or not); a foreign
    verifier name only where it is a path here (often a hub id), what draftsmith recorded even
    where gone (load_recorded says so)."""
    from draftsmith.targets import is_default

    c = info.config
    verifier = (c.get("speculators_config") or {}).get("verifier")
    verifier = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    own = c.get("target_source") if info.layout == "draftsmith" else info.recorded("target")
    src = str(own or verifier or "") or None
    if src and is_default(src):  # a default's conversion cache folder too, even cleared
        return "default"
    return src if own or (src and Path(src).exists()) else None


def run_doctor(opts: DoctorOptions) -> Report:
    rep = Report()
    ds = _dataset(opts.data) if opts.data is not None else None
    manifest = ds.manifest if ds is not None else None
    info = read_checked(opts.drafter) if opts.drafter is not None else None
    target, how = resolve_target(opts, manifest, info)
    rep.context = _context(opts, target, how, ds, info)
    # only the live match and the run need the model: a config check builds no fp32 copy of
    # the target's weights (32 GB of an 8B target on the CPU)
    needed = ds is not None or (info is not None and opts.run)
    model = target.build(opts.dtype, opts.device) if needed else None
    prompts, scanned = (behaviour.data_prompts(ds, opts.prompts, PROMPT_LEN)
                        if ds is not None and info is not None and opts.run else ([], 0))
    true_ids = _data_checks(rep, opts, target, model, ds, scanned) if ds is not None else None
    rep.add("sizes", checks.sizes(target, manifest, opts.data, info,
                                  true_ids or (ds.aux_layer_ids if ds else None)))
    layers = target.cfg.num_layers
    if info is not None:
        _drafter_checks(rep, opts, target, info, true_ids)
    ids = true_ids or (info.canonical_ids() or info.exported_ids(layers) if info else None)
    if ids:
        where = str(opts.data or opts.drafter)
        rep.add("capturable", checks.capturable(ids, layers, _capture_engine(opts, info),
                                                where))
        rep.context["true_aux_layer_ids"] = true_ids
        rep.context["in_each_convention"] = verdict.conventions(ids, layers)
    elif (fed := _vllm_fed(opts, info, layers)) is not None:
        rep.add("capturable", checks.capturable(fed, layers, "vllm", str(opts.drafter)))
    rep.engines = verdict.engine_rows(true_ids, info, layers)
    if info is not None:
        _behaviour(rep, opts, target, model, info, prompts, true_ids)
    return rep


def _capture_engine(opts: DoctorOptions, info: DrafterInfo | None) -> str | None:
    """The engine whose capture limits apply: --engine, else vLLM for a speculators folder,
    which only vLLM serves (SGLang's hook limits would be beside the point there)."""
    if opts.engine is None and info is not None and info.layout == "speculators":
        return "vllm"
    return opts.engine


def _vllm_fed(opts: DoctorOptions, info: DrafterInfo | None, layers: int) -> list[int] | None:
    """The layers vLLM feeds a foreign folder (no ids recorded by an export) that vLLM serves:
    its written ids, which may name the embedding (0) or the last layer's output (L)."""
    if info is None or info.layout == "draftsmith" or _capture_engine(opts, info) != "vllm":
        return None
    return verdict.drafter_feed(info, "vllm", layers).canonical


def read_shards(ds: Any, samples: int, scanned: int) -> list[int]:
    """Positions of the shards the doctor reads samples from: the wiring's spread samples and
    the first `scanned`, which the run's prompts come from."""
    shards = {ds.locate(i)[0] for i in wiring.pick_samples(len(ds), samples)}
    if scanned:
        shards |= set(range(ds.locate(scanned - 1)[0] + 1))
    return sorted(shards)


def _checked(ds: Any, hashed: list[int] | None) -> str:
    n = len(ds.shards)
    if hashed is None or len(hashed) == n:
        return f"size, shapes, dtypes and sha256 of all {n} shards"
    names = [ds.shards[k]["file"] for k in hashed[:8]] + (
        [f"{len(hashed) - 8} more"] if len(hashed) > 8 else [])
    return (f"size, shapes and dtypes of all {n} shards; sha256 of the {len(hashed)} it reads "
            f"samples from ({', '.join(names)}); --full-verify hashes all")


def _dataset(folder: Path) -> Any:
    from draftsmith.data.shards import MANIFEST, Dataset

    if not (folder / MANIFEST).is_file() and any(folder.glob(f"rank-*/{MANIFEST}")):
        raise DraftsmithError(
            f"{folder}: a multi-rank capture whose ranks are not merged: run `draftsmith data "
            f"merge {folder}` once every rank has finished, or pass --data {folder}/rank-R")
    if not (folder / MANIFEST).is_file():
        _refuse_model_folder(folder)
    return Dataset(folder)


def _refuse_model_folder(folder: Path) -> None:
    """A drafter's or model's folder given as --data named as one ("no manifest.json" named no
    way on): the flags were swapped."""
    from draftsmith.models.eagle3 import CONFIG_FILE

    if (folder / CONFIG_FILE).is_file():
        raise DraftsmithError(f"{folder}: a drafter folder ({CONFIG_FILE}), not a dataset; pass "
                              "it as --drafter, and the data it was trained on as --data")
    if (folder / "config.json").is_file():
        raise DraftsmithError(f"{folder}: a model folder (config.json), not a dataset; pass a "
                              "target as --target, an exported drafter as --drafter, and a "
                              "dataset (manifest.json) as --data")


def _context(opts: DoctorOptions, target: Any, how: str, ds: Any,
             info: DrafterInfo | None) -> dict[str, Any]:
    ctx: dict[str, Any] = {
        "target": {"source": target.source, "from": how, "fingerprint": target.fingerprint,
                   "layers": target.cfg.num_layers, "hidden_size": target.cfg.hidden_size},
        "engine": opts.engine, "convention": CANONICAL_WORDS,
    }
    if ds is not None:
        ctx["data"] = {"folder": str(opts.data), "samples": len(ds),
                       "aux_layer_ids (manifest)": ds.aux_layer_ids}
    if info is not None:
        ctx["drafter"] = {"folder": str(info.folder), "layout": info.layout}
        if info.layout == "draftsmith":
            ctx["drafter"]["aux_layer_ids (canonical)"] = info.canonical_ids()
        if (recorded := info.exported_ids(target.cfg.num_layers)) is not None:
            ctx["drafter"]["aux_layer_ids (canonical, recorded at export)"] = recorded
        for engine in ("sglang", "vllm"):
            written, key, _ = info.written(engine)
            if info.layout != "draftsmith" and written is not None:
                ctx["drafter"][key] = written
    return ctx


def _data_checks(rep: Report, opts: DoctorOptions, target: Any, model: Any,
                 ds: Any, scanned: int) -> list[int] | None:
    hashed = None if opts.full_verify else read_shards(ds, opts.samples, scanned)
    rep.context["data"]["checked"] = _checked(ds, hashed)
    rep.add("shards", checks.data_files(opts.data, ds.manifest, hashed))
    rep.add("target", checks.target_identity(target, ds.manifest, opts.data, None,
                                             rep.context["target"]["from"] == MANIFEST))
    if len(ds) == 0:
        rep.skipped.append("wiring: the dataset has no samples")
        return None
    from safetensors import SafetensorError

    picked = len(wiring.pick_samples(len(ds), opts.samples))
    line = (f"comparing the stored states of {_n(picked, 'sample')} with a live forward of the "
            "target (--data)")
    try:
        with said_after(line, opts.progress):  # minutes of an 8B target on a CPU
            mm = wiring.match(model, ds, target.cfg.num_layers, opts.samples, opts.max_tokens,
                              not opts.all_tokens, _first_ids(target), _lead_ids(target))
    except (DraftsmithError, RuntimeError, ValueError, IndexError, SafetensorError) as e:
        rep.add("wiring: data", [Finding("error", "wiring", f"cannot compare the stored states "
                                         f"with the live target: {e}", str(opts.data),
                                         "fix the shard findings; check --target")])
        return None
    rep.wiring = mm.to_dict()
    rep.add("wiring: data", verdict.data_findings(mm, opts.data))
    if picked < opts.samples:
        rep.findings.append(_fewer_samples(picked, opts))
    true = mm.true_ids()
    return None if None in true else [int(i) for i in true]  # type: ignore[misc]


def _first_ids(target: Any) -> tuple[int, ...]:
    """Tokens a sample may begin with: the BOS, the chat template's first (the one a shard whose
    ids run a token ahead of its states dropped)."""
    ids = [target.cfg.bos_token_id]
    with suppress(DraftsmithError):  # a base model: no template
        ids += target.chat_ids([{"role": "user", "content": "x"}])[:1]
    return tuple(int(i) for i in ids if i is not None)


def _lead_ids(target: Any) -> tuple[int, ...]:
    """The chat template's opening, what every templated sample begins with: the tokens a shard
    whose ids run k tokens ahead of its states dropped are its first k."""
    try:
        a, b = (target.chat_ids([{"role": "user", "content": c}]) for c in ("x", "y"))
    except DraftsmithError:  # a base model: no template
        return ()
    n = next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q), 0)
    return tuple(int(i) for i in a[:n])


def _drafter_checks(rep: Report, opts: DoctorOptions, target: Any, info: DrafterInfo,
                    true_ids: list[int] | None) -> None:
    layers = target.cfg.num_layers
    taken = rep.context["target"]["from"] == DRAFTER_CONFIG
    rep.add("target" if opts.data is None else "target: drafter",
            checks.target_identity(target, None, None, info, taken))
    rep.add("vocab", checks.draft_vocab(info, target.cfg.vocab_size, opts.data))
    rep.add("positions", checks.positions(target, info))
    rep.add("wiring: drafter vs its training data", checks.training_ids(info))
    engines = verdict.default_engines(info, opts.engine)
    rep.context["checked_engines"] = engines
    ref, basis = true_ids, verdict.DATA
    if ref is None and (recorded := info.exported_ids(layers)):  # the seed's edit, no --data
        ref, basis = recorded, "config.json's draftsmith section records it was trained on"
    other = (verdict.other_training_data(info, opts.data, true_ids)
             if opts.data is not None and true_ids is not None else None)
    rep.add("wiring: drafter", [other] if other else
            verdict.drafter_findings(ref, info, engines, layers, basis))


def _behaviour(rep: Report, opts: DoctorOptions, target: Any, model: Any, info: DrafterInfo,
               prompts: list[list[int]], true_ids: list[int] | None) -> None:
    if not opts.run:
        rep.skipped.append("behaviour: --no-run")
        return
    try:
        drafter, notes = _load(info, target, opts)
    except ImportError as e:
        rep.skipped.append(f"behaviour: cannot load the drafter ({e})")
        return
    except DraftsmithError as e:  # what an engine loading it would meet too
        other = any(f.check == "sizes" for f in rep.errors())  # another target's shapes
        rep.add("behaviour", [_unloadable(e, info, other)])
        return
    rep.add("loads", notes)
    try:
        promise, unread = behaviour.promised(info.folder), None
    except DraftsmithError as e:  # a damaged log loses the comparison, not the whole report
        promise, unread = None, e
        rep.add("behaviour", [Finding("warning", "behaviour", f"the run is not compared with "
                                      f"training: {e}", str(info.folder), "repair or remove "
                                      "that line of the training log")])
    steps, why_steps = draft_steps(opts.steps, promise)
    source = "data" if prompts else "built-in, target chat template"
    prompts = prompts or behaviour.template_prompts(target, opts.prompts)
    if len(prompts) < opts.prompts:
        rep.findings.append(_fewer_prompts(len(prompts), opts, source == "data"))
    runs = _runs(info, opts.engine, target.cfg.num_layers, len(drafter.cfg.aux_layer_ids),
                 true_ids)
    if not runs:
        rep.skipped.append("behaviour: no aux layer set of the drafter's width to feed")
        return
    out = {"prompts": source, "promised": promise, "runs": {}, "draft_steps": steps,
           "draft_steps_why": why_steps}
    bar = _run_progress(opts, len(prompts), len(runs))
    done = None if bar is None else partial(bar.update, 1)
    try:
        for label, ids in runs.items():
            try:
                out["runs"][label] = behaviour.spec_run(model, drafter, prompts, steps,
                                                        opts.max_new, target.eos_ids, ids, done)
            except DraftsmithError as e:  # e.g. ids the target lacks: a wiring finding says so
                rep.skipped.append(f"behaviour: the run {label}: {e}")
    finally:
        if bar is not None:
            bar.close()
    if not out["runs"]:
        return
    rep.behaviour = out
    if unread is not None:  # said above
        return
    if promise is None:  # `export` copies no log: nothing to hold the run against
        from draftsmith.train.report import LOG

        rep.skipped.append(f"behaviour: the run against training: {info.folder} holds no {LOG} "
                           "with per-position accuracy (an exported folder carries none); run "
                           "the doctor on the drafter `draftsmith train` wrote to compare")
        return
    first = next(iter(out["runs"].values()))
    rep.add("behaviour", behaviour.gap_findings(
        out["runs"], promise, str(info.folder), _wired(rep, first, true_ids), why_steps))


def say(line: str) -> None:
    """A progress line on stderr (stdout is the report's, or --json's)."""
    stderr_line(f"doctor: {line}")


@contextmanager
def said_after(line: str, shown: bool) -> Iterator[None]:
    """`line` said where the phase inside runs past `LATER_S` seconds (and `shown`)."""
    timer = threading.Timer(LATER_S, say, [line]) if shown else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def _run_progress(opts: DoctorOptions, prompts: int, sets: int) -> Progress | None:
    """The short run said before it starts, then shown per prompt: a bar on a terminal, a line
    a prompt off one (`data.progress.Progress`); None without `opts.progress`."""
    from draftsmith.data.progress import Progress

    if not opts.progress:
        return None
    say(f"short speculative run: {_n(prompts, 'prompt')} x {opts.max_new} new tokens, "
        f"{_n(sets, 'layer set')} (--no-run skips it)")
    return Progress(prompts * sets, 0, "prompt", "doctor", True,
                    stderr_line, every=0.0)


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'s' if k != 1 else ''}"


def draft_steps(given: int | None, promise: dict[str, Any] | None) -> tuple[int, str]:
    """The run's draft steps, and why that many: from the log, only the positions it measured
    (a None in `cond_acc` is a position no chain reached, which promises nothing)."""
    from draftsmith.train.objective import measured

    cond = promise["cond_acc"] if promise else []
    n, m = len(cond), measured(cond)
    logged = (f"the log records {n} positions" if m == n else
              f"the log measured {_span(m)} of {n}, no chain reached position {m}"
              if m else f"the log measured none of its {n} positions, no chain reached one")
    if given is not None:
        covers = "the promise covers those" if m else "it promises nothing"
        beyond = f" ({logged}: {covers})" if n > 0 and m < given else ""
        return given, f"--steps {given}{beyond}"
    if promise is None:
        return NO_LOG_STEPS, f"{NO_LOG_STEPS} by default, no training log to take them from"
    if m == 0:
        return NO_LOG_STEPS, f"{NO_LOG_STEPS} by default: {logged}"
    if m > MAX_STEPS:
        return MAX_STEPS, (f"{logged}, a run drafts at most {MAX_STEPS} unless --steps "
                           f"(--steps {m} drafts them all)")
    return m, f"the {n} positions the log records" if m == n else logged


def _span(m: int) -> str:
    return "position 0" if m == 1 else f"positions 0..{m - 1}"


def _wired(rep: Report, run: dict[str, Any], true_ids: list[int] | None) -> bool:
    """The live match named the data's layers, the run fed the drafter those, and no check
    before it failed (wiring, sizes, vocab, target): a behaviour gap then is the drafter's own."""
    return (true_ids is not None and list(run["aux_layer_ids"]) == list(true_ids)
            and not rep.errors())


def _unloadable(e: DraftsmithError, info: DrafterInfo, other_target: bool = False) -> Finding:
    """The drafter does not load: ids it cannot be fed (the wiring findings name the right
    ones) are no weights/config mismatch, nor is the embedding of a target the sizes findings
    say is not the drafter's (`other_target`)."""
    ids = "layer_ids" in str(e)
    fix = ("pass the drafter's own target with --target, as the sizes findings above say"
           if other_target else "write aux layer ids this target has, as the wiring findings "
           "above say" if ids else "its weights and config.json must agree: re-export or "
           "retrain it")
    return Finding("error", "loads", f"the drafter does not load: {e}", str(info.folder), fix)


def _fewer_samples(n: int, opts: DoctorOptions) -> Finding:
    """--samples past the dataset's count: all it holds were compared, said as --num-prompts
    past the data's prompts is (`_fewer_prompts`), not fewer silently."""
    return Finding("info", "wiring", f"the live match compared {_n(n, 'sample')}, not the "
                   f"{opts.samples} --samples asks for: the dataset holds {n}", str(opts.data),
                   f"pass --samples {n} or fewer, or data with more samples")


def _fewer_prompts(n: int, opts: DoctorOptions, from_data: bool) -> Finding:
    """The run's prompts fall short of --prompts: say so, not run fewer silently."""
    if from_data:
        why = (f"the data's first samples hold {n} prompts of at most {PROMPT_LEN} tokens "
               f"(up to {behaviour.PROMPT_SCAN} samples read a prompt)")
        where, fix = str(opts.data), "pass a dataset with more such prompts"
    else:
        why = f"the built-in set holds {len(behaviour.PROMPTS)}"
        if opts.data is not None:
            why += f" (the data's first samples hold no prompt of at most {PROMPT_LEN} tokens)"
        where, fix = opts.prompts_flag, "pass --data with the data's own prompts"
    return Finding("info", "behaviour", f"the speculative run took {n} prompts, not the "
                   f"{opts.prompts} {opts.prompts_flag} asks for: {why}", where, fix)


def _load(info: DrafterInfo, target: Any, opts: DoctorOptions) -> tuple[Any, list[Finding]]:
    """The drafter as `draftsmith import` reads it, and what that reading warned as findings."""
    drafter, notes = load_noted(info, target, opts.device, opts.dtype)
    return drafter, [Finding("warning", "loads", str(n), str(info.folder), n.fix) for n in notes]


def _runs(info: DrafterInfo, engine: str | None, layers: int, n_aux: int,
          true_ids: list[int] | None) -> dict[str, list[int]]:
    """Aux layer sets to run the drafter with: as configured / as each engine feeds it, and
    with the layers the data really holds (each set once)."""
    runs: dict[str, list[int]] = {}

    def add(label: str, ids: list[int] | None) -> None:
        if ids and len(ids) == n_aux and list(ids) not in runs.values():
            runs[label] = list(ids)

    if info.layout == "draftsmith":
        add("as configured", info.canonical_ids())
    for e in verdict.default_engines(info, engine):
        add(f"as {e} feeds it", verdict.drafter_feed(info, e, layers).canonical)
    add("with the data's layers", true_ids)
    add("with the layers recorded at export", info.exported_ids(layers))
    return runs
