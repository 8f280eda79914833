"""Where training samples come from: a dataset folder (offline) or conversations that the target
turns into hidden states on the fly (online)."""

from __future__ import annotations

import hashlib
import json
import warnings
from array import array
from collections.abc import Generator, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.chat import AnswerTally
from draftsmith.data.shards import Dataset, read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS, ascending, default_aux_layers, validate
from draftsmith.targets import Target, check_tokenization, is_default, load_target
from draftsmith.train.batches import Source, TokenSource
from draftsmith.train.reader import ShardReader, used_shards


@dataclass
class Data:
    source: Source
    lengths: list[int]
    aux_layer_ids: list[int]
    online: bool
    summary: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None  # offline: the dataset's (--max-samples too)
    # online: the samples' lengths before the cut at --max-len, which checkpoints of runs that
    # cut later (packing) recorded; the order is the same either way
    uncut: list[int] | None = None
    # a digest of what is trained on: offline, the used shards' sha256 from the manifest (a
    # re-capture of the same tokens with other hidden states differs); online, the token ids
    content: str | None = None
    reader: ShardReader | None = None  # offline: the dataset's, for `check_hashes`

    def identity(self) -> dict[str, Any]:
        """What the data order depends on (the sample lengths) and what it holds (`content`),
        to tell on --resume whether the data changed since the checkpoint (a dataset grown in
        place or captured again, an edited prompts file)."""
        lengths = self.uncut if self.uncut is not None else self.lengths
        digest = hashlib.sha256(json.dumps(lengths).encode()).hexdigest()[:16]
        return {"samples": len(lengths), "tokens": sum(lengths), "lengths": digest,
                "content": self.content}

    def answer_start(self, max_len: int) -> int | None:
        """The index of an assistant token a drafter learns (from a sample's third token on: the
        first chain starts at index 0 and predicts index 2): one below `max_len` where a sample
        has one (the scan stops at it), else the earliest past it; None where no sample has
        one. Loss masks only: no hidden states are read."""
        best = None
        with closing(loss_masks(self.source)) as masks:
            for mask in masks:
                hit = mask[2:].nonzero()
                if not hit.numel():
                    continue
                at = int(hit[0]) + 2
                if at < max_len:
                    return at
                best = at if best is None else min(best, at)
        return best

    def token_counts(self, vocab: int, max_len: int | None = None) -> torch.Tensor:
        """Frequencies of the assistant tokens this run trains on (ids only, no hidden states):
        within each sample's first `max_len` tokens, offline and online alike (--max-len)."""
        from draftsmith.data.vocab import count_pairs

        with closing(token_pairs(self.source)) as pairs:
            return count_pairs(pairs, vocab, max_len)


def token_pairs(source: Source) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    """Each sample's (input_ids, loss_mask) in order, through the source's own reader where it
    has one: the first --max-samples of a dataset were read whole, hidden states and all."""
    own = getattr(source, "token_pairs", None)
    if own is not None:
        yield from own()
        return
    for i in range(len(source)):
        s = source[i]
        yield s["input_ids"], s["loss_mask"]


def loss_masks(source: Source) -> Generator[torch.Tensor, None, None]:
    """Each sample's loss mask in order, through the source's own reader where it has one."""
    own = getattr(source, "loss_masks", None)
    yield from own() if own is not None else (source[i]["loss_mask"] for i in range(len(source)))


class Head:
    """The first n samples of a source."""

    def __init__(self, source: Source, n: int) -> None:
        self.source, self.n = source, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.source[i]

    def loss_masks(self) -> Iterator[torch.Tensor]:
        with closing(loss_masks(self.source)) as masks:
            yield from islice(masks, self.n)

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        with closing(token_pairs(self.source)) as pairs:
            yield from islice(pairs, self.n)


def target_of_dataset(manifest: dict[str, Any]) -> str:
    source = str(manifest.get("target", {}).get("source", ""))
    if not source:
        raise DraftsmithError("the dataset manifest names no target; pass --target")
    return "default" if is_default(source) else source


