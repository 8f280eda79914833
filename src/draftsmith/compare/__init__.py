"""`draftsmith compare A B`: drafters side by side — architecture, parameter counts by
convention, training data, and (with a target) acceptance and speed on the same prompts."""

from __future__ import annotations

import json
import os
import string
import sys
from dataclasses import dataclass, field, fields
from datetime import date
from pathlib import Path
from typing import Any

import torch
import typer

from draftsmith.compare.describe import Description, describe
from draftsmith.compare.params import CONVENTIONS, human, likely_convention, parse_number
from draftsmith.compare.speed import Interrupted
from draftsmith.doctor.artifacts import read_checked
from draftsmith.errors import DraftsmithError
from draftsmith.options import DEVICE, DTYPE, at_least_one, check_folder

__all__ = ["CompareOptions", "compare", "run_compare"]


ACCEPTANCE_FLAGS = {"prompts": "--prompts", "num_prompts": "--num-prompts",
                    "max_new": "--max-new-tokens", "steps": "--steps", "topk": "--topk",
                    "num_draft_tokens": "--num-draft-tokens"}


@dataclass
class CompareOptions:
    drafters: list[str]
    target: str | None = None
    prompts: str = "chat"  # a bench suite: chat, humaneval or a prompts file
    num_prompts: int = 8
    max_new: int = 64
    steps: int = 4
    out: Path | None = None
    claimed: dict[str, float] = field(default_factory=dict)  # label or A/B/... -> count
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    topk: int = 1  # > 1: an EAGLE-2 tree of num_draft_tokens, as the engines draft
    num_draft_tokens: int | None = None
    recorded: bool = False  # the target is the one every drafter records, not --target's
    typed: list[str] | None = None  # the acceptance flags the CLI saw typed (None: by value)

    def __post_init__(self) -> None:
        if len(self.drafters) < 2:
            raise DraftsmithError("compare needs at least two drafter folders")
        if len(self.drafters) > len(string.ascii_uppercase):
            raise DraftsmithError("compare takes at most 26 drafters")
        from draftsmith.serve.cli import check_drafting  # by flag, the tree's size too

        at_least_one({"--num-prompts": self.num_prompts, "--max-new-tokens": self.max_new,
                      "--steps": self.steps, "--topk": self.topk})
        check_drafting(self.steps, self.topk, self.num_draft_tokens)
        if self.target is None:
            self._check_no_acceptance_flags()
        if self.out is not None:
            check_folder(self.out, "--out")

    def _check_no_acceptance_flags(self) -> None:
        """Without --target an acceptance flag measures on the target every drafter records
        (as export and doctor take it); where they record none or differ, it is refused, not
        ignored."""
        given = self.typed if self.typed is not None else acceptance_asked(
            **{name: getattr(self, name) for name in ACCEPTANCE_FLAGS})
        if not given:
            return
        src, why = recorded_target(self.drafters)
        if src is None:  # a folder not there: `describe` names it, once this is put right
            fix = f"{why}; give --target" if why else "give one"
            raise DraftsmithError(f"{', '.join(given)} set how acceptance is measured, which "
                                  f"needs --target: {fix}, or leave them out")
        self.target, self.recorded = src, True


def acceptance_asked(**values: Any) -> list[str]:
    """The acceptance flags given (off their defaults), by flag."""
    defaults = {f.name: f.default for f in fields(CompareOptions)}
    return [ACCEPTANCE_FLAGS[name] for name, v in values.items() if v != defaults[name]]


def recorded_target(folders: list[str]) -> tuple[str | None, str]:
    """(the target every drafter records, None where they record none or differ; why not, ""
    where a folder cannot be read): "default" for the embedded default by any of its names
    (`targets.is_default`)."""
    from draftsmith.doctor.artifacts import read_drafter
    from draftsmith.doctor.run import drafter_target

    names, seen = labels(folders), {}
    for folder, name in zip(folders, names, strict=True):
        try:
            src = drafter_target(read_drafter(folder))
        except DraftsmithError:
            if Path(folder).is_dir():  # a damaged folder: its own error, not "give --target"
                raise
            return None, ""
        if src is None:
            return None, f"drafter {name} records no target"
        seen.setdefault(_same_key(src), (name, src))
    if len(seen) > 1:
        return None, "the drafters record different targets (" + ", ".join(
            f"{n}: {s}" for n, s in seen.values()) + ")"
    return next(iter(seen.values()))[1], ""


