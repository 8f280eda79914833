"""Draft vocabulary: the N most frequent loss-masked target tokens and the d2t/t2d mapping.

Draft index i stands for target token `used[i]` (ascending ids), `d2t[i] = used[i] - i`
(int64, SGLang/EAGLE-3 form: target = i + d2t[i]), `t2d` bool [vocab] marks used tokens.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError


@dataclass
class DraftVocab:
    used: torch.Tensor  # [N] int64 ascending target ids
    d2t: torch.Tensor  # [N] int64
    t2d: torch.Tensor  # [vocab] bool
    coverage: float  # share of loss-masked tokens the draft vocabulary covers
    counted: int  # loss-masked tokens counted
    distinct: int  # distinct loss-masked tokens seen

    def summary(self) -> dict[str, Any]:
        return {"draft_vocab_size": int(self.used.numel()), "target_vocab_size":
                int(self.t2d.numel()), "coverage": self.coverage, "counted_tokens": self.counted,
                "distinct_tokens": self.distinct}


def count_dataset(folder: str | Path, vocab_size: int | None = None) -> torch.Tensor:
    """Frequencies [vocab] of loss-masked tokens over every shard of a dataset folder."""
    from draftsmith.data.shards import open_shard, read_manifest, reading

    folder = Path(folder)
    m = read_manifest(folder)
    size = int(vocab_size or m.get("vocab_size") or 0)
    counts = torch.zeros(max(size, 1), dtype=torch.int64)
    for s in m["shards"]:
        path = folder / s["file"]
        with open_shard(path) as f, reading(path):
            ids = f.get_tensor("input_ids").long()[f.get_tensor("loss_mask").bool()]
        counts = _add(counts, ids)
    return counts


def counted_from(folder: str | Path, m: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a vocab counted over a dataset folder records: the folder, its target and the
    length capture cut each sample at (`max_len`), so the count is train's at that
    `--max-len` or a larger one, not a smaller one's."""
    from draftsmith.data.shards import read_manifest

    m = read_manifest(folder) if m is None else m
    target = m.get("target") if isinstance(m.get("target"), dict) else {}
    return {"dataset": str(folder), "target": target.get("fingerprint"),
            "max_len": m.get("max_len")}


def count_ids(pairs: Iterable[tuple[list[int], list[bool]]], vocab_size: int) -> torch.Tensor:
    """`count_pairs` of (ids, mask) lists, as `encode_conversations` gives them."""
    return count_pairs(((torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))
                        for ids, mask in pairs), vocab_size)


def count_pairs(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int,
                max_len: int | None = None) -> torch.Tensor:
    """Frequencies [vocab] of the loss-masked tokens of (input_ids, loss_mask) tensor pairs,
    each cut at `max_len` as training cuts it (what lies past it is never trained on)."""
    counts = torch.zeros(max(vocab_size, 1), dtype=torch.int64)
    chunk: list[torch.Tensor] = []
    held = 0
    for ids, mask in pairs:
        chunk.append(ids[:max_len].long()[mask[:max_len].bool()])
        held += chunk[-1].numel()
        if held >= COUNT_CHUNK:  # one bincount over many samples, not one each
            counts, chunk, held = _add(counts, torch.cat(chunk)), [], 0
    return _add(counts, torch.cat(chunk)) if chunk else counts


COUNT_CHUNK = 1 << 22  # tokens gathered before a bincount over the whole vocab


