"""Data order and batches: a seeded permutation per epoch, packed into rows of `max_len` tokens.

The epoch's permutation is packed in order (next fit) and its rows dealt out, row j to rank
j mod W; a batch is `batch_size` rows. Every rank takes the same steps, so an epoch drops fewer
rows than one step of all ranks (W * batch_size), the permutation's tail: other samples each
epoch. The order is a pure function of (lengths, seed, epoch, W, batch_size, max_len), so a
resumed run only needs the global step.
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

import torch

from draftsmith.data.shards import OPEN_SHARDS
from draftsmith.errors import DraftsmithError
from draftsmith.train.ttt import doc_causal_mask

Row = list[tuple[int, int]]  # (sample index, tokens taken from its start)


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]: ...


def pack(order: list[int], lengths: list[int], max_len: int) -> list[Row]:
    """`order` packed next fit into rows of at most `max_len` tokens. A sample longer than that
    fills a row of its own with its first `max_len` tokens: the rest never trains, and its last
    kept token scores nothing (the token after it is cut off)."""
    rows: list[Row] = []
    cur: Row = []
    used = 0
    for i in order:
        n = min(lengths[i], max_len)
        if cur and used + n > max_len:
            rows.append(cur)
            cur, used = [], 0
        cur.append((i, n))
        used += n
    if cur:
        rows.append(cur)
    return rows


PACKINGS = ("global", "per_rank")


class Plan:
    """`packing` "per_rank": each rank packs permutation[r::W] itself and every rank stops at
    the fewest rows (the rest dropped: up to a tenth of the data on 8 ranks), the order of
    multi-rank checkpoints written before "global", which resume in it."""

    def __init__(
        self, lengths: list[int], batch_size: int, max_len: int, world: int, rank: int, seed: int,
        packing: str = "global",
    ) -> None:
        assert packing in PACKINGS, packing
        if len(lengths) < world * batch_size:
            n = len(lengths)
            fix = (f"lower --batch-size to {n // world} or fewer" if n >= world else
                   f"train on {n} rank(s) or fewer")
            raise DraftsmithError(f"{n} samples cannot fill one batch of {batch_size} rows on "
                                  f"each of {world} rank(s); {fix}")
        self.lengths, self.batch_size, self.max_len = lengths, batch_size, max_len
        self.world, self.rank, self.seed, self.packing = world, rank, seed, packing
        self._steps: dict[int, int] = {}
        self._rows: tuple[int, list[Row]] | None = None

    def _pack_epoch(self, e: int) -> None:
        g = torch.Generator().manual_seed((self.seed * 100_003 + e) % (1 << 64))  # same order,
        # and no overflow for a large --seed (torch takes 0 .. 2**64 - 1, a negative as its wrap)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        if self.packing == "per_rank":
            packed = [pack(perm[r :: self.world], self.lengths, self.max_len)
                      for r in range(self.world)]
            rows = min(len(p) for p in packed)
            mine = packed[self.rank]
        else:
            every = pack(perm, self.lengths, self.max_len)
            rows = len(every) // self.world
            mine = every[self.rank :: self.world]
        steps = rows // self.batch_size
        if steps == 0:
            raise DraftsmithError(
                f"epoch {e}: the data packs into {rows} row(s) of {self.max_len} tokens per "
                f"rank, fewer than --batch-size {self.batch_size}; lower --batch-size"
            )
        self._steps[e] = steps
        self._rows = (e, mine)

    def steps_per_epoch(self, e: int) -> int:
        if e not in self._steps:
            self._pack_epoch(e)
        return self._steps[e]

    def locate(self, step: int) -> tuple[int, int]:
        """Global step -> (epoch, batch index within the epoch)."""
        e = 0
        while step >= self.steps_per_epoch(e):
            step -= self.steps_per_epoch(e)
            e += 1
        return e, step

    def rows(self, step: int) -> tuple[int, int, list[Row]]:
        """(epoch, batch index, this rank's rows) of a global step."""
        e, b = self.locate(step)
        if self._rows is None or self._rows[0] != e:
            self._pack_epoch(e)
        rows = self._rows[1]  # type: ignore[index]
        return e, b, rows[b * self.batch_size : (b + 1) * self.batch_size]


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool
    positions: torch.Tensor  # [B, T] long, position within the document
    doc: torch.Tensor  # [B, T] long, -1 = padding
    aux: torch.Tensor | None  # [B, T, n_aux, Ht]
    hidden: torch.Tensor | None  # [B, T, Ht] after the target's final norm
    samples: list[int]
    # (row, start, length) of each document, in `samples`' order: on the host, read unsynced
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def to(self, device: torch.device | str) -> Batch:
        move = {k: getattr(self, k) for k in ("tokens", "loss_mask", "positions", "doc", "aux",
                                              "hidden")}
        moved = {k: None if v is None else v.to(device, non_blocking=True) for k, v in move.items()}
        return Batch(**moved, samples=self.samples, spans=self.spans)

    def pin_memory(self) -> Batch:
        move = {k: getattr(self, k) for k in ("tokens", "loss_mask", "positions", "doc", "aux",
                                              "hidden")}
        return Batch(**{k: None if v is None else v.pin_memory() for k, v in move.items()},
                     samples=self.samples, spans=self.spans)

    @property
    def tokens_used(self) -> int:
        return int((self.doc >= 0).sum())


def collate(source: Source, rows: list[Row], multiple: int = 1, cap: int | None = None) -> Batch:
    """The rows as one batch as wide as the longest, rounded up to `multiple` (at most `cap`):
    fewer distinct shapes, so fewer cuDNN plans and compiled graphs on the GPU. Padding is
    doc -1: no loss, no attention from real tokens."""
    width = max(sum(n for _, n in row) for row in rows)
    rounded = -(-width // multiple) * multiple
    width = rounded if cap is None else max(width, min(rounded, cap))
    b = len(rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    positions = torch.zeros(b, width, dtype=torch.long)
    doc = torch.full((b, width), -1, dtype=torch.long)
    aux: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    samples: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for r, row in enumerate(rows):
        at = 0
        for i, n in row:
            s = source[i]
            tokens[r, at : at + n] = s["input_ids"][:n]
            mask[r, at : at + n] = s["loss_mask"][:n].bool()
            positions[r, at : at + n] = torch.arange(n)
            doc[r, at : at + n] = i
            if "aux" in s:
                if aux is None:
                    aux = s["aux"].new_zeros(b, width, *s["aux"].shape[1:])
                    hidden = s["hidden"].new_zeros(b, width, s["hidden"].shape[-1])
                aux[r, at : at + n] = s["aux"][:n]
                hidden[r, at : at + n] = s["hidden"][:n]
            samples.append(i)
            spans.append((r, at, n))
            at += n
    return Batch(tokens, mask, positions, doc, aux, hidden, samples, spans)


@dataclass
class Failed:
    """A loader worker's DraftsmithError, returned rather than raised: DataLoader re-raises a
    worker's exception with its traceback folded into the message, not as one line."""

    message: str


class StepBatches(torch.utils.data.Dataset):
    """Item k = the batch of global step start + k, as (epoch, batch index, Batch)."""

    def __init__(self, plan: Plan, source: Source, start: int, total: int,
                 multiple: int = 1) -> None:
        self.plan, self.source, self.start, self.total = plan, source, start, total
        self.multiple = multiple

    def __len__(self) -> int:
        return self.total - self.start

    def __getitem__(self, k: int) -> tuple[int, int, Batch] | Failed:
        try:
            e, b, rows = self.plan.rows(self.start + k)
            return e, b, collate(self.source, rows, self.multiple, self.plan.max_len)
        except DraftsmithError as err:
            return Failed(str(err))


def _as_is(item: Any) -> Any:
    return item


PREFETCH = 4  # batches each loader worker reads ahead
# Descriptors a worker's read-ahead holds: each batch's six tensors reach the main process as
# shared-memory files (torch's file_descriptor strategy) and stay open while the batch lives;
# a worker also holds up to OPEN_SHARDS shard files, and ROOM is the rest of the run's files.
WORKER_FILES = PREFETCH * 6 + 4
ROOM = 64


def open_files_needed(workers: int) -> int:
    """Descriptors the busiest process (the main one, or a worker) may hold at once."""
    try:
        now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: a guess of what a process of this size holds
        now = 64
    return now + ROOM + max(workers * WORKER_FILES, OPEN_SHARDS + WORKER_FILES)


def fit_open_files(workers: int) -> None:
    """Raise the soft open-file limit (up to the hard one) where `workers` reading ahead may
    pass it: past it a worker's hand-over fails in torch's pickling, a traceback mid-run."""
    import resource

    need = open_files_needed(workers)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite or soft >= need:
        return
    if hard != infinite and hard < need:
        raise DraftsmithError(
            f"--loader-workers {workers}: reading ahead they may hold about {need} open files, "
            f"more than this process may open ({hard}, the hard limit); raise it (`ulimit -n "
            f"{need}`) or pass fewer --loader-workers (0 reads in the training process)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == infinite else hard, hard))


def batches(plan: Plan, source: Source, start: int, total: int, workers: int = 4,
            pin: bool = False, multiple: int = 1) -> Iterator[tuple[int, int, Batch]]:
    """The batches of steps start..total-1 in order, widths rounded up to `multiple`. Worker
    processes read ahead: reading memory-mapped shards is page faults and copies, which neither
    the GPU nor threads hide. The open-file limit is checked (and raised) here, before any
    batch is read, and the samples the packer cuts are said (`cut_note`)."""
    if plan.rank == 0 and (note := cut_note(plan, source)):
        warnings.warn(note, stacklevel=2)
    ds = StepBatches(plan, source, start, total, multiple)
    if workers == 0:
        return _unfailed(ds[k] for k in range(len(ds)))
    fit_open_files(workers)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, collate_fn=_as_is, pin_memory=pin,
        prefetch_factor=PREFETCH, multiprocessing_context="fork", worker_init_fn=_ignore_ctrl_c,
        # the workers' seeds from a generator of its own: drawn from the global one, each loader
        # (one a run, a resumed run's too) moved the RNG state that checkpoints restore exactly
        generator=torch.Generator(),
    )
    return _unfailed(loader)


def cut_note(plan: Plan, source: Source) -> str:
    """One line on the samples longer than the plan's rows (a capture of longer ones, offline:
    online samples are cut to --max-len before), whose answer tokens past it never train; ""
    where none is. Loss masks only, of the cut samples up to the last of them."""
    cut = [i for i, n in enumerate(plan.lengths) if n > plan.max_len]
    if not cut:
        return ""
    lost = sum(int(mask[plan.max_len :].sum()) for mask in _masks(source, cut))
    longest = max(plan.lengths)
    return (f"--max-len {plan.max_len} cuts {len(cut)} of {len(plan.lengths)} sample(s) (the "
            f"longest has {longest} tokens): {lost} answer token(s) past it never train; raise "
            f"--max-len (up to {longest}) to train on them")


def _masks(source: Source, wanted: list[int]) -> Iterator[torch.Tensor]:
    """The loss masks of samples `wanted` (ascending), through the source's own mask reader
    where it has one (a dataset's: no hidden states read)."""
    own = getattr(source, "loss_masks", None)
    if own is None:
        yield from (source[i]["loss_mask"] for i in wanted)
        return
    want = set(wanted)
    with closing(own()) as masks:  # closed at the last wanted: its shard files too
        for i, mask in enumerate(islice(masks, wanted[-1] + 1)):
            if i in want:
                yield mask


def _ignore_ctrl_c(worker: int) -> None:
    """A terminal's ctrl-C reaches the whole process group, and so does the SIGTERM of
    `timeout` or SLURM: a worker that died of it would fail the step in flight before the
    trainer stops at its checkpoint. The trainer decides; its workers end with it. SIGTERM only
    where the trainer handles it (one process: `loop.Interrupt`); torch's worker loop set its
    own, which dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if callable(signal.getsignal(signal.SIGTERM)):  # the trainer's, inherited through fork
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _unfailed(items: Iterable[Any]) -> Iterator[tuple[int, int, Batch]]:
    for item in items:
        if isinstance(item, Failed):
            raise DraftsmithError(item.message)
        yield item


# dataset shards hold aux and hidden in bf16 (data capture): online states are rounded alike, so
# online training equals offline training on a capture of the same conversations
STATES_DTYPE = torch.bfloat16


@torch.no_grad()
def run_target(model: Any, batch: Batch, aux_ids: tuple[int, ...]) -> Batch:
    """Fill aux and hidden of a token-only batch with a forward of the target (online). A target
    windowing some of its layers only runs each document in a row of its own: a packed row's
    mask would serve every layer alike (windowing them all, or refused past the window)."""
    if getattr(model.cfg, "window_layers", None) is not None:
        batch.aux, batch.hidden = _per_document(model, batch, aux_ids)
        return batch
    mask = doc_causal_mask(batch.doc, model.cfg.sliding_window)
    out = model(batch.tokens, batch.positions, mask=mask, aux_ids=aux_ids, want_logits=False)
    batch.aux, batch.hidden = out.aux.to(STATES_DTYPE), out.hidden.to(STATES_DTYPE)
    return batch


def _per_document(model: Any, batch: Batch, aux_ids: tuple[int, ...],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, hidden) of the packed batch, each document through the target alone and unmasked,
    as data capture runs it (the model gives each layer its own mask), in groups of rows no
    larger than the packed batch."""
    b, t = batch.doc.shape
    aux = hidden = None
    spans = [s for s in batch.spans or _spans(batch.doc) if s[2]]
    for group in _groups(spans, b * t):
        width = group[0][2]
        tokens = batch.tokens.new_zeros(len(group), width)
        for k, (r, a, n) in enumerate(group):
            tokens[k, :n] = batch.tokens[r, a : a + n]
        positions = torch.arange(width, device=tokens.device).expand(len(group), width)
        out = model(tokens, positions, aux_ids=aux_ids, want_logits=False)
        if aux is None or hidden is None:
            aux = out.aux.new_zeros(b, t, *out.aux.shape[2:], dtype=STATES_DTYPE)
            hidden = out.hidden.new_zeros(b, t, out.hidden.shape[-1], dtype=STATES_DTYPE)
        for k, (r, a, n) in enumerate(group):
            aux[r, a : a + n] = out.aux[k, :n]
            hidden[r, a : a + n] = out.hidden[k, :n]
    assert aux is not None and hidden is not None
    return aux, hidden


def _groups(spans: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """The documents longest first, in groups whose rows times their longest fit `budget`."""
    groups: list[list[tuple[int, int, int]]] = []
    for span in sorted(spans, key=lambda s: -s[2]):
        if groups and (len(groups[-1]) + 1) * groups[-1][0][2] <= budget:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def _spans(doc: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of each run of one document id in `doc` (-1: padding)."""
    spans: list[tuple[int, int, int]] = []
    for r, ids in enumerate(doc.tolist()):
        for a, i in enumerate(ids):
            if i < 0:
                continue
            if a and ids[a - 1] == i:
                spans[-1] = (r, spans[-1][1], spans[-1][2] + 1)
            else:
                spans.append((r, a, 1))
    return spans


class TokenSource:
    """Token-only samples (online training): ids and loss masks of tokenised conversations."""

    def __init__(self, samples: list[tuple[list[int], list[bool]]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[i]
        return {"input_ids": torch.tensor(ids, dtype=torch.long),
                "loss_mask": torch.tensor(mask, dtype=torch.bool)}

    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.samples]