def open_offline(folder: str | Path, target: Target, max_samples: int | None,
                 dataset: Dataset | None = None, max_len: int | None = None) -> Data:
    """`dataset`: the folder's, opened already (its manifest read once for the whole run).
    `max_len`: the packed rows' length, which cuts longer samples (recorded in the summary)."""
    ds = dataset if dataset is not None else Dataset(folder)
    m = ds.manifest
    _check_dataset(folder, m, target)
    check_whole(folder, m, max_samples)
    lengths = ds.lengths()
    reader = ShardReader(ds)
    source: Source = reader
    if max_samples is not None and max_samples < len(ds):
        source, lengths = Head(reader, max_samples), lengths[:max_samples]
    ids = _aux_ids(folder, m, target.cfg.num_layers)
    reader.check_shapes(len(ids), target.cfg.hidden_size)
    summary = {"kind": "offline", "folder": str(Path(folder).resolve()),
               "samples": len(lengths), "tokens": sum(lengths),
               "target_fingerprint": m.get("target", {}).get("fingerprint"),
               "aux_layer_ids": ids, "aux_convention": m.get("aux_convention")}
    if max_len is not None:  # the packer cuts them and says so (`batches.cut_note`)
        summary["cut_at_max_len"] = cut_counts(lengths, max_len)
    return Data(source, lengths, ids, False, summary, m,
                content=shards_digest(m["shards"], len(lengths)), reader=reader)


def _aux_ids(folder: str | Path, m: dict[str, Any], layers: int) -> list[int]:
    """The manifest's aux layer ids, checked against the target: an external manifest lacking
    them, or of a deeper target, named with its folder (a KeyError before)."""
    ids = m.get("aux_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise DraftsmithError(f"{folder}: the manifest's aux_layer_ids is {ids!r}, not a list "
                              "of layer ids; capture the dataset with `draftsmith data capture`")
    try:
        return validate(ids, layers)
    except DraftsmithError as e:
        raise DraftsmithError(f"{folder}: {e}") from None


def shards_digest(shards: list[dict[str, Any]], samples: int) -> str:
    """The manifest's sha256 of the shards holding the first `samples` samples, in order, as
    one digest: no shard is read again."""
    # older manifests: None, compared as such
    used = [s.get("sha256") for s in shards[:used_shards(shards, samples)]]
    return hashlib.sha256(json.dumps(used).encode()).hexdigest()[:16]


def tokens_digest(samples: list[tuple[list[int], list[bool]]]) -> str:
    """One digest of the samples' token ids and loss masks."""
    h = hashlib.sha256()
    for ids, mask in samples:
        h.update(array("q", [len(ids)]).tobytes() + array("q", ids).tobytes() + bytes(mask))
    return h.hexdigest()[:16]


OTHER_TARGET = ("pass --target with the model the data was captured from, or capture the data "
                "again with this target")


def _check_dataset(folder: str | Path, m: dict[str, Any], target: Target) -> None:
    got = m.get("target", {}).get("fingerprint")
    if got and got != target.fingerprint:
        raise DraftsmithError(
            f"{folder}: captured from target {m['target'].get('source')!r} (fingerprint {got}), "
            f"but the training target {target.source!r} has fingerprint {target.fingerprint}; "
            f"{OTHER_TARGET}")
    check_tokenization(m.get("target") or {}, target, Path(folder) / "manifest.json")
    if int(m.get("hidden_size", target.cfg.hidden_size)) != target.cfg.hidden_size:
        raise DraftsmithError(f"{folder}: hidden size {m['hidden_size']} != the target's "
                              f"{target.cfg.hidden_size}; {OTHER_TARGET}")
    conv = m.get("aux_convention", CANONICAL_WORDS)
    if conv != CANONICAL_WORDS:
        raise DraftsmithError(
            f"{folder}: aux ids are recorded as {conv!r}; draftsmith reads only its canonical "
            f"form ({CANONICAL_WORDS})"
        )


