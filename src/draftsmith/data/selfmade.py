"""Self-made prompts (the Magpie technique): the target, given only the chat template's text up
to a user message, writes the user's question itself.

Batches are appended to the output JSONL as they finish, so a rerun continues (from the round
after the last record's `meta.round`, as an uninterrupted run would; a run whose rounds ran out
notes the round after its last beside the file, `tried_path`, so a rerun goes on past rounds
that kept nothing); questions are de-duplicated (case and whitespace folded) and filtered by
length; a question the target did not finish within `max_new_tokens` is dropped. With
`openings`, row i of a batch starts the user's message with opening i (round robin) and the
target finishes it: a small target left alone asks a narrow range of questions, and a drafter
trained on its answers generalises only as far as they.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.atomic import append_whole, atomic_write, make_folder
from draftsmith.data.chat import SENTINEL, render, role_headers, user_prefix
from draftsmith.data.prompts import (
    CSV_FILES,
    Conversation,
    Malformed,
    appended_records,
    cut_records,
    drop_last_write,
    last_group_start,
    mark_write,
    parse_record,
    write_cut,
)
from draftsmith.data.regenerate import NUMERICS, control_ids, dtype_name
from draftsmith.errors import DraftsmithError


@dataclass(slots=True)
class MagpieConfig:
    n: int = 100
    batch_size: int = 16
    max_new_tokens: int = 128
    min_chars: int = 12
    max_chars: int = 2000
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    system: str | None = None
    max_batches: int = 0  # 0: 10 * n / batch_size + 10
    openings: tuple[str, ...] = ()  # the user message starts with one of these (round robin)

    def __post_init__(self) -> None:
        if self.n < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise DraftsmithError(
                f"self-made prompts: the count ({self.n}), batch size ({self.batch_size}) and "
                f"max new tokens ({self.max_new_tokens}) must each be >= 1")
        if self.max_batches < 0:  # it decoded no round, then warned "after -1 rounds"
            raise DraftsmithError(f"self-made prompts: max_batches ({self.max_batches}) must be "
                                  ">= 0 (0: 10 * n / batch size + 10 rounds)")
        if self.min_chars < 1:  # 0 kept empty prompts: a turn the target closed at once
            raise DraftsmithError(f"self-made prompts: --min-chars ({self.min_chars}) must be "
                                  ">= 1: an empty question is no prompt")
        if self.max_chars < 1 or self.min_chars > self.max_chars:
            raise DraftsmithError(
                f"self-made prompts: --min-chars ({self.min_chars}) must not exceed --max-chars "
                f"({self.max_chars}), and --max-chars must be >= 1: no prompt could pass")
        self._greedy_within()

    def _greedy_within(self) -> None:
        """Greedy rows of one start decode alike: past one prompt per opening, a run spun all
        its rounds on duplicates, then advised another --seed, which greedy ignores."""
        most = len(set(self.openings)) or 1
        if self.temperature == 0 and self.n > most:
            given = "--openings" if self.openings else "no --openings"
            raise DraftsmithError(
                f"self-made prompts: at --temperature 0 (greedy) the target asks one question "
                f"per opening ({most}: {given}), not {self.n}: sample with --temperature > 0, "
                f"or ask for at most {most}")


# Starts of user messages across code, reasoning, writing and structured requests.
BUILTIN_OPENINGS = (
    "Write a Python function that", "Fix the bug in this Python code:", "Implement a class",
    "Write a SQL query that", "Explain what this code does:", "Write a JavaScript function",
    "Write a bash script that", "Complete the following function:", "What is the time complexity",
    "Solve for x:", "Calculate", "A train leaves", "Prove that", "Explain why", "Explain how",
    "Compare", "Summarize", "List", "Give me a step-by-step", "Write a short story about",
    "Write an email to", "Translate into French:", "What are the pros and cons of",
    "Create a table of", "Rewrite this paragraph", "How do I", "What is the difference between",
    "Write a poem about", "Give three examples of", "Plan a",
)


def openings_from(spec: str | None) -> tuple[str, ...]:
    """'builtin', 'mixed' (half the rows builtin openings, half free), a text file with one
    opening a line, or None / '' (no openings)."""
    if not spec:
        return ()
    if spec == "builtin":
        return BUILTIN_OPENINGS
    if spec == "mixed":
        return BUILTIN_OPENINGS + ("",) * len(BUILTIN_OPENINGS)
    path = Path(spec)
    if not path.is_file():
        raise DraftsmithError(f"--openings {spec!r}: neither 'builtin', 'mixed' nor a file")
    try:  # utf-8-sig: a Windows editor's BOM would open the first opening's prompts
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"--openings {spec}: cannot read it as UTF-8 text ({e})") from None
    lines = tuple(x.strip() for x in text.splitlines() if x.strip())
    if not lines:
        raise DraftsmithError(f"--openings {spec}: the file holds no openings")
    return lines


def openings_id(openings: tuple[str, ...]) -> str:
    """The set of openings in its order (which picks each row's), as each prompt records it:
    a rerun with another set (builtin and mixed share their first) would pick otherwise."""
    return hashlib.sha256(json.dumps(openings).encode()).hexdigest()[:16]


def fold(text: str) -> str:
    return " ".join(text.lower().split())


def closing_text(suffix: str) -> str:
    """The text that closes a user turn ("<|im_end|>", Llama 2's "[/INST]"). A blank one (a
    plain template's newline or space) is none: it stopped a question at its first line or
    word; the template's role headers end it instead (`role_headers`, `_turn_end`)."""
    return suffix.strip()


def stop_ids(target: Any, suffix: str) -> list[int]:
    """The target's eos ids plus the token that closes a user turn, where one token does
    ("<|im_end|>", "<|eot_id|>"). The first token of a longer closing (Llama 2's "[/INST]":
    "▁[") is no stop: a question holding it ("sort [3, 1]") was cut there and kept cut;
    `_one` cuts such a question at the closing's text instead."""
    ids = set(target.eos_ids)
    closing = target.tokenizer(closing_text(suffix), add_special_tokens=False)["input_ids"]
    if len(closing) == 1:
        ids.add(int(closing[0]))
    return sorted(ids)


def accept(text: str, cfg: MagpieConfig, seen: set[str], opening: str = "") -> str | None:
    """`text` (`opening` and what the target wrote after it), stripped, or None: a repeat, over
    --max-chars in all, or under --min-chars of the target's own text (the opening, counted,
    let one word after "Write a Python function that" pass)."""
    text = text.strip()
    written = text.removeprefix(opening.strip()).strip()
    if not (cfg.min_chars <= len(written) and len(text) <= cfg.max_chars) or fold(text) in seen:
        return None
    return text


def made_by_record(target: Any, cfg: MagpieConfig, dtype: torch.dtype,
                   compile: bool) -> dict[str, Any]:
    """What made a run's prompts, as each prompt records it (`data make` checks a folder's
    prompts against it before any stage)."""
    conf = {k: v for k, v in asdict(cfg).items() if k != "openings"}
    return {"source": "magpie", "target": target.fingerprint, **conf,
            "dtype": dtype_name(dtype), "compile": compile}


def self_made_prompts(
    target: Any,
    out: str | Path,
    cfg: MagpieConfig = MagpieConfig(),
    model: Any = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    compile: bool = False,
    overwrite: bool = False,
) -> dict[str, int]:
    """Append self-made user prompts to `out` (JSONL) until it holds `cfg.n`; returns counts.
    `compile`: the decode step runs torch.compile'd layers (GPU). `overwrite`: start over; the
    prompts in `out` are emptied (atomically) only after the model is built, just before the
    first round, so a folder that cannot be written keeps them."""
    from draftsmith.data.progress import Progress
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams

    say = log or (lambda s: print(s, file=sys.stderr))
    out = Path(out)
    meta = made_by_record(target, cfg, dtype if model is None else
                          next(model.parameters()).dtype, compile)
    records, torn = appended_records(out) if not overwrite else ([], False)
    _read_back_as_jsonl(out)  # after the records: a file of other text says so first
    torn = torn or write_cut(records)
    have = [_conversation(out, line, r) for line, r in records]
    _self_made_only(out, records, have)
    if torn:  # the last round's write, torn by a kill, is made again whole
        _same_settings(out, have, meta, cfg.openings)
        records = drop_last_write(out, records, _round)
        have = [_conversation(out, line, r) for line, r in records]
    full = len(have) >= cfg.n
    _same_settings(out, have, meta, cfg.openings, full)
    if full:
        return _full(out, len(have), cfg.n, say)
    # a last round an earlier, smaller --n cut short is made again whole, as this --n makes it
    cut = last_group_start(records, _round) if have and have[-1].meta.get("cut") else None
    have = have[:cut]
    seen = {fold(c.first_user()) for c in have}
    stats = {"kept": len(have), "in_file": len(records), "duplicates": 0, "length_filtered": 0,
             "unfinished": 0, "bare_openings": 0, "template_tokens": 0}
    prefix, suffix = user_prefix(target.tokenizer, cfg.system)
    opens = cfg.openings or ("",)
    starts = [target.tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in opens]
    _within_positions(starts, cfg.max_new_tokens, target.cfg.max_position_embeddings,
                      target.cfg.sliding_window)
    marks = template_ids(target.tokenizer, cfg.system)
    closing = closing_text(suffix)
    roles = () if closing else role_headers(target.tokenizer, cfg.system)
    # the template's role tokens stop a row: past one the target only wrote a turn of its own
    stops = sorted(set(stop_ids(target, suffix)) | marks)
    params = SamplingParams(cfg.temperature, cfg.top_p)
    model = model if model is not None else target.build(dtype, device)
    need = max(map(len, starts)) + cfg.max_new_tokens
    rt = Runtime(model, _rows(cfg), need + 1, compile=compile, kept=need)
    limit = _round_limit(cfg)
    bar = Progress(cfg.n, len(have), "prompt", "prompts", progress, say)
    make_folder(out.parent)
    new_file = overwrite or not out.exists()
    if overwrite:  # unwritable: said before the first batch, the old prompts still there
        atomic_write(out, b"", "the prompts there before are kept")
    append_whole(out, b"", _kept(len(have)))
    which = openings_id(cfg.openings)
    made_by = {k: meta[k] for k in RESUMED} | {"openings_id": which}
    first = _next_round(have) if overwrite else max(_next_round(have),
                                                    _tried(out, have, made_by))
    try:
        how = (starts, opens, stops, params, closing, marks, roles)
        cut = _rounds(target, out, cfg, rt, how, meta, records, have, seen, stats, cut, bar,
                      range(first, first + limit))
    except KeyboardInterrupt:  # a round's prompts are written whole: those before it stay
        bar.close()
        _drop_empty(out, new_file)
        say(f"prompts: stopped (ctrl-C): {_stopped(out, _held(out))}")
        raise
    bar.close()
    stats["in_file"] = len(have) if cut is None else len(records)
    if stats["kept"] < cfg.n:
        _note_tried(out, have, first + limit, made_by)
        say(_short(stats, cfg, limit))
    return stats


def _round_limit(cfg: MagpieConfig) -> int:
    """The rounds a run may decode: --max-batches, else 10 * n / batch size + 10; greedy, no
    more than start every opening once (rows pick them in turn): later rounds repeat them."""
    limit = cfg.max_batches or 10 * cfg.n // cfg.batch_size + 10
    if cfg.temperature == 0:
        return min(limit, -(-(len(cfg.openings) or 1) // cfg.batch_size))
    return limit


def _stopped(out: Path, kept: int) -> str:
    """What a ctrl-C leaves: the prompts of the rounds written, and that a rerun resumes."""
    if not kept:
        return f"no prompt was made yet, {out} is not kept; a rerun of the same command starts it"
    return f"{out} keeps the {kept} prompts made before; a rerun of the same command resumes " \
        "after them"


def _held(out: Path) -> int:
    """The prompts `out` holds, one a line: a cut round not yet made again stays in the file,
    though this run counts none of it (`bar.done` said "not kept" of a file of them)."""
    try:
        data = out.read_bytes().removeprefix(codecs.BOM_UTF8)
    except OSError:
        return 0
    return sum(1 for line in data.split(b"\n") if line.strip())


# names the prompt readers (`prompts._records`) read as another format than JSON Lines
OTHER_FORMATS = (".gz", ".txt", ".parquet", *CSV_FILES)


def _read_back_as_jsonl(out: Path) -> None:
    """Refuse an `out` that `data regenerate` would read otherwise: a .txt's lines were taken
    for questions (the records' JSON text), a .gz, .csv or .parquet could not be read back."""
    end = next((e for e in OTHER_FORMATS if out.name.lower().endswith(e)), None)
    if end is not None:
        raise DraftsmithError(
            f"{out}: self-made prompts are written as JSON Lines, which a file ending in {end} "
            "is not read back as: give an --out ending in .jsonl (rename one made before: it "
            "resumes there)")


def _drop_empty(out: Path, new_file: bool) -> None:
    """Remove the empty file this run began (or emptied with --overwrite): no prompts."""
    try:
        if new_file and out.stat().st_size == 0:
            out.unlink()
    except OSError:
        pass


def _rounds(target: Any, out: Path, cfg: MagpieConfig, rt: Any, how: tuple, meta: dict,
            records: list, have: list[Conversation], seen: set[str], stats: dict[str, int],
            cut: int | None, bar: Any, rounds: range) -> int | None:
    """Decode and append rounds until `cfg.n` prompts are kept or `rounds` run out; returns
    the cut round's start still to replace (None: none)."""
    starts, opens, stops, params, closing, marks, roles = how
    which = openings_id(cfg.openings)
    for round_ in rounds:
        if stats["kept"] >= cfg.n:
            break
        # modulo 2**64, as torch takes a seed (a negative one too): a large --seed overflowed
        torch.manual_seed((cfg.seed * 1_000_003 + stats["kept"] * 1009 + round_) % (1 << 64))
        pick = [(round_ * cfg.batch_size + i) % len(opens)
                for i in range(_rows(cfg))]
        gen = _decode(rt, [starts[k] for k in pick], cfg.max_new_tokens, (params, stops), bar,
                      f"round {round_ + 1}: decoding {len(pick)} rows x up to "
                      f"{cfg.max_new_tokens} tokens")
        made, more = [], False
        for k, toks in zip(pick, gen.tokens, strict=True):
            done = stats["kept"] >= cfg.n  # a row past --n: read only to mark the round cut,
            got = _one(target, toks, cfg, seen, dict(stats) if done else stats, opens[k],
                       starts[k], closing, marks, roles)  # its drops not this run's counts
            more = more or (got is not None and done)
            if got is None or done:
                continue
            seen.add(fold(got))
            rec = {**meta, "round": round_} | ({"opening": opens[k], "openings_id": which}
                                               if cfg.openings else {})
            have.append(Conversation([{"role": "user", "content": got}], meta=rec))
            made.append(have[-1].to_json())
            stats["kept"] += 1
        for r in made if more else ():  # a larger --n makes this round again whole
            r["meta"]["cut"] = True
        new = made
        if made and cut is not None:  # the cut round, made again whole
            new, cut = _join_cut(out, records, cut, made), None
        if new:  # a round's records in one write: a kill or a full disk keeps all or none
            append_whole(out, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                      for r in mark_write(new)).encode(),
                         _kept(stats["kept"] - len(new)))
        if made:
            bar.update(len(made))  # a round's prompts at once: one by one, an off-terminal
            # line fired on the first of them projected the whole run from one prompt
    return cut


def _decode(rt: Any, prompts: list[list[int]], max_new: int, how: tuple, bar: Any,
            head: str) -> Any:
    """One round's `run_generation`, its status beating (time so far) until the decode steps
    tell their own progress: tokens written and rows finished, then only those (the beat's
    text would hide them). Progress off: no hook, so no count is read from the device."""
    from draftsmith.data.progress import span
    from draftsmith.engine import generate

    params, stops = how
    with ExitStack() as beat:
        beat.enter_context(bar.beating(head))
        if not bar.shown:
            return generate.run_generation(rt, prompts, max_new, params, stops)
        start, tally = time.perf_counter(), _Tally(len(prompts))

        def on_step(steps: int, finished: int) -> None:
            beat.close()
            spent = span(time.perf_counter() - start)
            bar.status(f"{head}, {tally.add(steps, finished)} tokens written, "
                       f"{finished}/{tally.rows} rows finished, {spent} in")

        return generate.run_generation(rt, prompts, max_new, params, stops, on_step=on_step)


@dataclass(slots=True)
class _Tally:
    """A round's tokens written (eos not counted) as its decode steps tell them: each step, the
    rows still running wrote one each (the prefill their first). A row that finished between
    two tellings is counted up to the one before: never more than written, and never down."""
    rows: int
    steps: int = -1  # before the prefill's token
    tokens: int = 0

    def add(self, steps: int, finished: int) -> int:
        self.tokens += (steps - self.steps) * (self.rows - finished)
        self.steps = steps
        return self.tokens


def _join_cut(out: Path, records: list[tuple[int, dict[str, Any]]], cut: int,
              made: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of a round an earlier, smaller --n cut short (`records[cut:]`), made again
    whole (`made`), that `out` lacks: those past the part written, where the round starts with
    it (decoding repeats: the prompts written stay as they are), else all of them, the part
    written cut from the file first."""
    there = [r.get("id") for _, r in records[cut:]]
    if [r["id"] for r in made[: len(there)]] == there:
        return made[len(there):]
    cut_records(out, records, cut)
    return made


def _rows(cfg: MagpieConfig) -> int:
    """A round's rows: --batch-size, whatever --n is. Rows sized to the prompts still wanted
    drew a round otherwise under each --n, so a run grown from a smaller --n asked other
    questions than a fresh run of the larger one."""
    return cfg.batch_size


def _full(out: Path, there: int, n: int, say: Callable[[str], None]) -> dict[str, int]:
    """The counts of a run whose file already holds `n` prompts or more: it keeps the first
    `n` (`data make` answers those); a file of more says so."""
    if there > n:
        say(f"prompts: {out} holds {there} prompts from a run of a larger --n; this run keeps "
            f"its first {n} (`data make` answers those; a later stage given the file reads all "
            f"{there})")
    return {"kept": n, "in_file": there, "duplicates": 0, "length_filtered": 0,
            "unfinished": 0, "bare_openings": 0, "template_tokens": 0}


def tried_path(out: Path) -> Path:
    """Where a run whose rounds ran out notes the round after its last: the rounds that kept
    nothing wrote no record, and a rerun that began after the last record made them again,
    seeded alike, so kept nothing again."""
    return out.with_name(f".{out.name}.rounds")


def _where(have: list[Conversation]) -> dict[str, Any]:
    """The prompts a note is of: their count and the last one's id."""
    return {"kept": len(have), "last": have[-1].id if have else None}


def _note_tried(out: Path, have: list[Conversation], next_round: int,
                made_by: dict[str, Any]) -> None:
    note = {"next_round": next_round, **_where(have), "settings": made_by}
    atomic_write(tried_path(out), json.dumps(note).encode(), _kept(len(have)))


def _tried(out: Path, have: list[Conversation], made_by: dict[str, Any]) -> int:
    """The round a rerun goes on from, as noted by a run whose rounds ran out (0: none
    noted, or noted of other prompts or settings than these)."""
    try:
        note = json.loads(tried_path(out).read_bytes())
    except (OSError, ValueError):
        return 0
    fits = (isinstance(note, dict) and isinstance(note.get("next_round"), int)
            and {k: note.get(k) for k in ("kept", "last")} == _where(have)
            and note.get("settings") == made_by)
    return note["next_round"] if fits else 0


def _short(stats: dict[str, int], cfg: MagpieConfig, limit: int) -> str:
    """Why a run's rounds ran out before `cfg.n` prompts, by this run's counts, and that a
    rerun goes on: what was made is kept."""
    return (f"prompts: warning: only {stats['kept']} of {cfg.n} unique prompts after {limit} "
            f"rounds of {cfg.batch_size} ({stats['duplicates']} duplicates, "
            f"{stats['length_filtered']} under {cfg.min_chars} or over {cfg.max_chars} "
            f"characters, {stats['unfinished']} unfinished within --max-new-tokens "
            f"{cfg.max_new_tokens} (`data make`: --prompt-tokens), {stats['bare_openings']} bare "
            f"openings, {stats.get('template_tokens', 0)} holding the chat template's tokens); "
            f"the {stats['kept']} are kept: " + _more(cfg))


def _more(cfg: MagpieConfig) -> str:
    """How to make more: greedy decodes each opening alike, so neither a rerun nor a seed does."""
    if cfg.temperature == 0:
        return ("greedy decodes each opening alike: sample with --temperature > 0, loosen "
                "--min-chars/--max-chars or --max-new-tokens, or give other --openings")
    return ("rerun the same command to make more (it goes on from the round after this run's "
            "last), or try another --seed or --openings")


# what the prompts already written were made with; n and max_batches may grow on a rerun
RESUMED = ("target", "batch_size", "max_new_tokens", "min_chars", "max_chars", "temperature",
           "top_p", "seed", "system", *NUMERICS)
# what shapes only the rounds still to make: a file that needs none may be read under others
ROUNDS = ("batch_size", *NUMERICS)


def _same_settings(out: Path, have: list[Conversation], meta: dict[str, Any],
                   openings: tuple[str, ...], full: bool = False) -> None:
    """A rerun goes on with the settings the prompts in `out` were made with: with others its
    prompts would be neither these nor an uninterrupted run's. `full`: no round is left to
    make, so the settings that only shape rounds (`ROUNDS`) may differ. Prompts written before
    a setting was recorded carry none, and resume under any."""
    keys = [k for k in RESUMED if not (full and k in ROUNDS)]
    for c in have:
        if c.meta.get("source") != "magpie":
            continue
        diff = [_setting(k, c.meta[k], meta[k]) for k in keys
                if k in c.meta and c.meta[k] != meta[k]]
        opening = c.meta.get("opening")
        if "openings_id" in c.meta:
            other = c.meta["openings_id"] != (openings_id(openings) if openings else None)
        else:  # written before the set was recorded: only the first record's opening tells
            other = (opening is None) == bool(openings) or (opening is not None
                                                           and opening not in openings)
        if other:
            diff.append("other --openings")
        if diff:
            raise DraftsmithError(f"{out} holds self-made prompts made otherwise "
                                  f"({'; '.join(diff)}): rerun with those settings, or write to "
                                  "another file")
        return


def _self_made_only(out: Path, records: list[tuple[int, dict[str, Any]]],
                    have: list[Conversation]) -> None:
    """Refuse a file of other prompts (from files, HumanEval, answers): they were counted as
    self-made ones, and a run wanting no more than they are made none (every self-made prompt
    has recorded its source since the first)."""
    for (line, _), c in zip(records, have, strict=True):
        if c.meta.get("source") != "magpie":
            raise DraftsmithError(
                f"{out}:{line}: holds a prompt that is not self-made (source "
                f"{c.meta.get('source')!r}): write them to another file (`data make`: another "
                "folder), or replace this one (`data prompts --overwrite`)")


def _setting(key: str, there: Any, now: Any) -> str:
    if key in NUMERICS:
        return f"{NUMERICS[key](there)} there, {NUMERICS[key](now)} now"
    return f"{key} {there!r} there, {now!r} now"


def _within_positions(starts: list[list[int]], max_new: int, most: int | None,
                      window: int | None = None) -> None:
    """Refused before any round, as generate and serve refuse (regenerate cuts): decoding past
    the target's positions wrote prompts from positions it was never trained on."""
    from draftsmith.engine.generate import check_positions

    try:
        check_positions(starts, max_new, most, f"--max-new-tokens {max_new} (`data make`: "
                        "--prompt-tokens)", window)
    except DraftsmithError as e:
        raise DraftsmithError(f"self-made prompts: {e}") from None


def _round(rec: dict[str, Any]) -> Any:
    meta = rec.get("meta")
    return meta.get("round") if isinstance(meta, dict) else None


def _kept(n: int) -> str:
    return f"it keeps the {n} prompts made before; a rerun of the same command resumes after them"


def _next_round(have: list[Conversation]) -> int:
    """The round after the last one written: a resumed run seeds and picks openings as an
    uninterrupted one does."""
    rounds = [c.meta.get("round") for c in have]
    return 1 + max((r for r in rounds if isinstance(r, int)), default=-1)


def _conversation(out: Path, line: int, rec: dict[str, Any]) -> Conversation:
    try:
        return parse_record(rec)
    except Malformed as e:
        raise DraftsmithError(f"{out}:{line}: not a prompt record ({e}); give another "
                              "--out") from None


def _continuation(tok: Any, start: list[int], toks: list[int]) -> str:
    """The text `toks` add after `start`: decoded together, so a tokenizer that strips the
    leading space of a first token (SentencePiece) keeps the space at the join."""
    head = tok.decode(start, skip_special_tokens=True)
    full = tok.decode(start + toks, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tok.decode(toks, skip_special_tokens=True)


def template_ids(tok: Any, system: str | None = None) -> frozenset[int]:
    """The added tokens the chat template writes around a user turn and its reply, special or
    not: DeepSeek-R1's `<｜Assistant｜>` is not marked special, and its template closes no user
    turn, so the question ran on into the target's answer."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": SENTINEL}]
    try:
        text = render(tok, msgs, True)
    except DraftsmithError:  # a template that fails on the reply's prompt: special ids alone
        return frozenset()
    added = getattr(tok, "added_tokens_decoder", None) or {}
    marks = {int(i) for i, t in added.items() if str(t).strip()}
    return frozenset(marks & set(tok(text, add_special_tokens=False)["input_ids"]))


def _before_control(tok: Any, start: list[int], toks: list[int], closing: str,
                    marks: frozenset[int] = frozenset()) -> list[int]:
    """`toks` up to the first control token the target wrote (the template's own, `marks`, stop
    a row; other special ids, `<unk>`, do not): there it left the user's turn
    (`<|im_start|>assistant ...`), and the decode, skipping the token, joined the words after
    it to the question. One past a closing of several tokens is cut there anyway."""
    control = control_ids(tok) | marks
    j = next((k for k, t in enumerate(toks) if t in control), None)
    if j is None or closing and closing in _continuation(tok, start, toks[:j]):
        return toks
    return toks[:j]


def _turn_end(text: str, closing: str, roles: tuple[str, ...]) -> int:
    """Where the target closed the user's turn in `text`: at the closing's text, else (a plain
    template's blank closing) at the first role header opening the text, a line or following
    a space (Vicuna's "q ASSISTANT:"); -1: not closed."""
    if closing:
        return text.find(closing)
    hits = (re.search(rf"(?:^|(?<=\s)){re.escape(r)}", text) for r in roles)
    return min((m.start() for m in hits if m), default=-1)


def _one(target: Any, toks: list[int], cfg: MagpieConfig, seen: set[str],
         stats: dict[str, int], opening: str, start: list[int], closing: str = "",
         marks: frozenset[int] = frozenset(), roles: tuple[str, ...] = ()) -> str | None:
    kept = _before_control(target.tokenizer, start, toks, closing, marks)
    left, toks = len(kept) < len(toks), kept
    more = _continuation(target.tokenizer, start, toks)
    at = _turn_end(more, closing, roles)
    if at >= 0:  # a closing of several tokens or a role line, no stop: the question ends there
        more = more[:at]
    elif len(toks) >= cfg.max_new_tokens:
        stats["unfinished"] += 1
        return None
    if left and not more.strip():  # nothing asked before it: only the template's tokens
        stats["template_tokens"] = stats.get("template_tokens", 0) + 1
        return None
    if opening and not any(ch.isalnum() for ch in more):
        stats["bare_openings"] += 1  # the target closed the turn at once: no question asked
        return None
    text = opening + more
    got = accept(text, cfg, seen, opening)
    if got is None:
        key = "duplicates" if fold(text) in seen else "length_filtered"
        stats[key] += 1
    return got