def _same_key(src: str) -> str:
    """One key for one target: a folder or file by where it resolves."""
    return src if src == "default" or not Path(src).exists() else str(Path(src).resolve())


def labels(folders: list[str]) -> list[str]:
    names = [Path(f).resolve().name or str(f) for f in folders]
    if len(set(names)) == len(names):
        return names
    return [f"{string.ascii_uppercase[i]}:{n}" for i, n in enumerate(names)]


def parse_claims(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    given: dict[str, str] = {}  # name -> the item that gave it
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise DraftsmithError(f"--claimed {item!r}: expected NAME=COUNT, e.g. B=1e9")
        try:
            count = parse_number(value)
        except DraftsmithError as e:
            raise DraftsmithError(f"--claimed {item!r}: {e}") from None
        if count <= 0:
            raise DraftsmithError(f"--claimed {item!r}: a parameter count must be > 0")
        if (name := name.strip()) in given:
            raise DraftsmithError(f"--claimed {name} given twice ({given[name]!r}, {item!r}): give "
                                  "one count a drafter")
        given[name], out[name] = item, count
    return out


def claimed_drafters(names: list[str], claimed: dict[str, float]) -> dict[str, int]:
    """Each --claimed name -> the index of the drafter it names, by letter (A, B, ...) or label;
    one naming no drafter, or two naming one, refused (the labels known before any loading)."""
    # a folder's own name (the tables' headers) wins over a letter: folders B, A -> B is B
    by_name = {string.ascii_uppercase[i]: i for i in range(len(names))} | {
        n: i for i, n in enumerate(names)}
    out: dict[str, int] = {}
    named: dict[int, str] = {}  # drafter index -> the name that claimed it
    for name in claimed:
        if name not in by_name:
            raise DraftsmithError(f"--claimed {name}=...: no drafter called {name!r} "
                                  f"(use A, B, ... or one of {names})")
        i = by_name[name]
        if i in named:
            raise DraftsmithError(f"--claimed {named[i]}=... and --claimed {name}=... both "
                                  f"name drafter {names[i]}: give one count a drafter")
        named[i], out[name] = name, i
    return out


def claims(descs: list[Description], claimed: dict[str, float]) -> list[str]:
    lines = []
    for name, i in claimed_drafters([d.label for d in descs], claimed).items():
        d, value = descs[i], claimed[name]
        conv, n, gap = likely_convention(value, d.params)
        lines.append(f"{d.label}'s published {human(value)} most likely counts `{conv}` "
                     f"({CONVENTIONS[conv]}): {human(n)} here ({gap:+.0%})")
    for d in descs:
        p = d.params
        lines.append(f"{d.label}: {human(p.all)} counting everything, {human(p.trainable)} "
                     f"without the frozen embedding, {human(p.core)} without embedding and "
                     f"lm_head; published counts use any of these")
    return lines


def differences(descs: list[Description]) -> list[str]:
    first, notes = descs[0], _same_folders(descs)
    for d in descs[1:]:
        keys = [k for k in first.arch if k != "layout" and first.arch[k] != d.arch.get(k)]
        if keys:
            notes.append(f"{first.label} vs {d.label}: architecture differs in " + ", ".join(
                f"{k} ({first.arch[k]} vs {d.arch.get(k)})" for k in keys))
        else:
            notes.append(f"{first.label} and {d.label} have the same architecture")
        notes += _data_ratio(first, d)
    # each later drafter against every earlier one, not the first alone: with A recording no
    # target, B and C of different targets were never set side by side
    notes += [f"{d.label}: which target layers it reads is unknown here (see its aux ids "
              "note), so its layers are not compared" for d in descs if d.ids_canonical is None]
    for pair in (_ids_differ, _targets_differ, _vocab_differs):
        notes += _first_pair(descs, pair)
    return notes


def _first_pair(descs: list[Description], pair: Any) -> list[str]:
    """`pair`'s note for each drafter and the first earlier one it finds a difference with."""
    notes = []
    for j, later in enumerate(descs[1:], 1):
        for earlier in descs[:j]:
            if found := pair(earlier, later):
                notes += found
                break
    return notes


def _ids_differ(a: Description, b: Description) -> list[str]:
    if a.ids_canonical is None or b.ids_canonical is None or a.ids_canonical == b.ids_canonical:
        return []
    return [f"{a.label} and {b.label} read different target layers: {a.ids_canonical} vs "
            f"{b.ids_canonical} (canonical)"]


def _same_folders(descs: list[Description]) -> list[str]:
    seen: dict[Path, str] = {}
    notes = []
    for d in descs:
        where = d.info.folder.resolve()
        if where in seen:
            notes.append(f"{seen[where]} and {d.label} are the same folder ({where}): their "
                         "figures differ by measurement noise alone")
        seen.setdefault(where, d.label)
    return notes


TARGET_FACTS = {"target_fingerprint": "fingerprints", "vocab_size (target)": "target vocab",
                "target_hidden_size": "target hidden size", "target_num_layers": "target layers"}


def _target_fact(d: Description, key: str) -> Any:
    if key == "target_num_layers":  # a folder without draftsmith's record: its verifier's
        return _recorded_layers(d)
    return d.arch.get(key) if key in d.arch else d.info.recorded(key)


def _targets_differ(a: Description, b: Description) -> list[str]:
    """Every recorded fact of the target that differs: a fingerprint, and the sizes no drafter
    of one target can differ in (external folders record no fingerprint)."""
    facts = [f"{words} {fa} vs {fb}" for key, words in TARGET_FACTS.items()
             if (fa := _target_fact(a, key)) and (fb := _target_fact(b, key)) and fa != fb]
    if not facts:
        return []
    return [f"{a.label} and {b.label} were trained for different targets ({', '.join(facts)}): "
            "no one target measures both as trained"]


def _vocab_differs(a: Description, b: Description) -> list[str]:
    """Draft vocabs of one size over other tokens: the architecture alone calls them alike."""
    ua, ub = (_draft_tokens(x) for x in (a, b))
    if ua is None or ub is None or len(ua) != len(ub) or ua == ub:
        return []
    return [f"{a.label} and {b.label} draft over different tokens: {len(ua & ub):,} of their "
            f"{len(ua):,} draft-vocab tokens are shared"]


def _draft_tokens(d: Description) -> set[int] | None:
    """The target ids of the draft vocab (d2t[i] + i), None where no d2t is stored."""
    d2t = d.info.tensor("d2t")
    if d2t is None or d2t.dim() != 1:
        return None
    return set((d2t.long() + torch.arange(d2t.numel())).tolist())


def _data_ratio(a: Description, b: Description) -> list[str]:
    ta, tb = ((x.data or {}).get("tokens") for x in (a, b))
    if not all(isinstance(t, (int, float)) and t > 0 for t in (ta, tb)) or ta == tb:
        return []
    big, small = (a, b) if ta >= tb else (b, a)
    ratio = max(ta, tb) / min(ta, tb)
    return [f"{big.label} was trained on {ratio:.1f}x the tokens of {small.label} "
            f"({max(ta, tb):,} vs {min(ta, tb):,})"]


def run_compare(opts: CompareOptions) -> dict[str, Any]:
    """The comparison; a ctrl-C while measuring writes what is complete to --out, marked
    partial, then raises `Stopped` holding it."""
    # each folder read (a draftsmith one checked whole) before the target's minutes of loading
    claimed_drafters(labels(opts.drafters), opts.claimed)
    infos = [read_checked(f) for f in opts.drafters]
    if opts.target:
        _check_topk(opts.topk, infos, labels(opts.drafters))
    target = _target(opts) if opts.target else None
    layers = target.cfg.num_layers if target is not None else None
    descs = [describe(i, n, layers) for i, n in zip(infos, labels(opts.drafters), strict=True)]
    res: dict[str, Any] = {
        "context": {"date": date.today().isoformat(), "target": target.source if target
                    else None, "target_from": ("the drafters' records" if opts.recorded else
                                               "--target") if target else None,
                    "drafters": [str(Path(f)) for f in opts.drafters]},
        "drafters": [],  # after the run: it adds the ids it measured on
        "claims": claims(descs, opts.claimed),
        "notes": differences(descs),
    }
    if target is not None:
        res["notes"] += _other_target(descs, target, opts.recorded)
        try:
            res["speed"] = _speed(opts, target, descs)
        except Interrupted as stop:
            _interrupted(res, descs, opts, stop)
        _speed_notes(res, descs)
    return _finished(res, descs, opts)


def _speed_notes(res: dict[str, Any], descs: list[Description]) -> None:
    from draftsmith.bench.load import busy_note

    res["notes"] += _measured_ids(descs) + _load_notes(descs)
    if note := busy_note((res.get("speed") or {}).get("machine_load")):
        res["notes"].append(f"{note}: tokens/s and speedups are skewed, acceptance is not")


def _finished(res: dict[str, Any], descs: list[Description], opts: CompareOptions
              ) -> dict[str, Any]:
    """The report made whole (the drafters' sections, strict JSON) and written to --out."""
    from draftsmith.bench.report import strict

    res["drafters"] = [d.to_dict() for d in descs]
    res = strict(res)  # a NaN read from a drafter's files is null in compare.json
    if opts.out is not None:
        try:
            write(res, Path(opts.out))
        except OSError as e:  # after a run of minutes: the caller prints what was measured
            raise Unwritten(res, f"--out {opts.out}: cannot write the report "
                            f"({e.strerror or e}); the results are printed above") from None
    return res


def _interrupted(res: dict[str, Any], descs: list[Description], opts: CompareOptions,
                 stop: Interrupted) -> None:
    """The static sections and the prompts every run finished, written to --out and said on
    stderr; then `Stopped` (a KeyboardInterrupt: the CLI exits 130)."""
    if stop.result is not None:
        res["speed"] = stop.result
    measured = (f"acceptance and speed are over the {stop.finished} prompts every run finished"
                if stop.finished else "no acceptance measured")
    res["notes"].append(f"interrupted (ctrl-C) after {stop.finished} of {stop.total} prompts: "
                        f"{measured}")
    _speed_notes(res, descs)
    try:
        res = _finished(res, descs, opts)
        kept = (f"wrote what was complete to {opts.out}, marked partial" if opts.out
                else "no --out given, nothing written")
    except Unwritten as e:  # a ctrl-C is still a ctrl-C: printed, the error said, exit 130
        res, kept = e.result, str(e)
    print(f"compare: interrupted after {stop.finished} of {stop.total} prompts: {kept}",
          file=sys.stderr)
    raise Stopped(res) from None


class Stopped(KeyboardInterrupt):
    """A ctrl-C while measuring: `result` holds the report as written, marked partial."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("compare interrupted")
        self.result = result


def _check_topk(topk: int, infos: list[Any], names: list[str]) -> None:
    """--topk within every drafter's draft vocabulary, before the target loads (its decoder
    refused it after the weights were built), as bench, serve and tune check theirs."""
    for info, name in zip(infos, names, strict=True):
        if topk > (vocab := info.draft_vocab_size):
            raise DraftsmithError(f"--topk {topk} exceeds drafter {name}'s draft vocabulary of "
                                  f"{vocab}: give --topk {vocab} or less")


def _target(opts: CompareOptions) -> Any:
    """--target, or the target the drafters record (said on stderr, stdout being --json's; one
    moved or deleted since named, with --target as the fix)."""
    from draftsmith.targets import load_target

    if not opts.recorded:
        return load_target(opts.target)
    from draftsmith.doctor.run import DRAFTER_CONFIG, load_recorded_target

    print(f"compare: no --target given; measuring acceptance on the target every drafter "
          f"records, {opts.target}", file=sys.stderr)
    return load_recorded_target(opts.target, f"{DRAFTER_CONFIG} of every drafter")


class Unwritten(DraftsmithError):
    """The comparison finished but --out could not be written; `result` holds it."""

    def __init__(self, result: dict[str, Any], message: str) -> None:
        super().__init__(message)
        self.result = result


def _measured_ids(descs: list[Description]) -> list[str]:
    """An engine folder whose ids compare's run (as `draftsmith import`) reads otherwise than
    its engine feeds them: the acceptance measured is not the engine's."""
    return [f"{d.label} was measured on canonical aux layers {d.ids_measured} (its config as "
            f"`draftsmith import` reads it), but {_ENGINE[d.info.layout]} feeds it "
            f"{d.ids_canonical}: its acceptance there may differ from this one"
            for d in descs if d.info.layout in _ENGINE and d.ids_measured is not None
            and d.ids_measured != d.ids_canonical]


