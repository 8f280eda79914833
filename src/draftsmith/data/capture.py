"""Capture: a teacher-forced forward of whole conversations through the target, into shards.

Kept samples (in input order) are cut into shards of `samples_per_shard`; shard k belongs to
rank k % WORLD_SIZE. Each shard's samples are batched by similar length, right-padded, and
written atomically; the manifest lists finished shards, so a rerun of the same command skips
them and a kill at any moment loses at most the shard in flight.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.atomic import make_folder
from draftsmith.data.chat import AnswerTally
from draftsmith.data.prompts import Conversation, encode_conversation
from draftsmith.data.shards import (
    MANIFEST,
    Sample,
    ShardWriter,
    check_identity,
    intact,
    read_manifest,
    same_setting,
    totals,
    whole_file,
    write_json,
)
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS, ascending, default_aux_layers, validate
from draftsmith.options import check_folder
from draftsmith.targets.tokenizer import template_hash, tokenization_hash, tokenizer_hash

IDENTITY = ("target", "aux_layer_ids", "samples_per_shard", "max_len", "too_long",
            "source_digest", "tokens_digest", "world_size", "rank", "compute_dtype")
# the input's conversations (by id) and the tokens and loss masks its kept samples encode to
DIGESTS = ("source_digest", "tokens_digest")
# how the answer turns were taken (`answer_tokens`): a setting a rerun must match too, checked
# apart (`_same_answers`) since manifests written before it was recorded lack it
ANSWER_TOKENS = {"target_ids": "the target's decoded ids (meta.answers[].ids)",
                 "text": "tokenized from their text (an older draftsmith's, or no ids recorded)"}


@dataclass(slots=True)
class CaptureConfig:
    aux_layer_ids: list[int] | None = None
    batch_size: int = 8
    max_len: int = 2048
    too_long: str = "truncate"  # or "skip"
    samples_per_shard: int = 256
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.too_long not in ("truncate", "skip"):
            raise DraftsmithError(f"too_long must be 'truncate' or 'skip', got {self.too_long!r}")
        for name in ("batch_size", "max_len", "samples_per_shard"):
            v = getattr(self, name)  # a float would be recorded, a bool taken as 1
            if not isinstance(v, Integral) or isinstance(v, bool) or v < 1:
                raise DraftsmithError(f"{name} must be a whole number >= 1, got {v!r}")
            setattr(self, name, int(v))
        ids = self.aux_layer_ids  # layers.validate would take 1.5 and True as layer 1
        if ids is not None:
            if not isinstance(ids, list | tuple) or not all(
                    isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
                raise DraftsmithError(f"aux_layer_ids must be a list of integer canonical layer "
                                      f"ids or None (the default ones), got {ids!r}")
            self.aux_layer_ids = [int(i) for i in ids]
        if not isinstance(self.dtype, torch.dtype):
            raise DraftsmithError(f"dtype must be a torch.dtype such as torch.bfloat16, got "
                                  f"{self.dtype!r}")


@dataclass
class Plan:
    kept: list[int]  # indices into the conversations, in order
    lengths: list[int]  # stored tokens per kept sample
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    refused: str = ""  # the first conversation the chat template refused, and why
    answers: AnswerTally = field(default_factory=AnswerTally)  # the kept samples' turns
    digests: list[str] = field(default_factory=list)  # sample_digest of each kept sample

    def shards(self, size: int) -> list[list[int]]:
        return [self.kept[i : i + size] for i in range(0, len(self.kept), size)]


def dist_env() -> tuple[int, int]:
    """(rank, world) under torchrun (checked: RANK=x or a rank past the world is one error),
    else (0, 1)."""
    from draftsmith.dist import torchrun_ranks

    rank, world, _ = torchrun_ranks()
    return rank, world


def rank_device(device: str) -> str:
    """Under torchrun, a bare "cuda" means this process's own GPU (LOCAL_RANK); an explicit
    cuda:N of another GPU is refused where other ranks run: each would hold the target there."""
    from draftsmith.dist import torchrun_ranks

    if "RANK" not in os.environ:
        return device
    rank, world, local = torchrun_ranks()
    if device == "cuda":
        return f"cuda:{local}"
    if world > 1 and str(device).startswith("cuda:") and device != f"cuda:{local}":
        raise DraftsmithError(f"--device {device}: rank {rank} runs on cuda:{local} (its local "
                              f"rank), not beside the other ranks on {device}; give --device cuda")
    return device


def encode_sample(
    tok: Any, conv: Conversation, cfg: CaptureConfig, tally: AnswerTally | None = None,
) -> tuple[list[int], list[bool], bool]:
    """(ids, loss mask, truncated); raises _Skip for a sample that is not stored."""
    ids, mask = encode_conversation(tok, conv, tally)
    cut = len(ids) > cfg.max_len
    if cut:
        if cfg.too_long == "skip":
            raise _Skip("too_long")
        ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
    if not any(mask):  # cut before its first answer: --max-len's doing, not the input's
        raise _Skip("answer_past_max_len" if cut else "no_assistant_tokens")
    return ids, mask, cut


# what to do where every conversation was skipped for this reason
SKIP_FIXES = {"no_assistant_tokens": "conversations need answers: have the target answer the "
                                     "prompts first (draftsmith data regenerate)",
              "too_long": "raise --max-len, or pass --too-long truncate",
              "answer_past_max_len": "raise --max-len, which cuts them before their answers"}


def held_fixes(most: int) -> dict[str, str]:
    """`SKIP_FIXES` where --max-len was held to the target's `most` positions
    (`within_positions`): a higher --max-len keeps no more tokens."""
    held = f"the target holds {most} positions (max_position_embeddings), which no --max-len raises"
    return {"too_long": f"{held}: pass --too-long truncate, or shorten the conversations",
            "answer_past_max_len": f"{held}, and these end before their first answers: shorten "
                                   "what comes before them"}


def no_sample_words(p: Plan, held: int | None) -> str:
    """Why a run kept no sample, and the fix for each skip reason; `held`: the target's
    positions, where they held --max-len."""
    fixes = SKIP_FIXES | (held_fixes(held) if held else {})
    return (f"no conversation has assistant tokens to capture (skipped: "
            f"{skipped_words(p.skipped)})"
            + (f"; the first refused: {p.refused}" if p.refused else "")
            + "".join(f"; {fixes[k]}" for k in p.skipped if k in fixes))


class _Skip(Exception):
    pass


def plan(tok: Any, convs: list[Conversation], cfg: CaptureConfig) -> Plan:
    p = Plan([], [])
    for i, conv in enumerate(convs):
        tally = AnswerTally()
        try:
            ids, mask, cut = encode_sample(tok, conv, cfg, tally)
        except _Skip as e:
            p.skipped[str(e)] = p.skipped.get(str(e), 0) + 1
            continue
        except DraftsmithError as e:  # one conversation's roles ("must alternate"), not the run
            p.skipped["template_refused"] = p.skipped.get("template_refused", 0) + 1
            p.refused = p.refused or f"conversation {i} (id {conv.id}): {e}"
            continue
        p.truncated += cut
        p.answers.add(tally)
        p.kept.append(i)
        p.lengths.append(len(ids))
        p.digests.append(sample_digest(ids, mask))
    return p


def sample_digest(ids: Sequence[int], mask: Sequence[int]) -> str:
    """A sample's token ids and loss mask, as a shard stores them (int32, uint8); through
    `array`, as torch tensors took ten times as long as encoding the sample."""
    h = hashlib.sha256(array("i", ids).tobytes())
    h.update(bytes(mask))
    return h.hexdigest()[:16]


def skipped_words(skipped: dict[str, int]) -> str:
    """Conversations skipped by reason, as words: "3 too_long, 1 template_refused" or "none"."""
    return ", ".join(f"{n} {why}" for why, n in skipped.items()) or "none"


def answer_words(answers: dict[str, int]) -> str:
    """How the answer turns were tokenized, in words (a manifest's `input.answers`)."""
    words = (f"{answers.get('target_ids', 0)} as the target's decoded ids, "
             f"{answers.get('text', 0)} tokenized from their text (no ids recorded)")
    fell = answers.get("fallback", 0)
    return words + (f", {fell} from their text although ids were recorded (a token straddles "
                    "the answer's edge in the template, or the ids do not decode to its text)"
                    if fell else "")


def answer_tokens(m: dict[str, Any]) -> str:
    """How a manifest's answer turns were taken: "target_ids" (some turns spliced as the
    target's decoded ids) or "text" (every turn tokenized from its text): its `answer_tokens`,
    else (written before that was recorded) its `input.answers` tally, else "text" (a
    draftsmith from before recorded ids were spliced)."""
    held = m.get("answer_tokens")
    if isinstance(held, str):
        return held
    tally = (m.get("input") if isinstance(m.get("input"), dict) else {}).get("answers")
    took = tally.get("target_ids") if isinstance(tally, dict) else None
    return "target_ids" if type(took) is int and took > 0 else "text"


def _same_answers(folder: Path, head: dict[str, Any], redo: str) -> None:
    """Refuse a dataset folder whose answers were taken otherwise than this run takes them
    (`answer_tokens`): a resume or grow would add shards of the other tokenization."""
    if not (folder / MANIFEST).is_file():
        return
    there = answer_tokens(read_manifest(folder))
    if there != head["answer_tokens"]:
        now = head["answer_tokens"]
        raise DraftsmithError(
            f"{folder}: holds a dataset whose answers are {ANSWER_TOKENS.get(there, repr(there))}"
            f", but this input's are {ANSWER_TOKENS.get(now, repr(now))} (answer_tokens {there!r}"
            f" there, {now!r} now): its shards and new ones would mix the two; {redo}")


def within_positions(cfg: CaptureConfig, most: int | None,
                     say: Callable[[str], None]) -> CaptureConfig:
    """`cfg` with --max-len held to the target's max_position_embeddings (`most`): the states
    of positions past them, which the forward computes without a word, are of positions the
    target never saw, and a drafter would learn from them."""
    if held_to(cfg.max_len, most) == cfg.max_len:
        return cfg
    say(f"capture: warning: --max-len {cfg.max_len} exceeds the target's "
        f"max_position_embeddings {most}: conversations are held to {most} tokens (longer "
        f"ones: --too-long {cfg.too_long})")
    return dataclasses.replace(cfg, max_len=most)


def held_to(max_len: int, most: int | None) -> int:
    """--max-len held to the target's max_position_embeddings (`most`, None: unknown)."""
    return most if most and max_len > most else max_len


def bytes_per_token(n_aux: int, hidden: int) -> int:
    return (n_aux + 1) * hidden * 2 + 4 + 1


def header(target: Any, convs: list[Conversation], cfg: CaptureConfig, ids: list[int],
           p: Plan, rank: int, world: int) -> dict[str, Any]:
    digest = source_digest([c.id for c in convs])
    n_shards = len(p.shards(cfg.samples_per_shard))
    return {
        "target": {"fingerprint": target.fingerprint, "source": target.source,
                   "tokenizer_hash": tokenizer_hash(target.tokenizer),
                   "tokenization_hash": tokenization_hash(target.tokenizer),
                   "chat_template_hash": template_hash(target.tokenizer),
                   "num_layers": target.cfg.num_layers},
        "aux_layer_ids": ids,
        "aux_convention": CANONICAL_WORDS,
        "dtype": "bfloat16",
        "hidden_size": target.cfg.hidden_size,
        "vocab_size": target.cfg.vocab_size,
        "samples_per_shard": cfg.samples_per_shard,
        "max_len": cfg.max_len,
        "too_long": cfg.too_long,
        "source_digest": digest,
        "tokens_digest": source_digest(p.digests),
        "world_size": world,
        "rank": rank,
        "expected": {"shards": n_shards, "samples": len(p.kept), "tokens": sum(p.lengths)},
        "input": {"conversations": len(convs), "skipped": p.skipped, "truncated": p.truncated,
                  "answers": p.answers.as_dict()},
        "compute_dtype": str(cfg.dtype).removeprefix("torch."),
        "answer_tokens": "target_ids" if p.answers.target_ids else "text",
    }


@torch.no_grad()
def forward_shard(model: Any, tok: Any, convs: list[Conversation], idx: list[int],
                  cfg: CaptureConfig, aux_ids: tuple[int, ...]) -> list[Sample]:
    enc = {i: encode_sample(tok, convs[i], cfg) for i in idx}
    order = sorted(idx, key=lambda i: -len(enc[i][0]))
    out: dict[int, Sample] = {}
    dev = next(model.parameters()).device
    for b in range(0, len(order), cfg.batch_size):
        rows = order[b : b + cfg.batch_size]
        width = len(enc[rows[0]][0])
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            tokens[r, : len(enc[i][0])] = torch.tensor(enc[i][0])
        positions = torch.arange(width).expand(len(rows), width)
        fo = model(tokens.to(dev), positions.to(dev), aux_ids=aux_ids, want_logits=False)
        aux, hidden = fo.aux.to(torch.bfloat16).cpu(), fo.hidden.to(torch.bfloat16).cpu()
        for r, i in enumerate(rows):
            n = len(enc[i][0])
            _finite(convs[i], i, aux[r, :n], hidden[r, :n], aux_ids, cfg)
            out[i] = Sample(convs[i].id, tokens[r, :n].clone(), torch.tensor(enc[i][1]),
                            aux[r, :n].clone(), hidden[r, :n].clone())
    return [out[i] for i in idx]


class NonFinite(DraftsmithError):
    """States of inf or NaN (a float16 target past 65504): a drafter trained on them is NaN."""


def _finite(conv: Conversation, i: int, aux: torch.Tensor, hidden: torch.Tensor,
            ids: tuple[int, ...], cfg: CaptureConfig) -> None:
    """Refuse a sample whose states hold inf or NaN, naming the conversation, the first
    state (aux layer or final hidden) and token that does."""
    states = torch.cat([aux, hidden[:, None]], 1)
    bad = (~torch.isfinite(states)).any(-1)  # [tokens, slots]
    if not bad.any():
        return
    token, slot = (int(x) for x in bad.nonzero()[0])
    where = f"aux layer {ids[slot]}" if slot < len(ids) else "the final hidden state"
    dtype = str(cfg.dtype).removeprefix("torch.")
    fix = ("capture again in bfloat16 or float32 (--dtype) into another folder or with "
           "--overwrite" if cfg.dtype == torch.float16 else "the target overflows at "
           f"{dtype} (damaged weights?)")
    raise NonFinite(f"capture: conversation {i} (id {conv.id}): the target's state at {where} "
                    f"is inf or NaN at token {token} (compute dtype {dtype}); {fix}")


def aux_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """The canonical aux layer ids to capture: `requested` (checked) or the default ones."""
    try:
        ids = validate(default_aux_layers(num_layers) if requested is None else requested,
                       num_layers)
    except DraftsmithError as e:
        raise DraftsmithError(f"--aux-layers: {e}") from None
    return ascending(ids)


def clean(folder: Path, rank: int = 0, world: int = 1) -> None:
    """Remove what a capture writes (shards, manifests, rank folders, tmp files), nothing else:
    each rank its own folder, rank 0 also the top level and folders of ranks beyond `world` (an
    earlier, wider run's), so no rank removes what a running one already wrote. A manifest goes
    first: a clean cut short never leaves one listing shards it removed."""
    try:
        for p in _cleaned(folder, rank, world):
            if p.is_dir():
                (p / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(p)
            else:
                p.unlink()
    except OSError as e:
        raise DraftsmithError(f"{folder}: cannot remove what an earlier capture left "
                              f"({e.strerror or e}: {e.filename}); make it writable, or use "
                              "another folder") from None


def _cleaned(folder: Path, rank: int, world: int) -> list[Path]:
    """What `clean` removes from `folder`, a manifest first."""
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.iterdir(), key=lambda p: p.name != MANIFEST):
        if p.is_dir() and p.name.startswith("rank-"):
            k = p.name.removeprefix("rank-")
            other_live = k.isdigit() and int(k) < world and int(k) != rank
            if not other_live and (rank == 0 or k == str(rank)):
                out.append(p)
        elif rank == 0 and _ours(p.name):
            out.append(p)
    return out


def _size(paths: list[Path]) -> int:
    """The bytes of the files at `paths` (those in folders too); missing ones count 0."""
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*"))]
    return sum(f.stat().st_size for f in files if f.is_file())


def _ours(name: str) -> bool:
    shard = name.startswith("shard-") and name.endswith(".safetensors")
    return name == MANIFEST or shard or (name.startswith(".") and name.endswith(".tmp"))


def capture(
    target: Any,
    convs: list[Conversation],
    out: str | Path,
    cfg: CaptureConfig = CaptureConfig(),
    command: str | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool = True,
    on_shard: Callable[[int], None] | None = None,
    model: Any = None,
    overwrite: bool = False,
    grow: bool = False,
    redo: str = "use another folder or --overwrite",
) -> dict[str, Any]:
    """Capture `convs` into `out`; returns the manifest (merged when all ranks are done).
    `overwrite`: delete what an earlier capture left in `out`, once the inputs are checked.
    `grow`: an earlier single-process capture of other conversations (`data make` with another
    --n) becomes this one: its shards holding exactly the samples this run puts there are
    kept, the others redone, so the result equals a capture of `convs` from scratch. `redo`:
    how to start over, in the error refusing a folder captured with other settings."""
    say = log or (lambda s: print(s, file=sys.stderr))
    out = Path(out)
    check_folder(out)
    rank, world = dist_env()
    rank_device(cfg.device)  # a GPU of another rank refused before any work
    ids = aux_ids(cfg.aux_layer_ids, target.cfg.num_layers)
    asked = cfg.max_len
    cfg = within_positions(cfg, target.cfg.max_position_embeddings, say)
    tok = target.tokenizer
    if not convs:
        raise DraftsmithError("no conversations to capture: the input is empty")
    p = plan(tok, convs, cfg)
    if not p.kept:
        raise DraftsmithError(no_sample_words(p, cfg.max_len if cfg.max_len < asked else None))
    head = header(target, convs, cfg, ids, p, rank, world)
    folder = out / f"rank-{rank}" if world > 1 else out
    mine = [(k, s) for k, s in enumerate(p.shards(cfg.samples_per_shard)) if k % world == rank]
    room = _Room(say, convs, p, head, ids, mine, folder)
    with _Hold(folder, out if world > 1 else None) as hold:
        return _capture_held(target, convs, out, cfg, p, head, room, hold, command, progress,
                             on_shard, model, overwrite, grow, redo)


def _capture_held(target: Any, convs: list[Conversation], out: Path, cfg: CaptureConfig,
                  p: Plan, head: dict[str, Any], room: _Room, hold: _Hold,
                  command: str | None, progress: bool, on_shard: Callable[[int], None] | None,
                  model: Any, overwrite: bool, grow: bool, redo: str) -> dict[str, Any]:
    """`capture` from its checks of the folder on, the folder held (`hold`) before anything
    in it is removed or written."""
    say, folder, mine, ids, tok = room.say, room.folder, room.mine, room.ids, target.tokenizer
    rank, world = head["rank"], head["world_size"]
    hold.take()
    if overwrite:  # the room its removal frees counted, so a refused run removes nothing
        room.check(mine, _size(_cleaned(out, rank, world)))
        clean(out, rank, world)
    _drop_tmp(folder)
    for there in dict.fromkeys((out, folder)):  # the dataset (merged), this rank's part
        _same_answers(there, head, redo)
    if world > 1 and _merged_done(out, head):
        return read_manifest(out)
    if world == 1 and not overwrite:
        _no_parts(out, redo)
    if world > 1 and not overwrite:  # before this rank's work, not at the merge after it
        _same_merged(out, head, redo)
        _same_ranks(out, head)
    adopted = None
    if grow and world == 1:
        adopted = _adoption(out, head, _planned_samples(convs, p, cfg.samples_per_shard))
    else:
        _same_input(folder, head, [c.id for c in convs], world == 1, redo)
    if not overwrite:  # nothing is written before the room is known: a refusal leaves no trace
        done = _done_in(folder, head, adopted, redo)
        room.check([(k, s) for k, s in mine if k not in done],
                   _size([folder / s["file"] for s in adopted[1]]) if adopted else 0)
    make_folder(folder)
    hold.take()  # a folder made (or a rank's removed by --overwrite and made again) held too
    if adopted:
        _adopt(out, *adopted)
    writer = ShardWriter(folder, head, IDENTITY, redo)
    if "answer_tokens" not in writer.manifest:  # an older manifest resumed: now recorded
        writer.update(answer_tokens=head["answer_tokens"])
    _note_command(writer, command or "draftsmith.data.capture.capture()")
    todo = [(k, s) for k, s in mine if k not in writer.done()]
    for line in writer.lost:
        say(f"capture: {line}; captured again")
    if todo:
        model = model if model is not None else target.build(cfg.dtype, rank_device(cfg.device))
        _run(model, tok, convs, cfg, tuple(ids), writer, todo, progress, on_shard, say)
    writer.finish()
    if world > 1:
        return try_merge(out) or writer.manifest
    return writer.manifest


class _Hold:
    """An flock on a capture's folder while the run may remove or write in it: a second capture
    there (the same command in another shell, one with --overwrite) would remove the first's
    tmp files or write its shards over the first's, each run's manifest listing the other's
    files as its own. It dies with the process; a file system without flock is not held.
    A torchrun rank holds its `rank-R/` folder alone and `top` (--out) shared with its peers, so
    a single-process capture there, which holds --out alone, and a rank are refused each other:
    either one's --overwrite would remove the other's files as it writes them."""

    def __init__(self, folder: Path, top: Path | None = None, shared: bool = False,
                 busy: str = "") -> None:
        self.folder, self.fd, self.inode, self.busy = folder, None, None, busy
        self.mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        self.top = _Hold(top, shared=True) if top is not None else None

    def take(self) -> None:
        """Hold the folder as it is now (none yet: nothing to hold), `top` first."""
        if self.top is not None:
            self.top.take()
        try:
            inode = os.stat(self.folder).st_ino
            if self.fd is not None and inode == self.inode:
                return
            self._let_go()  # a folder removed and made again: the new one held
            fd = os.open(self.folder, os.O_RDONLY)
        except OSError:  # not there yet, or not readable: the writes say why
            return
        try:
            fcntl.flock(fd, self.mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DraftsmithError(self.busy or (
                f"--out {self.folder}: another `draftsmith data capture` is writing into it; "
                "wait for it to end (a rerun of the same command then resumes it) or capture "
                "into another --out")) from None
        except OSError:  # no flock on this file system (NFS refuses one on a folder)
            os.close(fd)
            return
        self.fd, self.inode = fd, inode

    def release(self) -> None:
        self._let_go()
        if self.top is not None:
            self.top.release()

    def _let_go(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _planned_samples(convs: list[Conversation], p: Plan,
                     size: int) -> list[list[tuple[str, str]]]:
    """Each shard's (conversation id, `sample_digest`) of its samples, as `_adopt` reads them."""
    digest = dict(zip(p.kept, p.digests, strict=True))
    return [[(convs[i].id, digest[i]) for i in s] for s in p.shards(size)]


def _run(model, tok, convs, cfg, aux_ids, writer, todo, progress, on_shard, say) -> None:
    from draftsmith.data.progress import Progress

    bar = Progress(sum(len(s) for _, s in todo), 0, "sample", "capture", progress, say)
    try:
        for k, idx in todo:
            writer.write(k, forward_shard(model, tok, convs, idx, cfg, aux_ids))
            bar.update(len(idx))
            if on_shard:
                on_shard(k)
    except KeyboardInterrupt:  # each shard is written whole: those finished stay listed
        bar.close()
        say(f"capture: stopped (ctrl-C): {_kept_shards(writer)}")
        raise
    except NonFinite as e:
        bar.close()
        n = len(writer.manifest["shards"])
        raise DraftsmithError(f"{e}; nothing of it was stored, the {n} shard(s) finished before "
                              "are kept") from None
    except torch.OutOfMemoryError:  # batch_size is no part of the identity: a rerun resumes
        bar.close()
        raise DraftsmithError(
            f"capture: out of memory forwarding {cfg.batch_size} conversation(s) of up to "
            f"{cfg.max_len} tokens at once: {_kept_shards(writer)}, and may pass a smaller "
            "--batch-size") from None
    bar.close()


def _kept_shards(writer: ShardWriter) -> str:
    """What a stopped capture keeps (its finished shards), and that a rerun goes on."""
    t = totals(writer.manifest["shards"])
    if not t["shards"]:
        return f"no shard was finished in {writer.folder}; a rerun of the same command starts it"
    return (f"{writer.folder} keeps the {t['shards']} shard(s) finished ({t['samples']} "
            "samples); a rerun of the same command captures the rest")


def _report(say, p: Plan, head: dict, ids: list[int], mine: list, todo: list) -> None:
    bpt = bytes_per_token(len(ids), head["hidden_size"])
    total = sum(p.lengths)
    length = dict(zip(p.kept, p.lengths, strict=True))
    mine_tok = sum(length[i] for _, s in mine for i in s)
    say(f"capture: {len(p.kept)} samples, {total} tokens, aux layers {ids} ({CANONICAL_WORDS})")
    say(f"capture: answers {answer_words(p.answers.as_dict())}")
    if p.skipped or p.truncated:
        say(f"capture: skipped {skipped_words(p.skipped)}; {p.truncated} truncated to --max-len "
            f"{head['max_len']} tokens")
    if p.refused:
        say(f"capture: warning: the chat template refused {p.skipped['template_refused']} "
            f"conversation(s), skipped; the first: {p.refused}")
    say(f"capture: estimated storage {human_bytes(total * bpt)} ({bpt} bytes/token, bf16); "
        f"this rank {human_bytes(mine_tok * bpt)}, {len(todo)}/{len(mine)} shards to write")


SHARD_HEADER = 1024  # a shard's safetensors header beyond its sample ids (a few hundred bytes)


def _todo_bytes(convs: list[Conversation], p: Plan, todo: list, n_aux: int,
                hidden: int) -> int:
    """The bytes the shards in `todo` take on disk: each token's states, id and mask bit
    (`bytes_per_token`), each shard's offsets and header (its sample ids)."""
    length = dict(zip(p.kept, p.lengths, strict=True))
    bpt = bytes_per_token(n_aux, hidden)
    return sum(sum(length[i] * bpt + len(convs[i].id) + 4 for i in idx)
               + 8 * (len(idx) + 1) + SHARD_HEADER for _, idx in todo)


@dataclass
class _Room:
    """What a capture says of its plan and the room its shards take, before it writes."""
    say: Callable[[str], None]
    convs: list[Conversation]
    p: Plan
    head: dict[str, Any]
    ids: list[int]
    mine: list
    folder: Path

    def check(self, todo: list, freed: int) -> None:
        _report(self.say, self.p, self.head, self.ids, self.mine, todo)
        need = _todo_bytes(self.convs, self.p, todo, len(self.ids), self.head["hidden_size"])
        _check_room(self.folder, need, self.say, freed)


def _check_room(folder: Path, need: int, say: Callable[[str], None], freed: int = 0) -> None:
    """Refuse a capture whose shards do not fit the free space of `folder`'s disk (with the
    `freed` bytes it removes first) before its hours of forwards, not at the shard that fills
    it. `folder` may not exist yet: the disk is its nearest existing parent's."""
    if not need:
        return
    there = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(there).free + freed
    if need > free:
        also = f", counting the {human_bytes(freed)} this run removes first" if freed else ""
        raise DraftsmithError(
            f"--out {folder}: the shards to write take {human_bytes(need)} ({need} bytes), but "
            f"its disk has {human_bytes(free)} ({free} bytes) free{also}; free space, pass "
            "another --out, or capture fewer conversations or a smaller --max-len")
    say(f"capture: {human_bytes(need)} to write, {human_bytes(free)} free on the disk of "
        f"{folder}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def _note_command(writer: ShardWriter, command: str) -> None:
    cmds = list(writer.manifest.get("commands", []))
    if command not in cmds:
        writer.update(commands=cmds + [command])


def _drop_tmp(folder: Path) -> None:
    if folder.is_dir():
        for p in folder.glob(".*.tmp"):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                raise DraftsmithError(f"{p}: cannot remove this tmp file a killed capture left "
                                      f"({e.strerror or e}); make {folder} writable") from None


def source_digest(lines: list[str]) -> str:
    """`lines` in order: the conversations' ids (a manifest's `source_digest`), the kept
    samples' `sample_digest` (its `tokens_digest`)."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _same_input(folder: Path, head: dict[str, Any], ids: list[str], growable: bool,
                redo: str) -> None:
    """Refuse a folder captured from other conversations with these settings by what changed
    (ShardWriter would name two digests): --grow pointed at only where this input extends the
    one captured there (an answers file grown since), else the input named as another one."""
    if not (folder / MANIFEST).is_file():
        return
    m = read_manifest(folder)
    if _same_digests(m, head) or not _same_but_digests(m, head):
        return  # the same input, or other settings, which ShardWriter names
    if m.get("source_digest") == head["source_digest"]:
        fix = (f"pass --grow to redo only the shards whose samples changed, or {redo}"
               if growable else redo)
        raise DraftsmithError(f"{folder}: holds a dataset of the same conversations, but they "
                              "encode to other tokens or loss masks now (answers regenerated, "
                              f"cut or edited since): its shards and new ones would mix the "
                              f"two; {fix}")
    there, here = (m.get("input") or {}).get("conversations"), len(ids)
    grew = (isinstance(there, int) and not isinstance(there, bool) and there < here
            and source_digest(ids[:there]) == m.get("source_digest"))
    if grew:
        fix = (f"pass --grow to keep its shards and capture the rest, or {redo}" if growable
               else redo)
        what = f"its {there} conversations and {here - there} more: the input grew since"
    else:
        fix = redo
        what = (f"{there if there is not None else '?'} there, {here} in this input, not an "
                "extension of those: another input, or one edited since")
    raise DraftsmithError(f"{folder}: holds a dataset made with a different source_digest, "
                          f"of other conversations ({what}); {fix}")


def _same_digests(m: dict[str, Any], head: dict[str, Any]) -> bool:
    return all(same_setting(k, m.get(k), head.get(k)) for k in DIGESTS)


def _same_but_digests(m: dict[str, Any], head: dict[str, Any]) -> bool:
    return all(same_setting(k, m.get(k), head.get(k)) for k in IDENTITY if k not in DIGESTS)


Adoption = tuple[dict[str, Any], list[dict[str, Any]]]  # (the manifest kept, shards dropped)


def _adoption(folder: Path, head: dict[str, Any],
              shards: list[list[tuple[str, str]]]) -> Adoption | None:
    """What `--grow` makes of the capture in `folder` (nothing written): its manifest keeping
    the shards that hold exactly the samples (conversation id, `sample_digest`) `shards` puts
    there, and the others, to be redone; None where there is nothing to adopt."""
    if not (folder / MANIFEST).is_file():
        return None
    m = read_manifest(folder)
    if not _same_but_digests(m, head) or _same_digests(m, head):
        return None  # the same run (resumed as it is), or another one ShardWriter names
    keep = [s for s in m["shards"] if s["index"] < len(shards)
            and _shard_samples(folder / s["file"]) == shards[s["index"]]]
    drop = [s for s in m["shards"] if s not in keep]
    m.update({k: head[k] for k in (*DIGESTS, "expected", "input", "answer_tokens")},
             shards=keep, totals=totals(keep), complete=False)
    return m, drop


def _adopt(folder: Path, m: dict[str, Any], drop: list[dict[str, Any]]) -> None:
    write_json(folder / MANIFEST, m)  # first: a kill now leaves a manifest of kept shards
    for s in drop:
        (folder / s["file"]).unlink(missing_ok=True)


def _done_in(folder: Path, head: dict[str, Any], adopted: Adoption | None,
             redo: str) -> set[int]:
    """The shards of `folder` a resume keeps, read before anything is written (its manifest,
    or the one --grow makes of it), checked as ShardWriter checks it: a folder of other settings
    is refused by them, not by its room."""
    if adopted:
        m = adopted[0]
    elif (folder / MANIFEST).is_file():
        m = read_manifest(folder)
    else:
        return set()
    check_identity(folder, m, head, IDENTITY, redo)
    return intact(folder, m)


def _shard_samples(path: Path) -> list[tuple[str, str]] | None:
    """The (sample id, `sample_digest`) of each sample in the shard at `path`."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            ids = json.loads(f.metadata()["sample_ids"])
            off = f.get_tensor("offsets").tolist()
            tokens, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
        return [(i, sample_digest(tokens[a:b].tolist(), mask[a:b].tolist()))
                for i, a, b in zip(ids, off[:-1], off[1:], strict=True)]
    except Exception:  # missing or damaged: the shard is redone
        return None


def _one_dataset(out: Path, m: dict[str, Any], first: dict[str, Any]) -> None:
    """Refuse rank manifest `m` where it was captured otherwise than `first`, by each
    setting's name and values."""
    bad = [_differ(k, _setting(m, k), _setting(first, k)) for k in MERGED
           if not same_setting(k, _setting(m, k), _setting(first, k))]
    if bad:
        raise DraftsmithError(
            f"{out}: rank {m.get('rank')} was captured otherwise than rank {first.get('rank')} "
            f"({'; '.join(bad)}): its shards are not one dataset with theirs; capture again with "
            "the same command on every rank (--overwrite)")


def _same_ranks(out: Path, head: dict[str, Any]) -> None:
    """This rank's settings against those of the other ranks already begun in `out`, a wider
    run's beyond this one's too: their parts would stop the merge after all the work."""
    for path in sorted(out.glob(f"rank-*/{MANIFEST}")):
        if path.parent.name != f"rank-{head['rank']}":
            _one_dataset(out, head, read_manifest(path.parent))


def _no_parts(out: Path, redo: str) -> None:
    """Refuse one process a folder of an unfinished multi-process capture: it would capture
    everything again beside the ranks' shards, which stay on disk unlisted."""
    parts = sorted(out.glob(f"rank-*/{MANIFEST}"))
    if not parts or (out / MANIFEST).is_file():
        return  # a merged one: ShardWriter names its world_size
    world = read_manifest(parts[0].parent).get("world_size")
    raise DraftsmithError(f"{out}: holds an unfinished {world}-process capture "
                          f"({', '.join(p.parent.name for p in parts)}): resume it with {world} "
                          f"processes (torchrun), or {redo}")


def _same_merged(out: Path, head: dict[str, Any], redo: str) -> None:
    """Refuse a dataset in `out` that this run's merge would write its manifest over (a
    single-process capture's, another run's), by the setting that differs, as ShardWriter
    refuses a rank's folder: its shards would be left unlisted."""
    if not (out / MANIFEST).is_file():
        return
    m = read_manifest(out)
    for key in (k for k in IDENTITY if k != "rank"):
        if not same_setting(key, m.get(key), head.get(key)):
            raise DraftsmithError(f"{out}: holds a dataset made with a different {key} "
                                  f"({m.get(key)!r} there, {head.get(key)!r} now); {redo}")


def _setting(m: dict[str, Any], key: str) -> Any:
    """A manifest's `key`; `answer_tokens` as `answer_tokens` reads it where not recorded."""
    return answer_tokens(m) if key == "answer_tokens" else m.get(key)


def _differ(key: str, there: Any, first: Any) -> str:
    """A setting two ranks' manifests differ in, by name and values (a target by the fields
    that differ: its fingerprint, tokenizer or template hash)."""
    if isinstance(there, dict) and isinstance(first, dict):
        keys = [k for k in {**first, **there} if k != "source" and there.get(k) != first.get(k)]
        there, first = ({k: d.get(k) for k in keys} for d in (there, first))
    return f"{key} {there!r} against {first!r}"


def _merged_done(out: Path, head: dict[str, Any]) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    m = read_manifest(out)
    keys = [k for k in IDENTITY if k != "rank"]
    return (bool(m.get("complete"))
            and all(same_setting(k, m.get(k), head.get(k)) for k in keys)
            # a shard gone or cut short: its rank redoes it
            and all(whole_file(out / s["file"], int(s["bytes"])) for s in m.get("shards", [])))


def merge_held(out: str | Path) -> dict[str, Any]:
    """`try_merge` (`data merge`) with `out` held alone, as a single-process capture holds it:
    refused while a capture's rank (which holds it shared), a single-process capture or another
    merge writes there, and let go however it ends."""
    out = Path(out)
    busy = (f"{out}: a capture or another merge is writing into it; wait for it to end, then "
            f"run `draftsmith data merge {out}` again")
    with _Hold(out, busy=busy) as hold:
        hold.take()
        ms = _rank_manifests(out)
        if why := unfinished(out, ms):
            raise DraftsmithError(f"{out}: not every rank has finished ({'; '.join(why)}); "
                                  "rerun the same capture command on every rank (torchrun), "
                                  "which finishes them and merges")
        return merge(out, ms)


def try_merge(out: str | Path) -> dict[str, Any] | None:
    """Merge `rank-R/` manifests into one when every rank is complete; None if not yet."""
    out = Path(out)
    ms = _rank_manifests(out)
    return None if unfinished(out, ms) else merge(out, ms)


def _rank_manifests(out: Path) -> list[dict[str, Any]]:
    if not out.is_dir():
        raise DraftsmithError(f"{out}: no such folder" if not out.exists() else
                              f"{out}: is a file, not a capture folder")
    ranks = sorted(out.glob("rank-*/" + MANIFEST))
    if not ranks:
        raise DraftsmithError(f"{out}: no rank-R/{MANIFEST} to merge")
    return [read_manifest(p.parent) for p in ranks]


def unfinished(out: Path, ms: list[dict[str, Any]]) -> list[str]:
    """What keeps the rank manifests `ms` of `out` from one dataset, rank by rank: none begun,
    one not finished, a shard it lists gone or cut short (a merge would list it; its rank's
    rerun writes it again)."""
    have = {m.get("rank"): m for m in ms}
    why = {r: "not begun" for r in range(int(ms[0]["world_size"])) if r not in have}
    for r, m in have.items():
        lost = [s["file"] for s in m.get("shards", [])
                if not whole_file(out / f"rank-{r}" / s["file"], int(s["bytes"]))]
        if not m.get("complete") or lost:
            why[r] = "unfinished" if not m.get("complete") else \
                f"{', '.join(lost)} gone or cut short"
    order = sorted(why, key=lambda r: (len(str(r)), str(r)))  # rank 2 before rank 10
    return [f"rank {r}: {why[r]}" for r in order]


# what every rank's shards must share to be one dataset: the run's identity, the stored dtype
# and how the answers were taken
MERGED = (*(k for k in IDENTITY if k != "rank"), "dtype", "hidden_size", "answer_tokens")


def merge(out: Path, ms: list[dict[str, Any]]) -> dict[str, Any]:
    for m in ms[1:]:
        _one_dataset(out, m, ms[0])
    shards = []
    for m in ms:
        shards += [{**s, "file": f"rank-{m['rank']}/{s['file']}"} for s in m["shards"]]
    shards.sort(key=lambda s: s["index"])
    want = ms[0]["expected"]["shards"]
    if [s["index"] for s in shards] != list(range(want)):
        raise DraftsmithError(f"{out}: the ranks hold shards {[s['index'] for s in shards]}, "
                              f"expected 0..{want - 1}")
    merged = {k: v for k, v in ms[0].items() if k not in ("rank", "shards", "totals")}
    merged.update(rank=None, shards=shards, totals=totals(shards), complete=True,
                  commands=sorted({c for m in ms for c in m.get("commands", [])}))
    write_json(out / MANIFEST, merged)
    return merged
