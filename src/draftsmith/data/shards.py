"""Dataset shards: safetensors files of concatenated samples plus a `manifest.json`.

A shard holds `input_ids` int32 [N], `loss_mask` uint8 [N], `offsets` int64 [S+1],
`aux` [N, n_aux, H] and `hidden` [N, H] in the manifest's `dtype` (bf16). The manifest lists
every finished shard with its counts, size and sha256; a shard's `file` is relative to the
manifest's folder (merged multi-rank datasets point into `rank-R/`). Writes are atomic: tmp
file, fsync, os.replace. Each shard's safetensors metadata describes it alone (`shard_meta`: its
index, counts, tokens digest, aux layer ids and their convention, hidden size, dtype, target
fingerprint), so a reader refuses a shard renamed or moved from another dataset (`meta_fault`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.atomic import fsync_file, make_folder, replacing, write_json
from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_versioned

FORMAT = "draftsmith-dataset"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = ("input_ids", "loss_mask", "offsets", "aux", "hidden")
SHARD_KEYS = {"index": int, "file": str, "samples": int, "tokens": int, "loss_tokens": int,
              "bytes": int, "sha256": str}
TOTALS = ("samples", "tokens", "loss_tokens", "bytes", "shards")  # a manifest's totals
OPEN_SHARDS = 64  # memory-mapped shard files a Dataset keeps open at once
TOKEN_DTYPES = {"input_ids": "int32", "loss_mask": "uint8", "offsets": "int64"}
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                      "U8": "uint8", "BOOL": "bool"}


class ShardDtypeError(DraftsmithError):
    """A shard whose tensors are of other dtypes than its manifest implies."""


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] integer
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, n_aux, H]
    hidden: torch.Tensor  # [T, H]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sha256_file(path: Path) -> str:
    """Read through one reused 1 MiB buffer: no block held beside the next (a shard's writer
    hashes what it wrote with this)."""
    h, buf = hashlib.sha256(), memoryview(bytearray(1 << 20))
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def _not_a_dataset(folder: Path) -> None:
    """A folder without a manifest that holds a dataset's makings, or a dataset's manifest
    given for its folder: named with what to do."""
    if folder.name == MANIFEST and folder.is_file():
        raise DraftsmithError(f"{folder}: the dataset's manifest, not its folder; pass "
                              f"{folder.parent}")
    if any(folder.glob(f"rank-*/{MANIFEST}")):
        raise DraftsmithError(f"{folder}: holds the ranks' captures but no {MANIFEST} joining "
                              f"them: once every rank is done, run `draftsmith data merge "
                              f"{folder}`")
    if (folder / "dataset" / MANIFEST).is_file():
        raise DraftsmithError(f"{folder}: a `data make` folder, not a dataset: its dataset is "
                              f"{folder / 'dataset'}; pass that")


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.exists():
        _not_a_dataset(Path(folder))
    m = read_versioned(path, "not a draftsmith dataset folder", FORMAT, FORMAT_VERSION)
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise DraftsmithError(f"{path}: 'shards' is not a list of shard entries")
    for k, s in enumerate(shards):  # an external tool's manifest: named, not a KeyError
        bad = [f"{key} ({kind.__name__})" for key, kind in SHARD_KEYS.items()
               if not isinstance(s.get(key), kind)]
        if bad:
            raise DraftsmithError(f"{path}: shard entry {k} lacks {', '.join(bad)}")
    _check_fields(path, m)
    return m


def _whole_number(v: Any) -> bool:
    return type(v) is int and v >= 1


def _ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(i) is int for i in v)


def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(type(v[k]) is int for k in TOTALS if k in v)


# a manifest key -> (the test its value passes where the manifest holds it, what it must be)
FIELDS: dict[str, tuple[Any, str]] = {
    "hidden_size": (_whole_number, "a whole number >= 1"),
    "vocab_size": (_whole_number, "a whole number >= 1"),
    "aux_layer_ids": (_ids, "a list of integer layer ids"),
    "dtype": (lambda v: isinstance(v, str), "a dtype name such as bfloat16"),
    "complete": (lambda v: isinstance(v, bool), "true or false"),
    "target": (lambda v: isinstance(v, dict), "a JSON object"),
    "totals": (_counts, "an object of whole-number counts"),
}
NULLABLE = ("dtype", "complete", "totals")  # null: bfloat16, not complete, none recorded


def _check_fields(path: Path, m: dict[str, Any]) -> None:
    """Each key the readers do arithmetic on is of its kind where the manifest holds it: an
    edited or external manifest named by key, not a ValueError inside training or the doctor
    (a key left out is named where it is needed, `required`)."""
    held = dict(m)
    if isinstance(m.get("target"), dict) and m["target"].get("num_layers") is not None:
        held["target.num_layers"] = m["target"]["num_layers"]
    tests = {**FIELDS, "target.num_layers": FIELDS["hidden_size"]}
    for key, (fits, kind) in tests.items():
        if key not in held or (held[key] is None and key in NULLABLE):
            continue
        v = held[key]
        if not fits(v):
            raise DraftsmithError(f"{path}: {key} is {v!r}, not {kind}; capture the dataset "
                                  "again or correct the manifest")


def required(m: dict[str, Any], key: str, path: Path) -> Any:
    """A manifest key a reader cannot do without (checked by `read_manifest` where present)."""
    if m.get(key) is None:
        raise DraftsmithError(f"{path}: no {key} in the manifest; capture the dataset with "
                              "`draftsmith data capture`")
    return m[key]


def is_complete(m: dict[str, Any]) -> bool:
    """Whether a manifest's capture finished: `complete` false is one killed or still running;
    a manifest without the flag (an external tool's, an older one) is whole, as train and the
    doctor read it."""
    return bool(m.get("complete", True))


def rank_part(m: dict[str, Any]) -> str | None:
    """What a rank's folder of a multi-process capture is ("rank R's part of a W-process
    capture"), else None: its shards are every W-th of the whole, `complete` once it is done."""
    world, rank = m.get("world_size", 1), m.get("rank")
    if isinstance(world, int) and world > 1 and rank is not None:
        return f"rank {rank}'s part of a {world}-process capture"
    return None


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Any failure to read the shard at `path` (SafetensorError, OSError, a tensor missing or
    of another shape: a truncated or foreign file) as an error naming it."""
    try:
        yield
    except DraftsmithError:
        raise
    except Exception as e:
        raise DraftsmithError(f"{path}: unreadable shard ({e})") from None


def open_shard(path: Path) -> Any:
    """safetensors' memory-mapped handle; a missing or damaged file is an error naming it."""
    from safetensors import safe_open

    if not path.is_file():
        raise DraftsmithError(f"{path}: shard listed in the manifest is missing")
    with reading(path):
        return safe_open(str(path), framework="pt")


def pack(samples: list[Sample]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    lens = [int(s.input_ids.numel()) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s.input_ids.reshape(-1) for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask.reshape(-1) for s in samples]).to(torch.uint8),
        "offsets": offsets,
        "aux": torch.cat([s.aux for s in samples]).to(torch.bfloat16),
        "hidden": torch.cat([s.hidden for s in samples]).to(torch.bfloat16),
    }
    meta = {"sample_ids": json.dumps([s.sample_id for s in samples])}
    return {k: v.contiguous() for k, v in tensors.items()}, meta