_ENGINE = {"sglang": "SGLang", "speculators": "vLLM"}


def _load_notes(descs: list[Description]) -> list[str]:
    """What reading each engine folder warned (as doctor's `loads` findings), as report lines
    instead of Python warnings on stderr."""
    return [f"{d.label}: {n}" for d in descs for n in d.load_notes]


def _other_target(descs: list[Description], target: Any, recorded: bool = False
                  ) -> list[str]:
    """Drafters recorded as trained for another target: their acceptance here is not theirs.
    A folder recording no fingerprint (SpecForge's, a hub's speculators one) by the depth it
    records or its verifier's config.json gives: a target of other shapes fails to load, one
    of another depth does not."""
    here = (f"the target the drafters record, {target.source}," if recorded
            else f"--target {target.source}")
    notes = []
    for d in descs:
        if fp := d.info.recorded("target_fingerprint"):
            if fp != target.fingerprint:
                notes.append(f"{d.label} was trained for target fingerprint {fp}, but {here} "
                             f"has {target.fingerprint}: its acceptance here is on a target it "
                             "was not trained for")
        elif (layers := _recorded_layers(d)) and layers != target.cfg.num_layers:
            notes.append(f"{d.label} was trained for a target of {layers} layers, but {here} "
                         f"has {target.cfg.num_layers}: its acceptance here is on a target it "
                         "was not trained for")
    return notes