def check_whole(folder: str | Path, m: dict[str, Any], max_samples: int | None) -> None:
    """Refuse part of a capture: one rank's folder of a multi-process capture, or a capture
    killed or still running (`complete` false; a manifest without the flag, an external
    tool's, is taken as whole, as the doctor takes it). --max-samples may ask for samples of
    the first shards only, which the finished capture holds alike."""
    world, rank = m.get("world_size", 1), m.get("rank")
    if isinstance(world, int) and world > 1 and rank is not None:
        top = Path(folder).resolve().parent
        raise DraftsmithError(
            f"{folder}: rank {rank}'s part of a {world}-process capture, not the whole of it; "
            f"train on {top} once every rank is done and `draftsmith data merge {top}` has "
            "joined them")
    if m.get("complete", True):
        if not m["shards"]:
            raise DraftsmithError(
                f"{folder}: the dataset has no finished shards; capture into it (`draftsmith "
                f"data capture CONVERSATIONS.jsonl --out {folder}`) or pass the folder of a "
                "captured dataset")
        return
    expected = m.get("expected") if isinstance(m.get("expected"), dict) else {}
    ready = _first_samples(m["shards"])
    if ready and max_samples is not None and max_samples <= ready:
        return
    commands = m.get("commands") or []
    rerun = f"rerun its command (`{commands[-1]}`)" if commands else "rerun its command"
    part = (f", or pass --max-samples {ready} or fewer to train on the samples of its first "
            "shards" if ready else "")
    have = sum(int(s["samples"]) for s in m["shards"])
    raise DraftsmithError(
        f"{folder}: the capture is not complete ({len(m['shards'])} of "
        f"{expected.get('shards', '?')} shards, {have} of {expected.get('samples', '?')} "
        f"samples: killed or still running); {rerun} to finish it, then train{part}")


def _first_samples(shards: list[dict[str, Any]]) -> int:
    """The samples of the shards 0..k written without a gap: the finished capture's first."""
    count = 0
    for i, s in enumerate(shards):
        if s["index"] != i:
            break
        count += int(s["samples"])
    return count


def open_online(
    prompts: str | Path, target: Target, aux_ids: list[int] | None, max_samples: int | None,
    max_len: int | None = None,
) -> Data:
    """The conversations as `data capture` stores them (cut at `max_len`, those without an
    assistant token left or that the chat template refuses skipped), so online training equals
    offline training on a capture of them."""
    from draftsmith.data.prompts import load_prompts

    convs = load_prompts(prompts, flag="--prompts").conversations
    most = target.cfg.max_position_embeddings
    asked, max_len = max_len, held_len(max_len, most)
    tally = AnswerTally()
    convs, encoded, refused = _first_trained(target.tokenizer, convs, prompts, max_len,
                                             max_samples, tally)
    kept = [(ids, mask) for ids, mask in encoded if any(mask[:max_len])]
    samples = [(ids[:max_len], mask[:max_len]) for ids, mask in kept]
    cut = cut_counts([len(ids) for ids, _ in kept], max_len)
    said = (f"the chat template refused {len(refused)} conversation(s); the first: "
            f"{refused[0][1]}" if refused else "")
    unanswered = _unanswered(encoded, max_len, len(convs), max_len != asked)
    if not samples:
        raise DraftsmithError(f"{prompts}: no conversation left to train on: "
                              + ("; ".join(x for x in (unanswered, said) if x) or "it holds none"))
    if said:
        warnings.warn(f"{prompts}: {said}: skipped, as data capture skips them", stacklevel=2)
    if unanswered:
        warnings.warn(f"{prompts}: {unanswered}", stacklevel=2)
    if cut["conversations"]:
        warnings.warn(f"{prompts}: {cut_words(cut, len(convs), asked, most)}", stacklevel=2)
    layers = target.cfg.num_layers
    ids = ascending(validate(aux_ids or default_aux_layers(layers), layers))
    src = TokenSource(samples)
    summary = {"kind": "online", "prompts": str(prompts), "samples": len(samples),
               "skipped_without_assistant": len(encoded) - len(samples),
               "skipped_template_refused": len(refused), "answers": tally.as_dict(),
               "cut_at_max_len": cut, "tokens": sum(src.lengths()), "aux_layer_ids": ids}
    return Data(src, src.lengths(), ids, True, summary, uncut=[len(i) for i, _ in kept],
                content=tokens_digest(kept))