def tokens_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A shard's input_ids and loss_mask as stored: its own in the manifest entry and in its
    metadata, so a shard of another dataset in its place is told apart without hashing it."""
    h = hashlib.sha256(tensors["input_ids"].numpy().tobytes())
    h.update(tensors["loss_mask"].numpy().tobytes())
    return h.hexdigest()[:16]


def shard_meta(m: dict[str, Any], index: int, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What a reader needs of the shard without its manifest (safetensors metadata: strings)."""
    target = m.get("target") if isinstance(m.get("target"), dict) else {}
    meta = {"format": f"{FORMAT} shard", "index": str(index),
            "samples": str(len(tensors["offsets"]) - 1),
            "tokens": str(int(tensors["input_ids"].numel())),
            "tokens_sha256": tokens_sha256(tensors),
            "dtype": str(tensors["aux"].dtype).removeprefix("torch."),
            "hidden_size": str(int(tensors["hidden"].shape[-1])),
            "aux_layer_ids": json.dumps(m.get("aux_layer_ids")),
            "aux_convention": str(m.get("aux_convention") or ""),
            "target_fingerprint": str(target.get("fingerprint") or "")}
    return {k: v for k, v in meta.items() if v not in ("", "null")}


def meta_fault(m: dict[str, Any], entry: dict[str, Any], meta: dict[str, str],
               layers: bool = True) -> str | None:
    """How a shard's metadata (`shard_meta`) disagrees with its manifest entry and manifest,
    in words, else None; a shard written before its metadata described it passes. `layers`
    False: the aux ids and hidden size left to the reader's caller, which names a manifest's
    own faults in them (train's checks against the target)."""
    target = m.get("target") if isinstance(m.get("target"), dict) else {}
    want = {"index": entry.get("index"), "samples": entry.get("samples"),
            "tokens": entry.get("tokens"), "tokens_sha256": entry.get("tokens_sha256"),
            "target_fingerprint": target.get("fingerprint")}
    if layers:
        want |= {"hidden_size": m.get("hidden_size"),
                 "aux_layer_ids": None if m.get("aux_layer_ids") is None
                 else json.dumps(m["aux_layer_ids"])}
    for key, value in want.items():
        if value is not None and key in meta and meta[key] != str(value):
            return f"its metadata says {key} {meta[key]}, the manifest {value}"
    return None