def _recorded_layers(d: Description) -> int | None:
    from draftsmith.compare.describe import target_layers

    try:
        return target_layers(d.info)
    except (DraftsmithError, OSError, ValueError):  # a malformed record: nothing to compare
        return None


def _speed(opts: CompareOptions, target: Any, descs: list[Description]) -> dict[str, Any]:
    from draftsmith.bench.suites import prompt_ids, suite_label, suite_messages
    from draftsmith.compare.speed import measure
    from draftsmith.data.progress import stderr_line
    from draftsmith.engine.generate import check_positions

    # bench's prompts, system message kept: a CPU compare predicts a GPU bench's acceptance;
    # a prompt the chat template refuses named, as bench names it
    prompts = prompt_ids(target, suite_messages(opts.prompts, opts.num_prompts, flag="--prompts"),
                         f"--prompts {opts.prompts}")
    if len(prompts) < opts.num_prompts:  # stderr: stdout is --json's
        print(f"compare: --prompts {opts.prompts} has {len(prompts)} prompts with a user turn, "
              f"fewer than --num-prompts {opts.num_prompts}", file=sys.stderr)
    check_positions(prompts, opts.max_new, target.cfg.max_position_embeddings,
                    "--max-new-tokens", target.cfg.sliding_window)  # before the weights
    dtype = str(opts.dtype).removeprefix("torch.")
    # the drafters first: one that does not fit the target is named before its weights build
    suite = suite_label(opts.prompts)
    try:
        drafters = {d.label: _load(d, target, opts) for d in descs}
        stderr_line(f"compare: loading target {target.source} ({opts.device}, {dtype})")
        model = target.build(opts.dtype, opts.device)
        res = measure(model, drafters, prompts, opts.steps, opts.max_new, target.eos_ids,
                      opts.topk, opts.num_draft_tokens, stderr_line)
    except Interrupted as stop:
        if stop.result is not None:
            stop.result = {"suite": suite, **stop.result}
        raise
    except KeyboardInterrupt:  # loading or warming up: no prompt finished
        raise Interrupted(0, len(prompts), None) from None
    return {"suite": suite, **res}