def _first_trained(tok: Any, convs: list[Any], prompts: str | Path, max_len: int | None,
                   n: int | None, tally: AnswerTally) -> tuple[list[Any], list, list]:
    """`_encode` of the conversations up to the one giving the `n`-th sample (--max-samples),
    as a capture of them holds its first n (skipped conversations hold none): encoded in
    chunks, each once, until n samples train. `tally` may count a last chunk's few extra."""
    if n is None:
        return (convs, *_encode(tok, convs, prompts, tally))
    encoded: list = []
    refused: list = []
    origin: list[int] = []  # the conversation index of each encoded one
    trains: list[int] = []  # the index in `encoded` of each that trains
    done = 0
    while done < len(convs) and len(trains) < n:
        want = n - len(trains)  # the first chunk n (most runs need no more), later twice short
        chunk = convs[done: done + (2 * want if done else want)]
        got, no = _encode(tok, chunk, prompts, tally)
        gone = {i for i, _ in no}
        origin += [done + i for i in range(len(chunk)) if i not in gone]
        refused += [(done + i, line) for i, line in no]
        trains += [len(encoded) + k for k, (_, mask) in enumerate(got) if any(mask[:max_len])]
        encoded += got
        done += len(chunk)
    if len(trains) >= n:  # cut after the n-th training sample's conversation
        nth = trains[n - 1]
        end = origin[nth] + 1
        encoded = encoded[: nth + 1]
        refused = [r for r in refused if r[0] < end]
        convs = convs[:end]
    return convs, encoded, refused


def held_len(max_len: int | None, most: int | None) -> int | None:
    """--max-len held to the target's max_position_embeddings (`most`) by capture's own rule
    (`held_to`, as `within_positions` holds it): states past them are of positions the target
    never saw. None: no cut asked, held to `most` where it is known."""
    from draftsmith.data.capture import held_to

    if max_len is None and not most:
        return None
    return held_to(max_len or most, most)


def cut_counts(lengths: list[int], max_len: int | None) -> dict[str, Any]:
    """How many samples of `lengths` `max_len` cuts and the tokens it drops, as the run records
    them."""
    over = [n - max_len for n in lengths if max_len is not None and n > max_len]
    return {"conversations": len(over), "tokens": sum(over), "most": max(over, default=0),
            "max_len": max_len}


def cut_words(cut: dict[str, Any], total: int, asked: int | None, most: int | None) -> str:
    """One line on the cut: capture truncates such conversations alike (and says so)."""
    n, held, lost = cut["conversations"], cut["max_len"], cut["tokens"]
    dropped = f"{lost} token(s) dropped, at most {cut['most']} of one"
    if asked is None or held != asked:  # held to the positions: a higher --max-len keeps none
        return (f"{n} of {total} conversation(s) run past the target's max_position_embeddings "
                f"{most}: held to {held} tokens, as data capture holds them ({dropped})")
    return (f"{n} of {total} conversation(s) run past --max-len {held}: cut to their first {held} "
            f"tokens, as data capture truncates them ({dropped}); raise --max-len to train on "
            "all of them")


def _unanswered(encoded: list[tuple[list[int], list[bool]]], max_len: int | None,
                total: int, held: bool = False) -> str:
    """One line on the conversations skipped for want of an answer (none, or every answer token
    past --max-len), with the fix for each; "" where none was. `held`: `max_len` is the
    target's positions, which no --max-len raises (capture's `held_fixes`)."""
    none = sum(not any(mask) for _, mask in encoded)
    late = sum(any(mask) and not any(mask[:max_len]) for _, mask in encoded)
    parts = []
    if none:
        parts.append(f"{none} of {total} conversation(s) have no assistant answer, so nothing of "
                     "them trains: skipped, as data capture skips them; answer them first "
                     "(`draftsmith data regenerate FILE -o ANSWERS.jsonl`, then --prompts "
                     "ANSWERS.jsonl)")
    if late and held:
        parts.append(f"{late} of {total} conversation(s) have every answer token past the "
                     f"target's max_position_embeddings {max_len}, which no --max-len raises: "
                     "skipped; shorten what comes before their answers to train on them")
    elif late:
        parts.append(f"{late} of {total} conversation(s) have every answer token past --max-len "
                     f"{max_len}: skipped; raise --max-len to train on them")
    return "; ".join(parts)