def shard_fault(path: Path, m: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """Why the file at `path` is not the shard `entry` lists (missing, cut short, unreadable,
    another shard by its metadata), else None: resume's check, a header read per shard."""
    from safetensors import safe_open

    if not path.is_file():
        return "listed in the manifest but missing"
    if not whole_file(path, int(entry["bytes"])):
        return cut_short(path, entry)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:
        return f"unreadable ({e})"
    return meta_fault(m, entry, meta)


def cut_short(path: Path, entry: dict[str, Any]) -> str:
    return (f"{path.stat().st_size} bytes, the manifest says {entry['bytes']} (cut short by a "
            "crash or a full disk, or written again since)")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                kept: str) -> tuple[int, str]:
    """The shard at `path` whole or not at all (tmp file, fsync, os.replace), written by
    safetensors' `save_file` from the tensors' own memory (`save` returned it as bytes, twice its
    size more at the peak) and hashed as read back. Returns (bytes, sha256); `kept` ends the
    error a failed write gives."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    # a full disk: no tmp file is left, the shards before are listed
    with replacing(path, kept, (OSError, SafetensorError)) as tmp:
        save_file(tensors, tmp, metadata=meta)
        sort_metadata(tmp)
        digest = sha256_file(tmp)
        fsync_file(tmp)
        size = tmp.stat().st_size
    return size, digest


def sort_metadata(path: Path) -> None:
    """Rewrite the safetensors header at `path` with its metadata keys sorted, in place and of
    the same length: safetensors writes them in a random order (a Rust HashMap), and a rerun's
    shard must be the same bytes as the first run's."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        meta = head.pop("__metadata__", None)
        if not meta:
            return
        raw = json.dumps({"__metadata__": dict(sorted(meta.items())), **head},
                         separators=(",", ":"), ensure_ascii=False).encode()
        if len(raw) <= n:  # a reorder keeps the length; padding as safetensors pads
            f.seek(8)
            f.write(raw.ljust(n, b" "))


def check_samples(path: Path, m: dict[str, Any], samples: list[Sample]) -> None:
    """Each sample one id, mask bit, aux row and hidden row a token, of the widths `m` names:
    a model of another target (capture's `model=`) refused before its states are written
    under this manifest's hidden_size and aux ids."""
    ids, h = m.get("aux_layer_ids"), m.get("hidden_size")
    for s in samples:
        rows = [int(s.input_ids.numel()), int(s.loss_mask.numel()), len(s.aux), len(s.hidden)]
        if len(set(rows)) > 1:
            raise DraftsmithError(f"{path}: sample {s.sample_id!r}: {rows[0]} input_ids, "
                                  f"{rows[1]} loss_mask, {rows[2]} aux and {rows[3]} hidden "
                                  "rows, not one of each a token; nothing written")
        aux, hidden = list(s.aux.shape[1:]), list(s.hidden.shape[1:])
        if (len(aux) != 2 or len(hidden) != 1 or aux[1] != hidden[0]
                or isinstance(ids, list) and aux[0] != len(ids)
                or h is not None and hidden[0] != h):
            raise DraftsmithError(
                f"{path}: sample {s.sample_id!r} holds aux states {aux} and hidden {hidden} a "
                f"token, but the manifest says {len(ids) if isinstance(ids, list) else '?'} aux "
                f"layers of {h}: states of another model than its target; nothing written")