def _load(d: Description, target: Any, opts: CompareOptions) -> Any:
    from draftsmith.data.progress import stderr_line
    from draftsmith.doctor.artifacts import load_noted

    stderr_line(f"compare: loading drafter {d.label}")
    try:
        drafter, notes = load_noted(d.info, target, opts.device, opts.dtype)
    except DraftsmithError as e:  # which of the drafters does not fit the target
        raise DraftsmithError(f"drafter {d.label} with this --target: {_ids_words(d, e)}"
                              ) from None
    d.ids_measured = list(drafter.cfg.aux_layer_ids)
    d.load_notes = [f"{n} (fix: {n.fix})" if n.fix else str(n) for n in notes]
    return drafter


def _ids_words(d: Description, e: DraftsmithError) -> str:
    """Engine ids naming no layer of the target in the user's own numbers, as the aux ids note
    (and the doctor) words them, not import's canonical conversion (a -2 never written)."""
    from draftsmith.doctor.artifacts import IDS

    if d.info.layout not in _ENGINE or d.ids_canonical is not None or IDS not in str(e) \
            or not d.ids_note:
        return str(e)
    return (f"{d.info.config_path}: {d.ids_note} (fix: `draftsmith doctor --drafter "
            f"{d.info.folder}` names the ids to write)")