def _encode(tok: Any, convs: list[Any], prompts: str | Path, tally: AnswerTally,
            ) -> tuple[list[tuple[list[int], list[bool]]], list[tuple[int, str]]]:
    """(ids and loss mask of each conversation the chat template takes, the index and one line
    of each refused conversation): capture skips those, so online training does too. `tally`:
    how the answer turns were tokenized (the target's recorded ids or their text), as capture
    counts them."""
    from draftsmith.data.prompts import encode_conversation, encode_conversations

    try:
        whole = AnswerTally()
        encoded = list(encode_conversations(tok, convs, prompts, whole))
        tally.add(whole)
        return encoded, []
    except DraftsmithError:
        pass  # one at a time now, in order to skip just the refused ones
    encoded, refused = [], []
    for i, c in enumerate(convs):
        try:
            encoded.append(encode_conversation(tok, c, tally))
        except DraftsmithError as e:
            refused.append((i, f"conversation {i} (id {c.id}): {e}"))
    return encoded, refused


def resolve_target(target: str | None, data: str | None,
                   manifest: dict[str, Any] | None = None) -> Target:
    """--target, else the one `data`'s manifest records (`manifest`: read already), else the
    embedded default."""
    if target:
        return load_target(target)
    if data:
        m = manifest if manifest is not None else read_manifest(Path(data))
        return load_recorded(target_of_dataset(m), f"{data}: the manifest",
                             "a path relative to where the capture ran")
    return load_target("default")


def load_recorded(src: str, who: str, hint: str) -> Target:
    """The target `who` records (a manifest, a drafter config): one moved or deleted since is
    named as that, with --target as the fix (`hint`: what else the path may be)."""
    if not is_default(src) and not Path(src).exists():  # a default's cleared cache folder too
        raise DraftsmithError(f"{who} names the target {src}, not a file or folder here (moved, "
                              f"deleted, or {hint}): pass --target PATH")
    return load_target(src)


def read_vocab(path: str | Path, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a --vocab file, checked against a target of `vocab` tokens as the doctor
    checks an exported drafter: a bad map would crash on the first batch or be exported."""
    from draftsmith.data.vocab import load_vocab, map_problem

    d2t, t2d = load_vocab(path)
    if t2d.numel() != vocab:
        raise DraftsmithError(f"{path}: t2d covers {t2d.numel()} tokens, the target has {vocab}: "
                              "made for another target; rebuild it for this target with "
                              "`draftsmith data vocab`")
    if d2t.dim() != 1 or not d2t.numel() or d2t.is_floating_point():
        raise DraftsmithError(f"{path}: d2t must be a non-empty list of integer offsets, got "
                              f"{d2t.dtype} of shape {list(d2t.shape)}")
    _, problem = map_problem(d2t, t2d, vocab)
    if problem:
        fix = "for this target " if problem[0] == "outside" else ""
        raise DraftsmithError(f"{path}: {problem[1]}; rebuild it {fix}with `draftsmith data "
                              "vocab`")
    return d2t.long(), t2d.bool()


def counted_longer(path: str | Path, max_len: int | None, longest: int) -> str | None:
    """A note where the --vocab file was counted on samples cut longer than this run's
    --max-len (its vocab.json's `made_from.max_len`, `data.vocab.counted_from`) and this run's
    data has a sample past --max-len (`longest`): the vocab holds tokens only the cut-off tails
    carry, which a vocab counted by train would not."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        made = json.loads((folder / "vocab.json").read_text()).get("made_from") or {}
    except (OSError, ValueError, AttributeError):
        return None
    counted = made.get("max_len") if isinstance(made, dict) else None
    if type(counted) is not int or max_len is None or max_len >= min(counted, longest):
        return None
    return (f"note: --vocab {path} was counted on samples of up to {counted} tokens, and "
            f"--max-len {max_len} trains on fewer: it may hold tokens only the cut tails carry; "
            f"give --max-len {counted}, or rebuild it with `draftsmith data vocab`")


def target_head(target: Target) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of the target, from its HF-named weights."""
    w = target.weights
    if "model.embed_tokens.weight" not in w:
        raise DraftsmithError(f"{target.source}: no model.embed_tokens.weight in the target")
    embed = w["model.embed_tokens.weight"]
    head = w.get("lm_head.weight")
    if head is None:
        if not target.cfg.tie_word_embeddings:
            raise DraftsmithError(f"{target.source}: no lm_head.weight and embeddings not tied")
        head = embed
    return embed.float(), head.float()