class ShardWriter:
    """Writes numbered shards into `folder` and keeps its manifest true after each one.

    `header` holds everything that identifies the run (target, layers, settings); reopening a
    folder whose manifest has a different header is refused, so a resumed run cannot mix data;
    `redo` tells how to start over.
    """

    def __init__(self, folder: Path, header: dict[str, Any], identity: tuple[str, ...],
                 redo: str = "use another folder or --overwrite") -> None:
        self.folder = make_folder(Path(folder))
        self.lost: list[str] = []
        path = self.folder / MANIFEST
        if path.is_file():
            old = read_manifest(self.folder)
            check_identity(self.folder, old, header, identity, redo)
            self.manifest = old
            self._forget_lost()
        else:
            self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **header,
                             "shards": [], "complete": False}
            self.manifest["totals"] = totals(self.manifest["shards"])
            write_json(path, self.manifest)

    def _forget_lost(self) -> None:
        """Shards listed but gone, of another size (deleted to be redone, cut short), unreadable
        or another shard by their metadata (renamed, moved here) are written again, not counted
        done; `lost` says which and why, for the caller to tell."""
        shards = self.manifest["shards"]
        faults = {s["index"]: shard_fault(self.folder / s["file"], self.manifest, s)
                  for s in shards}
        self.lost = [f"{self.folder / s['file']}: {faults[s['index']]}" for s in shards
                     if faults[s["index"]]]
        kept = [s for s in shards if not faults[s["index"]]]
        if len(kept) < len(shards):
            self.manifest.update(shards=kept, totals=totals(kept), complete=False)
            write_json(self.folder / MANIFEST, self.manifest)

    def done(self) -> set[int]:
        return {int(s["index"]) for s in self.manifest["shards"]}

    def write(self, index: int, samples: list[Sample]) -> dict[str, Any]:
        if not samples:
            raise DraftsmithError(f"shard {index}: no samples")
        name, kept = shard_name(index), self._kept()
        check_samples(self.folder / name, self.manifest, samples)
        tensors, meta = pack(samples)
        meta |= shard_meta(self.manifest, index, tensors)
        size, digest = write_shard(self.folder / name, tensors, meta, kept)
        entry = {
            "index": index,
            "file": name,
            "samples": len(samples),
            "tokens": int(tensors["input_ids"].numel()),
            "loss_tokens": int(tensors["loss_mask"].sum()),
            "bytes": size,
            "sha256": digest,
            "tokens_sha256": meta["tokens_sha256"],
        }
        shards = [s for s in self.manifest["shards"] if s["index"] != index] + [entry]
        self.manifest["shards"] = sorted(shards, key=lambda s: s["index"])
        self.manifest["totals"] = totals(self.manifest["shards"])
        write_json(self.folder / MANIFEST, self.manifest, kept)
        return entry

    def _kept(self) -> str:
        """What a failed shard write (a full disk, a permission) leaves, and how to go on."""
        done = len(self.manifest["shards"])
        return (f"nothing is left half-written, and the {done} shard(s) finished before this one "
                "are kept: free space (or fix the permission) and rerun the same command to go on")

    def finish(self, **extra: Any) -> None:
        self.manifest.update(extra)
        self.manifest["complete"] = True
        write_json(self.folder / MANIFEST, self.manifest)

    def update(self, **extra: Any) -> None:
        self.manifest.update(extra)
        write_json(self.folder / MANIFEST, self.manifest)


def check_identity(folder: Path, old: dict[str, Any], header: dict[str, Any],
                   identity: tuple[str, ...], redo: str) -> None:
    """Refuse `folder`'s manifest `old` where a setting of `identity` is not `header`'s."""
    for key in identity:
        if not same_setting(key, old.get(key), header.get(key)):
            raise DraftsmithError(f"{folder}: holds a dataset made with a different {key} "
                                  f"({old.get(key)!r} there, {header.get(key)!r} now); {redo}")


def intact(folder: Path, m: dict[str, Any]) -> set[int]:
    """The indices of the shards `m` lists whose files in `folder` are whole (`shard_fault`):
    those a ShardWriter opened on it counts done."""
    return {int(s["index"]) for s in m["shards"] if not shard_fault(folder / s["file"], m, s)}


def same_setting(key: str, there: Any, now: Any) -> bool:
    """Whether a manifest's `key` is this run's: a target is the same by its fingerprint and
    hashes, however its path was typed (relative, absolute, through a link); a manifest made
    before `tokenization_hash` was recorded is compared without it, one made before
    `tokens_digest` was (its input told by `source_digest` alone) without that."""
    if key == "tokens_digest" and None in (there, now):
        return True
    if key == "target" and isinstance(there, dict) and isinstance(now, dict):
        both = "tokenization_hash" in there and "tokenization_hash" in now
        skip = {"source"} if both else {"source", "tokenization_hash"}
        there, now = ({k: v for k, v in d.items() if k not in skip} for d in (there, now))
    return there == now