def write(res: dict[str, Any], out: Path) -> None:
    from draftsmith.bench.cli import say_replaced
    from draftsmith.compare.report import markdown, plot

    out.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(out)
    say_replaced(out / "compare.json", lambda line: print(f"compare: {line}", file=sys.stderr))
    # every file staged under a tmp name first: a failed write leaves the earlier report whole
    staged: dict[str, Path] = {}
    try:
        png = "acceptance.png" if res.get("speed") else None
        if png:
            staged[png] = _tmp(out, png)
            plot(res, staged[png])
        staged["compare.md"] = _tmp(out, "compare.md")
        staged["compare.md"].write_text(markdown(res, png))
        staged["compare.json"] = _tmp(out, "compare.json")
        staged["compare.json"].write_text(json.dumps(res, indent=1, default=str,
                                                     allow_nan=False) + "\n")
        # an earlier run's plot would sit beside a report that measured nothing
        _move_in(staged, out, gone=[] if png else ["acceptance.png"])
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    # stderr: stdout is --json's; the plot named where compare.md shows it
    print(f"compare: wrote {out / 'compare.md'}, compare.json" + (f", {png}" if png else ""),
          file=sys.stderr)


def _move_in(staged: dict[str, Path], out: Path, gone: list[str]) -> None:
    """Each staged file moved over its name and each of `gone` removed, every earlier file set
    aside first: a move refused or interrupted midway (EPERM in a sticky folder, a folder in
    the way, ctrl-C) puts every earlier file back."""
    moved: list[tuple[Path, Path | None]] = []
    try:
        for name, tmp in [*staged.items(), *((n, None) for n in gone)]:
            dest = out / name
            if dest.is_dir() and not dest.is_symlink():  # os.replace would move it whole
                raise IsADirectoryError(21, "Is a directory", str(dest))
            kept = _tmp(out, f"old.{name}") if dest.exists() or dest.is_symlink() else None
            if kept is not None:
                os.replace(dest, kept)
            moved.append((dest, kept))
            if tmp is not None:
                os.replace(tmp, dest)
    except BaseException:
        for dest, kept in reversed(moved):
            if kept is not None:
                os.replace(kept, dest)
            else:
                dest.unlink(missing_ok=True)
        raise
    for _, kept in moved:
        if kept is not None:
            kept.unlink(missing_ok=True)


def _tmp(out: Path, name: str) -> Path:
    """A hidden name beside `name` ending as it does (matplotlib reads the format from it)."""
    return out / f".{os.getpid()}.{name}"


REPORT_FILES = ("compare.md", "compare.json", "acceptance.png")
MOST_PID_DIGITS = 10  # past any pid_max; longer digits would overflow os.kill


