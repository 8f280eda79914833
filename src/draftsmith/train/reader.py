"""Samples of a dataset folder read with one `pread` per tensor slice.

`data.shards.Dataset` memory-maps the shards; a training step then faults in tens of MB one
page at a time, which on some VMs (the lent GPU machines) costs more than the step's compute.
This reader follows the same shard contract (docs/structure.md) and safetensors' layout: an
8-byte little-endian header length, a JSON header of dtype/shape/data_offsets, then the data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.shards import (
    OPEN_SHARDS,
    SAFETENSORS_DTYPES,
    check_widths,
    meta_fault,
    reading,
    refuse_other,
    refuse_relabelled,
)
from draftsmith.errors import DraftsmithError

DTYPES = {code: getattr(torch, name) for code, name in SAFETENSORS_DTYPES.items()}
TENSORS = ("input_ids", "loss_mask", "aux", "hidden")


class ShardReader:
    """`[i] -> dict(input_ids, loss_mask, aux, hidden)` like `Dataset`, for the same folder.

    Each shard's layout is read once; at most `open_shards` files stay open (the least recently
    used closed first), so a dataset of more shards than the open-file limit reads."""

    def __init__(self, dataset: Any, open_shards: int = OPEN_SHARDS) -> None:
        self.ds = dataset
        self.folder = dataset.folder
        self.shards = dataset.shards
        self.open_shards = open_shards
        self._meta: dict[int, tuple[dict[str, Any], int, list[int]]] = {}
        self._fds: OrderedDict[int, int] = OrderedDict()
        # each shard's file as first opened: one opened again later (a loader worker, the LRU)
        # must be that file, not one a `data make` rerun has since put in its place
        self._stamps: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.ds)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": OrderedDict()}  # descriptors stay with their process

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem(last=False)[1])

    def __del__(self) -> None:
        if getattr(self, "_fds", None):
            self.close()

    def sample_id(self, i: int) -> str:
        return self.ds.sample_id(i)

    def check_shapes(self, n_aux: int, hidden: int) -> None:
        """Each shard's states as the manifest says (`n_aux` aux layers of `hidden`): a shard of
        other aux layers or of another target would fail inside the first step instead."""
        for i in range(len(self.shards)):
            path = self._path(i)
            fd = self._opened(i, anew=True)
            try:
                with reading(path):
                    header = _header(fd)
                    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
            finally:
                os.close(fd)
            check_widths(path, shapes, n_aux, hidden)
            _check_layout(path, header)
            self._check_meta(i, header)

    def check_hashes(self, samples: int, known: dict[str, Any],
                     part: tuple[int, int] = (0, 1),
                     say: Callable[[str], None] | None = None) -> dict[str, list[int]]:
        """The shards holding the first `samples` samples against their manifest's sha256, the
        file as this run opened it (`check_shapes`): each hashed unless `known` (a checkpoint's)
        records it unchanged on disk since (inode, size, mtime, ctime; `known_stamps`: one,
        or each host's copy's); those to hash split over `part` (this rank's index among the
        ranks of its host, their count), a thread a few.
        Returns every used shard's stamp, for checkpoints. Refused naming the shard; `say`
        told of a check of more than a GiB (it reads the shards once)."""
        used = range(used_shards(self.shards, samples))
        stamps = {k: self._stamp_of(k) for k in used}
        stale = [k for k in used if self.shards[k].get("sha256")
                 and stamps[k] not in known_stamps(known.get(self.shards[k]["file"]))]
        size = sum(int(self.shards[k].get("bytes", 0)) for k in stale)
        if say is not None and size > 1 << 30:
            say(f"checking {len(stale)} shard(s) of {self.folder} ({size / (1 << 30):.1f} GiB) "
                "against the manifest's sha256 (once a run: --resume checks only those changed "
                "on disk since)")
        mine = stale[part[0] :: part[1]]
        if mine:
            threads = max(1, min(8, len(mine), (os.cpu_count() or 1) // part[1]))
            pool = ThreadPoolExecutor(threads)
            try:
                for _ in pool.map(self._check_hash, mine):
                    pass
            finally:
                pool.shutdown(cancel_futures=True)
        return {self.shards[k]["file"]: stamps[k] for k in used}

    def _stamp_of(self, k: int) -> list[int]:
        if k not in self._stamps:
            os.close(self._opened(k))
        return list(self._stamps[k][1:])  # not the device: its number may change on a reboot

    def _check_hash(self, k: int) -> None:
        path, want = self._path(k), self.shards[k]["sha256"]
        fd = self._opened(k)
        try:
            digest = sha256_fd(fd, path)
            self._unchanged(k, fd)
        finally:
            os.close(fd)
        if digest != want:
            raise DraftsmithError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's {want[:16]}...: "
                "the shard changed since its capture (corrupted, or written again), so training "
                "would read other data; capture the dataset again (`draftsmith data inspect` "
                "checks every shard)")

    def _fd(self, k: int) -> int:
        if k in self._fds:
            self._fds.move_to_end(k)
            return self._fds[k]
        fd = self._opened(k)
        while len(self._fds) >= max(1, self.open_shards):
            os.close(self._fds.popitem(last=False)[1])
        self._fds[k] = fd
        return fd

    def _opened(self, k: int, anew: bool = False) -> int:
        """Shard `k` opened, refused where it is no longer the file first opened; `anew`: the
        file as it is now is the one to read (its header read again)."""
        fd = _open(self._path(k))
        stamp = _stamp(fd)
        if anew and self._stamps.get(k) != stamp:
            self._stamps[k] = stamp
            self._meta.pop(k, None)
        self._stamps.setdefault(k, stamp)
        try:
            self._unchanged(k, fd, stamp)
        except DraftsmithError:
            os.close(fd)
            raise
        return fd

    def _unchanged(self, k: int, fd: int, stamp: tuple[int, ...] | None = None) -> None:
        """Refuse shard `k` where the file `fd` names is not the one first opened: replaced
        (another inode) or rewritten in place (size, mtime or ctime; `cp -p` keeps the mtime,
        not the ctime). One fstat, after a read, so a write during it is seen too."""
        if (stamp or _stamp(fd)) != self._stamps[k]:
            raise DraftsmithError(
                f"{self._path(k)}: the shard changed on disk since this run opened {self.folder} "
                "(a `data make` or `data capture` rerun into it?), so it no longer holds the "
                "samples the run planned on; the checkpoints written are kept: once the dataset "
                "is final, rerun with --resume (refused where its samples changed) or train "
                "into another --out"
            )

    def _path(self, k: int) -> Path:
        return Path(self.folder) / self.shards[k]["file"]

    def _shard(self, k: int) -> tuple[int, dict[str, Any], int, list[int]]:
        fd = self._fd(k)
        if k not in self._meta:
            path = self._path(k)
            with reading(path):  # a header cut short or foreign, named by its shard
                header = _header(fd)
                start = 8 + struct.unpack("<Q", os.pread(fd, 8, 0))[0]
                offsets = _read(fd, header["offsets"], start, 0, header["offsets"]["shape"][0],
                                path)
            self._check_meta(k, header)
            self._meta[k] = (header, start, offsets.tolist())
        return (fd, *self._meta[k])

    def _check_meta(self, k: int, header: dict[str, Any]) -> None:
        """Shard `k`'s own metadata (the header just read) against its manifest entry: one
        renamed, or moved here from another dataset of as many bytes, refused by name, not read
        as this one (no hashing; a shard written before its metadata described it passes)."""
        meta = header.get("__metadata__")
        meta = meta if isinstance(meta, dict) else {}
        m = getattr(self.ds, "manifest", None) or {}
        # a manifest whose aux ids were edited: training would record layers it never read
        refuse_relabelled(self._path(k), m, meta, Path(self.folder) / "manifest.json")
        refuse_other(self._path(k), meta_fault(m, self.shards[k], meta, layers=False))

    def loss_masks(self) -> Iterator[torch.Tensor]:
        """Each sample's loss mask in order, one read a shard (no states read); the files it
        opened are closed after, so loader workers forked later inherit none."""
        try:
            for k in range(len(self.shards)):
                fd, header, start, offsets = self._shard(k)
                masks = _read(fd, header["loss_mask"], start, 0, offsets[-1],
                              self._path(k)).bool()
                self._unchanged(k, fd)
                yield from (masks[a:b] for a, b in pairwise(offsets))
        finally:
            self.close()

    def token_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's (input_ids, loss_mask) in order, one read each a shard (no states
        read); the files it opened are closed after, as `loss_masks`."""
        try:
            for k in range(len(self.shards)):
                fd, header, start, offsets = self._shard(k)
                ids, masks = (_read(fd, header[name], start, 0, offsets[-1], self._path(k))
                              for name in ("input_ids", "loss_mask"))
                self._unchanged(k, fd)
                yield from ((ids[a:b].long(), masks[a:b].bool()) for a, b in pairwise(offsets))
        finally:
            self.close()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self.ds.locate(i)
        fd, header, start, offsets = self._shard(k)
        a, b = offsets[j], offsets[j + 1]
        out = {name: _read(fd, header[name], start, a, b, self._path(k)) for name in TENSORS}
        self._unchanged(k, fd)
        out["input_ids"] = out["input_ids"].long()
        out["loss_mask"] = out["loss_mask"].bool()
        return out


def _check_layout(path: Path, header: dict[str, Any]) -> None:
    """The shard holds every tensor the reader takes, of dtypes it reads, a row a token: a
    foreign shard is named up front, not by a KeyError or a short read in a loader worker."""
    missing = [k for k in (*TENSORS, "offsets") if k not in header]
    odd = [f"{k} ({header[k].get('dtype')})" for k in (*TENSORS, "offsets")
           if k in header and header[k].get("dtype") not in DTYPES]
    rows = {header[k]["shape"][0] for k in TENSORS if k in header and header[k].get("shape")}
    problem = (f"no {', '.join(missing)} tensor" if missing else
               f"tensors of dtypes it cannot hold: {', '.join(odd)}" if odd else
               f"tensors of {sorted(rows)} tokens" if len(rows) > 1 else None)
    if problem:
        raise DraftsmithError(f"{path}: holds {problem}: not a shard of this dataset's capture; "
                              "capture the dataset again")


def known_stamps(recorded: Any) -> list[list[int]]:
    """A checkpoint's stamps of one shard: a run's on one host (a stamp) or every host's copy's
    (a list of them, `merged_stamps`)."""
    if not recorded:
        return []
    return [list(s) for s in recorded] if isinstance(recorded[0], list) else [list(recorded)]


def merged_stamps(every: list[dict[str, list[int]]]) -> dict[str, list[list[int]]]:
    """Each shard's stamps as the ranks (hosts) saw it, once each: a --resume on any of those
    hosts hashes only the copies changed since."""
    out: dict[str, list[list[int]]] = {}
    for stamps in every:
        for file, stamp in stamps.items():
            if stamp not in out.setdefault(file, []):
                out[file].append(stamp)
    return out


def _stamp(fd: int) -> tuple[int, ...]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def used_shards(shards: list[dict[str, Any]], samples: int) -> int:
    """How many of the manifest's first shards hold the first `samples` samples."""
    count = 0
    for k, s in enumerate(shards):
        if count >= samples:
            return k
        count += int(s["samples"])
    return len(shards)


def sha256_fd(fd: int, path: Path) -> str:
    """The sha256 of the open file `fd` (shard `path`), read with `pread`: the file the run
    opened, not one put in its place since. hashlib lets go of the GIL: threads hash in
    parallel."""
    h, at = hashlib.sha256(), 0
    try:  # os.pread, as the reader reads: os.preadv is missing on macOS
        while chunk := os.pread(fd, 1 << 22, at):
            h.update(chunk)
            at += len(chunk)
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read the shard ({e.strerror})") from None
    return h.hexdigest()


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot open the shard ({e.strerror})") from None


def _header(fd: int) -> dict[str, Any]:
    n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
    return json.loads(os.pread(fd, n, 8))


def _read(fd: int, info: dict[str, Any], start: int, a: int, b: int,
          path: Path) -> torch.Tensor:
    """Rows a..b of a tensor stored at info['data_offsets'] after `start` in shard `path`."""
    dtype = DTYPES[info["dtype"]]
    shape = info["shape"]
    row = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    buf = bytearray((b - a) * row)
    try:  # an I/O error (EIO, a network file system's ESTALE): named, not a worker's traceback
        got = _pread_into(fd, buf, start + info["data_offsets"][0] + a * row)
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read the shard ({e.strerror or e}): its disk or "
                              "file system failed the read; once it reads again (`draftsmith data "
                              "inspect` on its dataset folder checks every shard), rerun with "
                              "--resume") from None
    if got != len(buf):
        raise DraftsmithError(f"{path}: shard read came back short ({got} of {len(buf)} "
                              "bytes): the file is truncated (`draftsmith data inspect` on its "
                              "dataset folder checks every shard)")
    if not buf:
        return torch.empty(0, *shape[1:], dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(b - a, *shape[1:])


def _pread_into(fd: int, buf: bytearray, at: int) -> int:
    """Bytes read into `buf` from offset `at`: a read may return fewer than asked (Linux stops
    each at 2 GiB, network file systems sooner), so it goes on until `buf` is full or the file
    ends."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.preadv(fd, [view[got:]], at + got)
        if n == 0:
            break
        got += n
    return got