def whole_file(path: Path, size: int) -> bool:
    """Whether `path` is a file of `size` bytes (a shard as its manifest lists it)."""
    return path.is_file() and path.stat().st_size == size


def totals(shards: list[dict[str, Any]]) -> dict[str, int]:
    return {k: sum(int(s[k]) for s in shards) for k in TOTALS[:-1]} | {"shards": len(shards)}


class Dataset:
    """Random access to the samples of a dataset folder (safetensors files are memory-mapped)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.shards = self.manifest["shards"]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + int(s["samples"]))
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(required(self.manifest, "aux_layer_ids", self.folder / MANIFEST))

    @property
    def hidden_size(self) -> int:
        return int(required(self.manifest, "hidden_size", self.folder / MANIFEST))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    def locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)}")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def _handle(self, k: int):
        if k in self._open:
            self._open[k] = self._open.pop(k)  # most recently used last
            return self._open[k]
        path = self.folder / self.shards[k]["file"]
        handle = self._open_shard(k, path)
        if k not in self._offsets:
            with reading(path):  # no offsets tensor: not a shard this draftsmith wrote
                offsets = handle.get_tensor("offsets").tolist()
            if len(offsets) != int(self.shards[k]["samples"]) + 1:
                raise DraftsmithError(f"{path}: offsets for {len(offsets) - 1} samples, the "
                                      f"manifest says {self.shards[k]['samples']}")
            meta = handle.metadata() or {}
            refuse_other(path, meta_fault(self.manifest, self.shards[k], meta, layers=False))
            self._offsets[k] = offsets
        if len(self._open) >= OPEN_SHARDS:
            self._open.pop(next(iter(self._open)))
        self._open[k] = handle
        return handle

    def _open_shard(self, k: int, path: Path) -> Any:
        """`open_shard`; a file that does not open and is not of its listed size is named as cut
        short (a crash, a full disk), not by safetensors' words."""
        try:
            return open_shard(path)
        except DraftsmithError:
            if not path.is_file() or whole_file(path, int(self.shards[k]["bytes"])):
                raise
            raise DraftsmithError(f"{path}: unreadable shard: {cut_short(path, self.shards[k])};"
                                  " capture the dataset again (a rerun of its capture redoes it)"
                                  ) from None

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self.locate(i)
        f = self._handle(k)
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        with reading(self._path(k)):  # a tensor missing: another tool's shard, named
            return {
                "input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
                "aux": f.get_slice("aux")[a:b],
                "hidden": f.get_slice("hidden")[a:b],
            }

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample `i`'s input_ids and loss_mask, without reading its hidden states."""
        k, j = self.locate(i)
        f = self._handle(k)
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        with reading(self._path(k)):
            return f.get_slice("input_ids")[a:b].long(), f.get_slice("loss_mask")[a:b].bool()

    def sample_id(self, i: int) -> str:
        k, j = self.locate(i)
        path, meta = self._path(k), self._handle(k).metadata() or {}
        if "sample_ids" not in meta:
            raise DraftsmithError(f"{path}: no sample_ids in its metadata, so not a shard "
                                  "`draftsmith data capture` wrote; capture the dataset again")
        with reading(path):
            return str(json.loads(meta["sample_ids"])[j])

    def _path(self, k: int) -> Path:
        return self.folder / self.shards[k]["file"]

    def lengths(self) -> list[int]:
        out: list[int] = []
        for k in range(len(self.shards)):
            self._handle(k)
            off = self._offsets[k]
            out += [b - a for a, b in zip(off[:-1], off[1:], strict=True)]
        return out

    def verify(self) -> dict[str, int]:
        return verify(self.folder)


def refuse_other(path: Path, fault: str | None) -> None:
    """A shard whose metadata names another shard than its manifest entry: refused by name."""
    if fault:
        raise DraftsmithError(f"{path}: not the shard the manifest lists ({fault}): renamed, or "
                              "moved here from another dataset; put the right file back or "
                              "capture the dataset again")


def verify(folder: str | Path, hashed: Collection[int] | None = None) -> dict[str, int]:
    """Check every shard against the manifest (size, tensor shapes and dtypes, offsets) and the
    sha256 of those at the positions `hashed` in its list (None: every shard); raise
    DraftsmithError naming the first bad one."""
    folder = Path(folder)
    m = read_manifest(folder)
    for k, s in enumerate(m["shards"]):
        _verify_shard(folder, m, s, hashed is None or k in hashed)
    got = totals(m["shards"])
    want = m.get("totals") or got
    for key, value in got.items():
        if int(want.get(key, value)) != value:
            raise DraftsmithError(
                f"{folder / MANIFEST}: totals.{key} is {want[key]} but the shards sum to {value}"
            )
    return got