def _clear_leftovers(out: Path) -> None:
    """The staged and set-aside files (`_tmp`) of a compare killed midway (SIGKILL, the OOM
    killer): its `finally` never ran. A live process's are left alone (a run writing now)."""
    from draftsmith.targets import pid_alive

    for p in out.glob(".*.*"):
        pid, _, name = p.name[1:].partition(".")
        if not pid.isdigit() or len(pid) > MOST_PID_DIGITS or p.is_dir() \
                or name.removeprefix("old.") not in REPORT_FILES or pid_alive(int(pid)):
            continue
        p.unlink(missing_ok=True)


def show(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from draftsmith.compare.report import sections

    # folder names and paths are text, not markup: exp[v2] would lose its "[v2]"
    con = Console()
    for title, header, rows in sections(res):
        tab = Table(title=escape(title))
        for h in header:
            tab.add_column(escape(h), overflow="fold")
        for r in rows:
            tab.add_row(*map(escape, r))
        con.print(tab)
    for line in res["claims"] + res["notes"]:
        con.print(f"- {line}", markup=False)


def compare(
    ctx: typer.Context,
    drafters: list[str] = typer.Argument(..., help="Two or more drafter folders (draftsmith, "
                                         "SGLang/SpecForge or speculators layout)"),
    target: str = typer.Option(None, "--target", help="Run acceptance with this target "
                               "(without it, an acceptance flag such as --num-prompts measures "
                               "on the target every drafter records)"),
    prompts: str = typer.Option("chat", "--prompts", "--suite", help="A bench suite: chat (its "
                                "built-in prompts), humaneval, or a prompts file (JSONL, ...)"),
    num_prompts: int = typer.Option(8, "--num-prompts", help="Prompts from the suite"),
    max_new: int = typer.Option(64, "--max-new-tokens", "-n", help="New tokens per prompt"),
    steps: int = typer.Option(4, "--steps", help="Draft steps (depths) per cycle"),
    topk: int = typer.Option(1, "--topk", help="1 = chain; > 1 = EAGLE-2 tree"),
    num_draft_tokens: int = typer.Option(None, "--num-draft-tokens",
                                         help="Tokens a tree verifies, the root included"),
    out: Path = typer.Option(None, "--out", "-o", help="Write compare.md, compare.json, "
                             "acceptance.png here"),
    claimed: list[str] = typer.Option(None, "--claimed", metavar="<NAME=COUNT>",
                                      help="NAME=COUNT, a published parameter count (A=1e9)"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (with "
                                 "--target: speed.definitions says what each figure means; "
                                 "accept_rate is accept length / (steps + 1))"),
) -> None:
    """Compare drafters: architecture, parameters by convention, data, acceptance."""
    from draftsmith.cli import device_dtype

    given = [flag for flag, v in (("--device", device), ("--dtype", dtype)) if v != "auto"]
    asked = typed_flags(ctx)
    if target is None and given and not asked:
        raise DraftsmithError(f"{', '.join(given)} set where acceptance is measured, which "
                              "needs --target (or an acceptance flag such as --num-prompts, "
                              "measuring on the target the drafters record): give one, or "
                              "leave them out")
    dev, dt = device_dtype(device, dtype)
    try:
        res = run_compare(CompareOptions(list(drafters), target, prompts, num_prompts, max_new,
                                         steps, out, parse_claims(claimed), dev, dt, topk,
                                         num_draft_tokens, typed=asked))
    except (Unwritten, Stopped) as e:  # nothing measured is lost: printed, then the error
        _print(e.result, as_json)
        raise  # a ctrl-C's `Stopped` is a KeyboardInterrupt: exit 130
    _print(res, as_json)


def typed_flags(ctx: typer.Context) -> list[str]:
    """The acceptance flags typed on the command line: `--num-prompts 8` asks for acceptance
    as `--num-prompts 7` does, though 8 is the default."""
    from draftsmith.data.cli import typed

    return [flag for name, flag in ACCEPTANCE_FLAGS.items() if typed(ctx, name, True)]


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=1, default=str, allow_nan=False))
    else:
        show(res)