def _add(counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if ids.numel() and int(ids.max()) >= counts.numel():
        counts = torch.cat([counts, counts.new_zeros(int(ids.max()) + 1 - counts.numel())])
    return counts + torch.bincount(ids, minlength=counts.numel())


def build_vocab(counts: torch.Tensor, draft_size: int, vocab_size: int | None = None) -> DraftVocab:
    vocab_size = vocab_size or counts.numel()
    if counts.numel() > vocab_size:
        raise DraftsmithError(
            f"token id {counts.nonzero().max().item()} is outside the target vocab {vocab_size}"
        )
    if draft_size < 1:
        raise DraftsmithError(f"draft vocab size must be >= 1, got {draft_size}")
    total, distinct = int(counts.sum()), int((counts > 0).sum())
    if total == 0:
        raise DraftsmithError("no loss-masked tokens to count: the data has no assistant tokens; "
                              "count conversations with answers (`data regenerate`'s output) "
                              "or a dataset captured from them")
    n = draft_size
    if distinct < draft_size:
        warnings.warn(f"only {distinct} distinct assistant tokens for a draft vocab of "
                      f"{draft_size}: using {distinct}", stacklevel=2)
        n = distinct
    # stable sort: ties go to the lower token id, so the choice is deterministic
    top = torch.sort(-counts, stable=True).indices[:n]
    used = torch.sort(top).values.to(torch.int64)
    d2t = used - torch.arange(n, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return DraftVocab(used, d2t, t2d, float(counts[used].sum()) / total, total, distinct)


def save_vocab(v: DraftVocab, folder: str | Path, extra: dict[str, Any] | None = None,
               fix: str | None = None) -> Path:
    """`fix`: what to do where a write fails (`data vocab`'s --out, where not given)."""
    from safetensors.torch import save

    from draftsmith.data.atomic import atomic_write, make_folder, write_json

    folder = make_folder(Path(folder))
    # the old summary goes first: a failure between the two writes leaves the new vocabulary
    # without a summary, never beside the summary of another one
    try:
        (folder / "vocab.json").unlink(missing_ok=True)
    except OSError as e:
        raise DraftsmithError(f"{folder / 'vocab.json'}: cannot replace it ({e.strerror or e}); "
                              f"{fix or 'make the folder writable, or give another --out'}"
                              ) from None
    kept = {"kept": fix} if fix else {}  # vocab.json gone by then: not "unchanged"
    atomic_write(folder / "vocab.safetensors", save({"d2t": v.d2t, "t2d": v.t2d}), **kept)
    write_json(folder / "vocab.json", {**v.summary(), **(extra or {})}, **kept)
    return folder / "vocab.safetensors"


def made_by(folder: str | Path) -> str:
    """Who made the vocab.safetensors in `folder`, as its vocab.json records it ("" where it
    records nothing)."""
    try:
        rec = vocab_json(folder)
    except (OSError, ValueError):
        return ""
    command = rec.get("command") if isinstance(rec, dict) else None
    return f"made by `{command}`" if isinstance(command, str) and command else ""


def existing_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (d2t, t2d) of a vocabulary already at `path`; None where none is there or it cannot
    be read."""
    if not path.is_file():
        return None
    try:
        return load_vocab(path)
    except DraftsmithError:
        return None


def replacing(path: Path, v: DraftVocab) -> str | None:
    """What writing `v` at `path` replaces: the old vocabulary's draft tokens (in words where it
    cannot be read); None where there is none or it is `v`'s own."""
    if not path.is_file():
        return None
    old = existing_vocab(path)
    if old is None:
        return "an unreadable one"
    if torch.equal(old[0], v.d2t) and torch.equal(old[1], v.t2d):
        return None
    return str(old[0].numel())


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "vocab.safetensors"
    if not path.is_file():
        raise DraftsmithError(f"{path}: no draft vocabulary file")
    try:
        t = load_file(str(path))
    except Exception as e:  # SafetensorError: not a safetensors file, or a damaged one
        raise DraftsmithError(f"{path}: not a draft vocabulary file ({e})") from None
    if "d2t" not in t or "t2d" not in t:
        raise DraftsmithError(f"{path}: holds {sorted(t)}, a draft vocabulary holds d2t and t2d")
    return t["d2t"], t["t2d"]


def map_problem(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int,
                ) -> tuple[torch.Tensor, tuple[str, str] | None]:
    """(the target ids d2t maps the draft ids to, the first way the map fails to be one to one
    into [0, vocab): ("outside" | "twice" | "t2d", what), or None)."""
    used = torch.arange(d2t.numel()) + d2t.long()
    bad = ((used < 0) | (used >= vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        return used, ("outside", f"{bad.numel()} draft ids map outside the target vocab "
                                 f"[0, {vocab}), e.g. draft {i} -> {int(used[i])}")
    if used.unique().numel() != used.numel():
        return used, ("twice", "d2t maps several draft ids to one target id")
    if t2d is not None and (t2d.numel() != vocab or not bool(t2d.bool()[used].all())
                            or int(t2d.bool().sum()) != used.numel()):
        return used, ("t2d", f"t2d marks {int(t2d.bool().sum())} tokens, not exactly the "
                             f"{used.numel()} d2t maps to")
    return used, None


def coverage_table(counts: torch.Tensor, sizes: Iterable[int]) -> list[tuple[int, float]]:
    """(draft size, coverage) for each size: what a smaller or larger vocabulary would reach."""
    total = int(counts.sum())
    s = torch.sort(counts, descending=True).values.cumsum(0)
    return [(n, float(s[min(n, s.numel()) - 1]) / total) for n in sizes if total]


def vocab_json(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "vocab.json").read_text())