def tensor_dtypes(m: dict[str, Any]) -> dict[str, str]:
    """Each shard tensor's dtype as a manifest implies it."""
    states = str(m.get("dtype") or "bfloat16")
    return {**TOKEN_DTYPES, "aux": states, "hidden": states}


def check_widths(path: Path, shapes: dict[str, Any], n_aux: int, hidden: int) -> None:
    """The shard at `path` holds, a token, `n_aux` aux states and one hidden state of `hidden`
    (`shapes`: its tensors' shapes): a shard of other aux layers or of another target is named
    up front, not by a shape error inside training's first step."""
    got = {k: list(shapes.get(k, (None,))[1:]) for k in ("aux", "hidden")}
    if got != {"aux": [n_aux, hidden], "hidden": [hidden]}:
        raise DraftsmithError(
            f"{path}: holds aux states {got['aux']} and hidden {got['hidden']} a token, but the "
            f"manifest says {n_aux} aux layers of {hidden}: a shard of another capture; capture "
            "the dataset again")


def _verify_shard(folder: Path, m: dict[str, Any], s: dict[str, Any], hashed: bool) -> None:
    path = folder / s["file"]
    if not path.is_file():
        raise DraftsmithError(f"{path}: shard listed in the manifest is missing")
    size = path.stat().st_size
    if size != int(s["bytes"]):
        raise DraftsmithError(f"{path}: {size} bytes, the manifest says {s['bytes']} (a shard "
                              "cut short or written again since)")
    digest = sha256_file(path) if hashed else s["sha256"]
    if digest != s["sha256"]:
        raise DraftsmithError(
            f"{path}: sha256 {digest[:16]}... does not match the manifest's {s['sha256'][:16]}..."
        )
    # a corrupt header whose sha256 matched a wrong manifest
    with open_shard(path) as f, reading(path):
        slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
        shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
        dtypes = {k: SAFETENSORS_DTYPES.get(str(v.get_dtype()), str(v.get_dtype()))
                  for k, v in slices.items()}
        offsets = f.get_tensor("offsets")
        meta = f.metadata() or {}
    n, samples = int(s["tokens"]), int(s["samples"])
    where = folder / MANIFEST
    n_aux, h = len(required(m, "aux_layer_ids", where)), int(required(m, "hidden_size", where))
    check_widths(path, shapes, n_aux, h)
    want = {"input_ids": (n,), "loss_mask": (n,), "offsets": (samples + 1,),
            "aux": (n, n_aux, h), "hidden": (n, h)}
    for key, shape in want.items():
        if shapes.get(key) != shape:
            raise DraftsmithError(
                f"{path}: tensor {key} has shape {shapes.get(key)}, the manifest implies {shape}"
            )
    kinds = tensor_dtypes(m)
    bad = {k: dtypes[k] for k, v in kinds.items() if dtypes[k] != v}
    if bad:
        raise ShardDtypeError(f"{path}: tensor dtypes {bad}, the manifest implies "
                              f"{ {k: kinds[k] for k in bad} }")
    if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((offsets.diff() <= 0).any()):
        raise DraftsmithError(f"{path}: offsets are not increasing from 0 to {n}")
    refuse_relabelled(path, m, meta, where)
    refuse_other(path, meta_fault(m, s, meta))


def refuse_relabelled(path: Path, m: dict[str, Any], meta: dict[str, str], where: Path) -> None:
    """A shard whose metadata names other aux layers than its manifest `m` (at `where`): a
    manifest whose aux_layer_ids were edited by hand (every shard then disagrees alike), named
    as such, not as a shard renamed or moved in. `Dataset` reads it still: the doctor's live
    match tells which layers the states are."""
    held, said = meta.get("aux_layer_ids"), m.get("aux_layer_ids")
    if held is None or said is None or held == json.dumps(said):
        return
    raise DraftsmithError(f"{path}: holds the states of aux layers {held} (its metadata), but "
                          f"{where} says {said}: the manifest was edited since the capture, or "
                          "the shard moved here from a capture of other layers; put back "
                          f"aux_layer_ids {held} or capture the dataset again at the layers "
                          "wanted")
