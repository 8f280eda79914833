"""`train(TrainConfig)`: EAGLE-3 training-time-test training, offline or online, under torchrun.

Writes into `out`: the drafter (`draftsmith.json` + `model.safetensors`), `train_log.jsonl`,
`train_curves.png` and `checkpoints/`. With `resume`, the latest checkpoint's weights,
optimizer, scheduler, data position and RNG continue the run exactly.

Loss weighting under DDP: each rank's loss is the mean over its own counted positions (per TTT
step, steps weighted decay^j), and DDP averages the ranks' gradients; a rank whose batch counts
few positions weighs as much as one that counts many (no mean over the global batch's
positions). The logged loss is the ranks' mean. SpecForge also normalizes per rank (over its
batch's positions) and lets DDP average the ranks.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.data.atomic import make_folder
from draftsmith.data.pipeline import RUN_MARKERS  # its files' names: data make refuses them
from draftsmith.data.progress import on_terminal
from draftsmith.data.shards import Dataset
from draftsmith.errors import DraftsmithError
from draftsmith.measured import figure
from draftsmith.models.eagle3 import (
    CONFIG_FILE,
    NORM_FLAGS,
    WEIGHTS_FILE,
    Eagle3Config,
    Eagle3Drafter,
    load_drafter,
    read_drafter_meta,
    save_drafter,
)
from draftsmith.options import check_folder
from draftsmith.targets import portable_source
from draftsmith.train import checkpoint as ckpt
from draftsmith.train import report
from draftsmith.train.batches import Batch, Plan, batches, run_target
from draftsmith.train.dist import DistCtx, ranked, setup, shared_failure, who
from draftsmith.train.objective import (
    Targets,
    chain_counts,
    compiled_step_loss,
    counted_positions,
    make_targets,
    measured_words,
    step_loss,
    summarize,
)
from draftsmith.train.profile import WARMUP, StepProfiler
from draftsmith.train.reader import merged_stamps
from draftsmith.train.sources import (
    Data,
    check_whole,
    counted_longer,
    open_offline,
    open_online,
    read_vocab,
    resolve_target,
    target_head,
)
from draftsmith.train.ttt import unroll

# A first window whose draft vocab holds the target's next token at fewer assistant positions
# than this is warned: on the default target 4,096 tokens already cover 0.88-0.92 of its answers
# and 8,192 0.95-0.96 (benchmarks/draft_vocab_coverage.md), so below 0.85 the vocab is smaller
# than that or counted on other answers, and acceptance stays under it at every position.
COVERAGE_FLOOR = 0.85

# DDP broadcasts its rebuilt gradient buckets in its second forward (once a process): until
# then a rank's loader error is shared before the forward too, or the others would wait there
DDP_REBUILD_STEPS = 2

# (options, bound, strict): each option > bound (strict) or >= bound, unless None
RANGES = (
    (("ttt_steps", "batch_size", "max_len", "epochs", "log_every", "save_every", "keep_last",
      "max_steps", "max_samples", "draft_vocab_size", "num_layers", "intermediate_size",
      "pad_multiple"), 1, False),
    (("min_lr", "weight_decay", "warmup_ratio", "warmup_steps", "profile_steps", "time_limit",
      "loader_workers"), 0, False),
    (("lr", "step_decay", "grad_clip"), 0, True),
)


@dataclass
class TrainConfig:
    out: str
    data: str | None = None  # dataset folder (offline)
    prompts: str | None = None  # conversations with answers (online)
    target: str | None = None  # default: the dataset's target, else the embedded default
    ttt_steps: int = 7
    step_decay: float = 0.8
    lr: float = 1e-4
    min_lr: float = 0.0
    warmup_ratio: float = 0.02
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 1
    max_len: int = 2048
    # None: 32,000, or with vocab that file's, or with init_from that drafter's vocab
    draft_vocab_size: int | None = None
    vocab: str | None = None  # a vocab.safetensors (d2t, t2d); default: counted from the data
    aux_layer_ids: list[int] | None = None  # online only; offline reads the manifest
    num_layers: int | None = None  # None: 1, or with init_from that drafter's depth
    # the MLP width: None: the target's, or with init_from that drafter's; wider widens it
    intermediate_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    init_head: str = "random"  # or "target": lm_head = the target's rows, norm = its final norm
    init_from: str | None = None  # a drafter folder (or checkpoint) whose weights start the run
    max_samples: int | None = None
    seed: int = 0
    save_every: int = 500
    keep_last: int = 3
    log_every: int = 10
    device: str = "auto"
    loader_workers: int | None = None  # processes reading ahead; 0: none; None: cores // 2, <= 4
    verify_shards: bool = True  # the shards' sha256 against the manifest before training
    bf16: bool | None = None  # None: autocast to bf16 on CUDA only
    resume: bool = False
    time_limit: float | None = None  # seconds, checked at log steps: then stop at a checkpoint
    profile_steps: int = 0  # > 0: profile.json/.txt of that many steps after 3 warm-up steps
    progress: bool = True
    # torch.compile'd step_loss: same loss, fewer passes over the logits (None: on CUDA only;
    # H200, 16 x 1,024, vocab 24,576: 65K -> 96K tok/s and half the memory, train_throughput.md)
    compile_loss: bool | None = None
    # batch widths rounded up to this (None: 128 on a GPU, 1 on CPU). Each new width cost cuDNN
    # plan building on the H200: 79 of 221 s of run 5's steps (speculative_default.md)
    pad_multiple: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.data is None) == (self.prompts is None):
            raise DraftsmithError("give exactly one of --data DATASET (offline) or --prompts FILE "
                                  "(online)")
        self._check_ranges()
        if self.init_head not in ("random", "target"):
            raise DraftsmithError(f"init_head must be 'random' or 'target', got {self.init_head!r}")
        if self.init_from and self.init_head != "random":
            raise DraftsmithError("--init-from starts from a drafter's own head: leave --init-head")
        # set here, not a field: `replace` (which sees 32000) and checkpoints keep no trace
        self.vocab_defaulted = self.draft_vocab_size is None and not (self.init_from or
                                                                      self.vocab)
        if self.vocab_defaulted:
            self.draft_vocab_size = 32000
        if self.num_layers is None and not self.init_from:
            self.num_layers = 1
        if self.max_steps is not None and self.epochs != 1:
            raise DraftsmithError(f"--max-steps {self.max_steps} and --epochs {self.epochs}: "
                                  "give one of them (--max-steps sets the run's length alone)")
        if self.max_len < self.ttt_steps + 2:
            raise DraftsmithError(f"max_len {self.max_len} is too short for {self.ttt_steps} steps")

    def _check_ranges(self) -> None:
        """Each numeric option in its range, named by its flag (None: the option's default)."""
        for names, low, strict in RANGES:
            for name in names:
                v = getattr(self, name)
                if v is not None and (v <= low if strict else v < low):
                    raise DraftsmithError(f"--{name.replace('_', '-')} must be "
                                          f"{'>' if strict else '>='} {low}, got {v}")
        if self.warmup_ratio > 1:
            raise DraftsmithError(f"--warmup-ratio must be <= 1, got {self.warmup_ratio}")
        if self.min_lr > self.lr:
            raise DraftsmithError(f"--min-lr {self.min_lr} is above --lr {self.lr}")


# Changing these between a checkpoint and --resume would change the run: refused.
IDENTITY = ("data", "prompts", "ttt_steps", "step_decay", "lr", "min_lr", "warmup_ratio",
            "warmup_steps", "weight_decay", "grad_clip", "epochs", "max_steps", "batch_size",
            "max_len", "draft_vocab_size", "vocab", "num_layers", "intermediate_size", "init_head",
            "init_from", "max_samples", "seed", *NORM_FLAGS)


# Resolved before a run (None: by the device) and recorded so since; older checkpoints hold
# None. RESOLVED changes what is trained (refused on --resume), SPEED only how fast (noted).
RESOLVED = ("bf16",)
SPEED = ("compile_loss", "pad_multiple")

PATHS = ("data", "prompts", "vocab", "init_from")  # of IDENTITY: compared as the files they name
# of IDENTITY: set from these where not given (the vocab's size, the drafter's depth), so a
# clash of theirs follows from one of these and is told as that
DERIVED = {"draft_vocab_size": ("vocab", "init_from"), "num_layers": ("init_from",)}


def option_clash(key: str, old: Any, new: Any) -> tuple[str, str]:
    """(what differs, the option as that run had it) in the words of the command line: a
    missing option is "not given", never None."""
    flag = f"--{key.replace('_', '-')}"
    if isinstance(old, bool) or isinstance(new, bool):  # an on/off flag
        return (f"{flag} was {'on' if old else 'off'} in that run, {'on' if new else 'off'} "
                "now", flag if old else f"leave {flag} out")
    if old is None:
        return f"{flag} was not given in that run, {new!r} now", f"leave {flag} out"
    shown = f"{flag} {old}"
    if new is None:
        return f"{flag} was {old!r} in that run, not given now", shown
    return f"{key} was {old!r} in that run, now {new!r}", shown


def target_fix(d: Eagle3Config, clashes: list[tuple]) -> str:
    """Where the target's fingerprint clashes, the target the drafter records, as --target
    takes it (a fingerprint alone named no file to pass)."""
    if not any(what.startswith("target") for what, _, _ in clashes):
        return ""
    src = d.target_source
    if not src:
        return ": pass the target that drafter was trained for as --target"
    return f": pass --target {src} (the target that drafter records)"


def same_path(a: str | None, b: str | None) -> bool:
    """Both None, or names of one file (a relative one read from the working folder)."""
    if a is None or b is None:
        return a is b
    return Path(a).resolve() == Path(b).resolve()


# What a training run writes into --out; a folder holding anything else is not one.
RUN_FILES = {CONFIG_FILE, WEIGHTS_FILE, report.LOG, report.PLOT, ckpt.CHECKPOINTS, "profile.json",
             "profile.txt"}

class Interrupt:
    """A single process's training loop: the first ctrl-C (SIGINT) or SIGTERM (a scheduler's
    time limit, `timeout`, a pod's end) asks it to stop after the step in flight, at a
    checkpoint (`asked`: that signal); a second of either aborts at once (the handlers before
    ours are put back: SIGTERM's default ends the process). Only in the main thread, and each
    signal only where it was not ignored (SIGINT under `nohup`, `cmd &`) nor set outside Python.
    Not under DDP: torchrun's SIGTERM ends a failed run's other ranks, whose checkpoint would
    wait on collectives that never complete."""

    NOTES = {
        signal.SIGINT: b"\ndraftsmith train: ctrl-C: stopping after this step with a checkpoint "
                       b"(ctrl-C again aborts at once)\n",
        signal.SIGTERM: b"\ndraftsmith train: SIGTERM: stopping after this step with a "
                        b"checkpoint (a second SIGTERM aborts at once)\n",
    }

    def __init__(self, active: bool) -> None:
        self.asked: signal.Signals | None = None
        self.old: dict[signal.Signals, Any] = {}
        self.active = active and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> Interrupt:
        for sig in self.NOTES if self.active else ():
            old = signal.getsignal(sig)
            if old is None and sig == signal.SIGINT:
                old = signal.default_int_handler  # not set from Python: put back Python's own
            if old is not None and old is not signal.SIG_IGN:
                self.old[sig] = old
                signal.signal(sig, self._ask)
        return self

    def __exit__(self, *exc: object) -> None:
        self._put_back()

    def _put_back(self) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
        self.old = {}

    def _ask(self, signum: int, frame: Any) -> None:
        self.asked = signal.Signals(signum)
        self._put_back()
        os.write(2, self.NOTES[self.asked])  # unbuffered: the handler may run inside another write


class Terminated(SystemExit):
    """A run stopped at a checkpoint by a first SIGTERM: exit 143 (128 + 15), as the signal's
    own default would have ended it, with no traceback."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def check_run_folder(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty folder that is not a training run's (a
    model or dataset there would be overwritten)."""
    check_folder(out, "--out")
    if not out.is_dir():
        return
    names = {p.name for p in out.iterdir() if not p.name.startswith(".")}
    foreign = sorted(names - RUN_FILES)
    if names and not names & RUN_MARKERS:  # e.g. a lone model.safetensors
        foreign = sorted(names)
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise DraftsmithError(f"--out {out}: holds {shown}, not a draftsmith training run; "
                              "train into a new or empty folder")


def check_init_folder(folder: Path) -> None:
    """Refuse an --init-from training run stopped at a checkpoint (no final drafter yet),
    naming its latest checkpoint: "no draftsmith.json" named no way on."""
    latest = ckpt.stopped_at(folder)
    if latest is not None:
        raise DraftsmithError(
            f"--init-from {folder}: a training run stopped at {latest.name}, with no final "
            f"drafter yet; pass --init-from {latest}, or finish that run first (its command "
            "with --resume)")


def check_data_first(cfg: TrainConfig) -> Dataset | None:
    """The dataset (its manifest read once, for the target and `open_offline`), or None
    online. One with no manifest, a capture not complete for --max-samples, or aux layers other
    than --aux-layers is refused before the target loads (seconds to minutes)."""
    if not cfg.data:
        return None
    ds = Dataset(cfg.data)
    check_whole(cfg.data, ds.manifest, cfg.max_samples)
    held = ds.manifest.get("aux_layer_ids")
    if cfg.aux_layer_ids is not None and isinstance(held, list) and \
            list(cfg.aux_layer_ids) != held:  # a malformed list: `open_offline` names it
        raise aux_clash(cfg, held)
    return ds


@contextmanager
def out_of_memory(cfg: TrainConfig, step: int) -> Iterator[None]:
    """Out of memory in a step as a line naming the flags that size it, not the allocator's
    traceback."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        tried = re.search(r"Tried to allocate ([\d.]+ \w+)", str(e))
        what = f" allocating {tried.group(1)}" if tried else ""
        raise DraftsmithError(
            f"out of memory at step {step}{what} (--batch-size {cfg.batch_size} rows of "
            f"--max-len {cfg.max_len} tokens a rank): lower --batch-size or --max-len") from None


def aux_clash(cfg: TrainConfig, held: Any) -> DraftsmithError:
    return DraftsmithError(
        f"--aux-layers {list(cfg.aux_layer_ids or [])}: the dataset {cfg.data} holds aux layers "
        f"{held} (canonical), which offline training uses; leave --aux-layers out or capture a "
        "dataset with those layers")


class TTTModel(nn.Module):
    """The drafter plus its unrolled TTT loss: one module, so DDP sees a plain forward."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float,
                 compile_loss: bool = False) -> None:
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay
        self.loss_fn = compiled_step_loss() if compile_loss else step_loss

    def forward(self, tokens, aux, positions, doc, prob, label, ok):
        tg = Targets(prob, label, ok, doc)
        fused = self.drafter.fuse(aux)
        total = torch.zeros((), device=tokens.device)
        losses, correct, valid = [], [], []
        steps = unroll(self.drafter, tokens, fused, positions, doc, self.steps)
        for j, logits in enumerate(steps):
            # a batch no wider than the step scores nothing there: eager, as inductor refused
            # some such empty slices (ValueRangeError at width 1)
            fn = self.loss_fn if tokens.shape[1] > j + 1 else step_loss
            loss, c, v = fn(logits, tg, j)
            total = total + self.decay**j * loss
            losses.append(loss.detach().float())
            correct.append(c)
            valid.append(v)
        return total, torch.stack(losses), torch.stack(correct), torch.stack(valid)


def decay_groups(drafter: nn.Module, decay: float, split: bool = True) -> list[dict[str, Any]]:
    """AdamW's parameter groups: weight decay on the matrices only. Norm gains (and biases) are
    1-D: decayed, RMSNorm gains that start at 1 would be pulled towards 0 (HF Trainer and
    Megatron exempt them too). `split` False: one group, as runs before this kept."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    if not split or decay == 0:
        return [{"params": params, "weight_decay": decay}]
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": decay},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Window:
    """Sums over one logging window (saved in checkpoints, so a resumed log is identical)."""

    def __init__(self, steps: int) -> None:
        self.n, self.loss, self.grad = 0, 0.0, 0.0
        self.counted = 0.0  # positions step 0 trains on: an assistant token, its target in vocab
        # step-0 assistant positions (counts[1, 0]) of steps restored from a checkpoint written
        # before `counted` was summed: left out of the coverage's denominator
        self.uncounted = 0.0
        self.step_loss = torch.zeros(steps, dtype=torch.float64)
        self.counts = torch.zeros(4, steps, dtype=torch.float64)
        self.tokens, self.seconds, self.lr = 0, 0.0, 0.0

    def state(self) -> dict[str, Any]:
        return dict(vars(self))

    def load(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        if "counted" not in state:
            self.uncounted = float(self.counts[1, 0])

    def assistant(self) -> float:
        """Step-0 assistant positions whose coverage was counted."""
        return float(self.counts[1, 0]) - self.uncounted

    def coverage(self) -> float | None:
        """Share of those whose target token lies in the draft vocab (None: none counted)."""
        n = self.assistant()
        return self.counted / n if n > 0 else None


@dataclass
class Pending:
    """One step's statistics on their way to the host (copied without blocking)."""

    reduced: torch.Tensor  # [loss, step losses, grad norm, tokens, counts] summed over ranks
    local_loss: torch.Tensor
    event: torch.cuda.Event | None
    where: tuple[int, int, int, list[int]]  # step, epoch, batch index, samples

    @classmethod
    def of(cls, vec: torch.Tensor, loss: torch.Tensor, where: tuple) -> Pending:
        if vec.device.type != "cuda":
            return cls(vec, loss, None, where)
        host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
        host.copy_(vec, non_blocking=True)
        local = torch.empty((), dtype=loss.dtype, pin_memory=True)
        local.copy_(loss, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, local, event, where)


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistCtx) -> None:
        self.vocab_defaulted = getattr(cfg, "vocab_defaulted", False)  # before `replace`
        gpu = ctx.device.type == "cuda"
        # what runs, not None, is checked on --resume and goes into checkpoints and the config
        cfg = replace(cfg, compile_loss=gpu if cfg.compile_loss is None else cfg.compile_loss,
                      bf16=gpu if cfg.bf16 is None else cfg.bf16,
                      pad_multiple=cfg.pad_multiple or (128 if gpu else 1))
        self.cfg, self.ctx, self.out = cfg, ctx, Path(cfg.out)
        # a rank failing here alone left the others in DDP's first broadcast (a peer's closed
        # connection their error, or a wait): every rank stops with its error instead
        with shared_failure(ctx.world):
            self._prepare()
        if ctx.world > 1:  # each host's copy: a resume there hashes only what changed since
            self.shard_stamps = merged_stamps(ctx.gather(self.shard_stamps))
        self.model = self._wrap(TTTModel(self.drafter, cfg.ttt_steps, cfg.step_decay,
                                            cfg.compile_loss))

    def _prepare(self) -> None:
        """Everything before the first collective (DDP's)."""
        cfg, ctx = self.cfg, self.ctx
        check_run_folder(self.out)
        if ctx.main:  # a run writing into --out: refused before anything is read or said
            ckpt.check_free(self.out)
        dataset = check_data_first(cfg)
        found = self._find_checkpoint()  # an --out holding a run without --resume: refused now
        saved = self._check_resume(found)  # before the target loads, as the checks above
        self._check_init_from(found)
        self.target = resolve_target(cfg.target, cfg.data,
                                     dataset.manifest if dataset is not None else None)
        self.data = self._open_data(dataset)
        self.data_id = self.data.identity()
        self.shard_stamps = self._check_shards(saved[0] if saved else None)
        # before the vocab count and the drafter: a --batch-size the data cannot fill is refused
        self.plan = Plan(self.data.lengths, cfg.batch_size, cfg.max_len, ctx.world, ctx.rank,
                         cfg.seed, packing_of(saved[0] if saved else None))
        self._check_answers()
        self.total = self._total_steps()
        self._check_warmup()
        self.drafter = self._build_drafter(found).to(ctx.device)
        self.opt, self.sched = self._optimizer()
        self.step, self.tokens = 0, 0
        self.window = Window(cfg.ttt_steps)
        self.watched = False  # the first logged window checked for positions that train
        self.pending: Pending | None = None
        self.stopped = False  # stopped at a checkpoint after a ctrl-C (`_stop_interrupted`)
        self.held: ckpt.OutLock | None = None  # the --out lock (`_hold_out`)
        # progress as a line a logged step (run: --no-progress or stderr not a terminal)
        self.lines = False
        self.prof = StepProfiler(self.out, ctx.device, cfg.profile_steps if ctx.main else 0)
        if saved is not None:
            self._restore(found, *saved)
        self._check_profile()
        head_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        self.head = target_head(self.target)[1].to(ctx.device, head_dtype)
        d2t = self.drafter.d2t
        self.used = d2t + torch.arange(d2t.numel(), device=d2t.device)
        self.target_model = (self.target.build(head_dtype, str(ctx.device))
                             if self.data.online else None)

    def say(self, msg: str) -> None:
        from tqdm import tqdm

        if self.ctx.main:  # through tqdm: a line of its own below a progress bar
            tqdm.write(f"draftsmith train: {msg}", file=sys.stderr)

    def _open_data(self, dataset: Dataset | None) -> Data:
        c = self.cfg
        with warnings.catch_warnings():
            if not self.ctx.main:  # every rank opens the data; one says what it skipped
                warnings.simplefilter("ignore")
            if not c.data:
                data = open_online(c.prompts, self.target, c.aux_layer_ids, c.max_samples,
                                   c.max_len)
            else:
                data = open_offline(c.data, self.target, c.max_samples, dataset, c.max_len)
        if c.data and c.aux_layer_ids is not None and list(c.aux_layer_ids) != data.aux_layer_ids:
            raise aux_clash(c, data.aux_layer_ids)
        if c.max_samples is not None and len(data.lengths) < c.max_samples:
            self.say(f"--max-samples {c.max_samples}: {c.data or c.prompts} holds "
                     f"{len(data.lengths)} sample(s) to train on: training on all of them")
        return data

    def _check_shards(self, state: dict[str, Any] | None) -> dict[str, list[int]]:
        """The shards trained on against the manifest's sha256, before training: a shard
        corrupted or replaced since its capture trained silently on other data. Hashed once a
        run, split over this host's ranks; a --resume hashes only those changed on disk since
        its checkpoint (`ShardReader.check_hashes`). The stamps, for checkpoints."""
        if self.data.reader is None or not self.cfg.verify_shards:
            return {}  # no stamps: what was not hashed is not vouched for at a resume
        known = (state or {}).get("shards") or {}
        with ranked(self.ctx):  # each host hashes its own copy: the error names whose
            return self.data.reader.check_hashes(len(self.data.lengths), known,
                                                 self.ctx.host_part(), self.say)

    def _check_resume(self, found: Path | None) -> tuple[dict[str, Any], Any] | None:
        """The checkpoint's (trainer state, RNG state), its options (--prompts, --data, ...) and
        any --aux-layers given compared with this run's before the target loads; the target and
        the default aux layers are compared once it has."""
        if found is None:
            return None
        state, rng = ckpt.load_trainer_state(found, self.ctx.rank)
        self._same_world(found, state.get("world", 1))
        self._same_options(found, state["config"])
        if self.cfg.aux_layer_ids is not None:
            with ckpt.unreadable(found):
                old = read_drafter_meta(found)["config"].get("aux_layer_ids")
            if isinstance(old, list) and old != list(self.cfg.aux_layer_ids):
                raise DraftsmithError(
                    f"--resume from {found}: aux layers {old!r} in that run, "
                    f"{list(self.cfg.aux_layer_ids)!r} now; resume with the same options (or "
                    "train into another --out)")
        return state, rng

    def _same_world(self, found: Path, world: int) -> None:
        if world != self.ctx.world:  # each rank's rows of a step are dealt by the world size
            raise DraftsmithError(
                f"--resume from {found}: that run had {world} rank(s), this one has "
                f"{self.ctx.world}: the data order would change; resume "
                + ("as one process (no torchrun)" if world == 1 else
                   f"on {world} ranks (torchrun: --nnodes x --nproc-per-node = {world})")
                + " or train into another --out")

    def _check_init_from(self, found: Path | None) -> None:
        """--aux-layers given against the --init-from drafter's, before the target loads (a
        resumed run starts from its checkpoint instead)."""
        c = self.cfg
        if found is not None or c.init_from is None:
            return
        check_init_folder(Path(c.init_from))
        if c.aux_layer_ids is None:
            return
        old = read_drafter_meta(c.init_from)["config"].get("aux_layer_ids")
        if isinstance(old, list) and old != list(c.aux_layer_ids):  # else: load_drafter's
            raise DraftsmithError(f"--init-from {c.init_from}: aux layers {old!r} there, "
                                  f"{list(c.aux_layer_ids)!r} here")

    def _check_answers(self) -> None:
        """Refuse data of which no position would train: every assistant token cut off by
        --max-len, or none past a sample's first two tokens (the loss would be 0 throughout)."""
        c, at = self.cfg, self.data.answer_start(self.cfg.max_len)
        if at is None:
            raise DraftsmithError(
                f"{c.data or c.prompts}: no sample has an assistant token past its first two "
                "tokens, so no position would train; train on conversations with answers"
            )
        if at >= c.max_len:
            raise DraftsmithError(
                f"--max-len {c.max_len} cuts off every answer: no sample has an assistant token "
                f"a drafter learns (from its third token on) within its first {c.max_len} "
                f"tokens, the earliest is token {at + 1}; raise --max-len well past {at + 1}"
            )

    def _find_checkpoint(self) -> Path | None:
        latest = ckpt.latest_checkpoint(self.out)
        if self.cfg.resume:
            for torn in ckpt.torn_checkpoints(self.out):
                self.say(f"--resume: {torn} holds no trainer state (a write or removal cut "
                         "short): passed over")
            if latest is None and (self.out / CONFIG_FILE).exists():
                raise DraftsmithError(f"--resume: {self.out} holds a drafter but no checkpoint to "
                                      "resume from; choose another --out")
            if latest is None:
                self.say(f"--resume: {self.out} holds no checkpoint yet, starting fresh")
            return latest
        if latest is not None or (self.out / CONFIG_FILE).exists():
            what = latest.name if latest else "a drafter"
            raise DraftsmithError(
                f"{self.out} already holds a training run ({what}); pass --resume to continue "
                "it, or choose another --out"
            )
        return None

    def _build_drafter(self, found: Path | None) -> Eagle3Drafter:
        if found is not None:
            with ckpt.unreadable(found):
                self.vocab_summary = read_drafter_meta(found).get("vocab", {})
                drafter = load_drafter(found)
            return self._same_inputs(found, drafter)
        embed, head = target_head(self.target)
        if self.cfg.init_from:
            return self._warm_start(Path(self.cfg.init_from), embed)
        c, t = self.cfg, self.target
        d2t, t2d = self._vocab()
        dcfg = Eagle3Config.for_target(
            t.cfg, len(d2t), self.data.aux_layer_ids, num_layers=c.num_layers,
            intermediate_size=c.intermediate_size or t.cfg.intermediate_size,
            norm_before_residual=c.norm_before_residual, norm_before_fc=c.norm_before_fc,
            fc_norm=c.fc_norm, norm_output=c.norm_output, target_fingerprint=t.fingerprint,
            target_source=portable_source(t),
            target_architectures=list(t.hf_config.get("architectures") or []),
        )
        torch.manual_seed(c.seed)
        drafter = Eagle3Drafter(dcfg)
        drafter.init_weights()
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed)
            if c.init_head == "target":  # start from the target's own token readout
                drafter.lm_head.weight.copy_(head[d2t + torch.arange(len(d2t))])
                drafter.norm.weight.copy_(t.weights["model.norm.weight"].float())
        drafter.set_vocab(d2t, t2d)
        return drafter

    def _same_inputs(self, found: Path, drafter: Eagle3Drafter) -> Eagle3Drafter:
        """A resumed drafter reads the aux layers of the target it was trained on: online,
        --aux-layers and --target come from the flags, which may have changed since."""
        if clashes := self._input_clashes(drafter.cfg):
            raise DraftsmithError(f"--resume from {found}: " + "; ".join(
                f"{what} {old!r} in that run, {new!r} now" for what, old, new in clashes)
                + "; resume with the same options" + target_fix(drafter.cfg, clashes)
                + self._aux_fix(drafter.cfg, clashes) + " (or train into another --out)")
        return drafter

    def _aux_fix(self, d: Eagle3Config, clashes: list[tuple], resume: bool = True) -> str:
        """Where the aux layers clash on the same target, what sets them: online --aux-layers
        (left out, the default was read), offline the dataset: captured again since a resumed
        run, or at other layers than an --init-from drafter reads."""
        if target_fix(d, clashes) or not any(what == "aux layers" for what, _, _ in clashes):
            return ""
        ids = ",".join(map(str, d.aux_layer_ids))
        if not self.cfg.data:
            return f": pass --aux-layers {ids}"
        if resume:
            return (f": {self.cfg.data} holds aux layers {self.data.aux_layer_ids} now "
                    "(captured again since that run): resume on the dataset it trained on")
        return (f": {self.cfg.data} holds aux layers {self.data.aux_layer_ids}; train it on a "
                f"dataset captured at its layers (`draftsmith data capture --aux-layers {ids}`)")

    def _input_clashes(self, d: Eagle3Config, *more: tuple) -> list[tuple]:
        """(what, the drafter's, this run's) where they differ: its aux layers and target, and
        any `more` such triples. A drafter recording no fingerprint (an imported one) is held
        to the target's sizes instead: another hidden size failed at the first step."""
        t = self.target
        sizes = [] if d.target_fingerprint else [
            ("target hidden size", d.target_hidden_size, t.cfg.hidden_size),
            ("target vocab size", d.vocab_size, t.cfg.vocab_size)]
        return [(what, old, new) for what, old, new in (
            ("aux layers", list(d.aux_layer_ids), list(self.data.aux_layer_ids)),
            ("target", d.target_fingerprint or t.fingerprint, t.fingerprint), *sizes, *more)
            if old != new]

    def _warm_start(self, folder: Path, embed: torch.Tensor) -> Eagle3Drafter:
        """A new run (fresh optimizer and schedule) from an earlier drafter's weights, for the
        same target and aux layers: more epochs or more data after a finished run. A --vocab
        file or a --draft-vocab-size other than the drafter's regrows its vocab; more
        --num-layers than it has deepens it (the new layers start as the identity), a wider
        --intermediate-size widens its MLPs (the new units start silent); none keeps its shape."""
        drafter = load_drafter(folder, dtype=torch.float32, embed=embed)
        d, c = drafter.cfg, self.cfg
        layers = d.num_layers if c.num_layers is None else c.num_layers
        width = c.intermediate_size or d.intermediate_size
        # a norm flag asked for here cannot be added to trained weights (off: the drafter's own)
        norms = [(f"--{k.replace('_', '-')}", getattr(d, k), getattr(d, k) or getattr(c, k))
                 for k in NORM_FLAGS]
        clashes = self._input_clashes(
            d, ("decoder layers", d.num_layers, min(layers, d.num_layers)),  # deepen only
            ("MLP width", d.intermediate_size, min(width, d.intermediate_size)),  # widen only
            *norms)
        if clashes:
            raise DraftsmithError(f"--init-from {folder}: " + "; ".join(
                f"{what} {old!r} there, {new!r} here" for what, old, new in clashes)
                + target_fix(d, clashes) + self._aux_fix(d, clashes, resume=False))
        if width > d.intermediate_size:
            drafter = self._widen(drafter, width)
        if layers > d.num_layers:
            drafter = self._deepen(drafter, layers)
        size = self.cfg.draft_vocab_size
        if self.cfg.vocab or (size is not None and size != d.draft_vocab_size):
            drafter = self._regrow(drafter)
        else:
            self.vocab_summary = read_drafter_meta(folder).get("vocab", {})
        self.vocab_summary["init_from"] = str(folder)
        # trained on this target from here: named as a fresh run names it (not a cache path or
        # a folder relative to where the earlier run was started)
        drafter.cfg.target_source = portable_source(self.target)
        drafter.cfg.target_fingerprint = self.target.fingerprint
        self.say(f"weights from {folder} (fresh optimizer and schedule)")
        return drafter

    def _rebuilt(self, old: Eagle3Drafter, state: dict[str, torch.Tensor],
                 **changes: Any) -> tuple[Eagle3Drafter, list[str], list[str]]:
        """A freshly initialised drafter of `old`'s config with `changes`, `state` loaded into
        it: (drafter, missing keys, unexpected keys)."""
        torch.manual_seed(self.cfg.seed)
        new = Eagle3Drafter(replace(old.cfg, **changes))
        new.init_weights()
        missing, unexpected = new.load_state_dict(state, strict=False)
        return new, missing, unexpected

    def _deepen(self, old: Eagle3Drafter, layers: int) -> Eagle3Drafter:
        """`old` with `layers` decoder layers: its weights kept, each new layer initialised as
        usual but with its attention output and MLP down projections zero, so it adds nothing
        to the residual stream and the deeper drafter starts as the shallower one."""
        new, missing, unexpected = self._rebuilt(old, old.state_dict(), num_layers=layers)
        added = range(old.cfg.num_layers - 1, layers - 1)
        if unexpected or not all(k.startswith(tuple(f"extra_layers.{i}." for i in added))
                                 for k in missing):
            raise DraftsmithError(f"deepening {self.cfg.init_from}: weights missing "
                                  f"{sorted(missing)}, unexpected {sorted(unexpected)}")
        with torch.no_grad():
            for i in added:
                new.extra_layers[i].self_attn.o.weight.zero_()
                new.extra_layers[i].mlp.down.weight.zero_()
        self.say(f"{old.cfg.num_layers} -> {layers} decoder layers (new ones start "
                 "as the identity)")
        return new

    def _widen(self, old: Eagle3Drafter, width: int) -> Eagle3Drafter:
        """`old` with MLPs `width` wide: its weights kept, the new units' gate and up rows
        initialised as usual and their down columns zero, so they add nothing at first and the
        wider drafter starts as the narrower one."""
        w = old.cfg.intermediate_size
        state = {k: v for k, v in old.state_dict().items() if ".mlp." not in k}
        new, missing, unexpected = self._rebuilt(old, state, intermediate_size=width)
        if unexpected or not all(".mlp." in k for k in missing):
            raise DraftsmithError(f"widening {self.cfg.init_from}: weights missing "
                                  f"{sorted(missing)}, unexpected {sorted(unexpected)}")
        with torch.no_grad():
            for a, b in zip(old.layers, new.layers, strict=True):
                gate, up = a.mlp.gate_up.weight.split(w)
                b.mlp.gate_up.weight[:w] = gate
                b.mlp.gate_up.weight[width : width + w] = up
                b.mlp.down.weight.zero_()
                b.mlp.down.weight[:, :w] = a.mlp.down.weight
        self.say(f"MLP width {w} -> {width} (the new units start silent)")
        return new

    def _regrow(self, old: Eagle3Drafter) -> Eagle3Drafter:
        """`old` with this run's draft vocab: every weight kept, each head row moved to its
        token's new row; rows of tokens new to the vocab start as a fresh head's do."""
        d2t, t2d = self._vocab()
        state = {k: v for k, v in old.state_dict().items() if k not in ("lm_head.weight", "d2t")}
        new, missing, unexpected = self._rebuilt(old, state, draft_vocab_size=len(d2t))
        if set(missing) != {"lm_head.weight", "d2t"} or unexpected:
            raise DraftsmithError(f"regrowing the vocab of {self.cfg.init_from}: weights missing "
                                  f"{sorted(missing)}, unexpected {sorted(unexpected)}")
        new.set_vocab(d2t, t2d)
        row = torch.full((old.cfg.vocab_size,), -1, dtype=torch.long)
        row[old.to_target(torch.arange(old.cfg.draft_vocab_size))] = torch.arange(
            old.cfg.draft_vocab_size)
        src = row[new.to_target(torch.arange(len(d2t)))]
        kept = src >= 0
        with torch.no_grad():
            new.lm_head.weight[kept] = old.lm_head.weight[src[kept]]
        self.say(f"draft vocab regrown {old.cfg.draft_vocab_size} -> {len(d2t)}: "
                 f"{int(kept.sum())} head rows kept")
        return new

    def _vocab(self) -> tuple[torch.Tensor, torch.Tensor]:
        from draftsmith.data.vocab import build_vocab

        vocab = self.target.cfg.vocab_size
        if self.cfg.vocab:
            d2t, t2d = read_vocab(self.cfg.vocab, vocab)
            self._check_vocab_size(d2t.numel())
            longest = max(self.data.uncut or self.data.lengths, default=0)
            if note := counted_longer(self.cfg.vocab, self.cfg.max_len, longest):
                self.say(note)
            self.vocab_summary = {"file": str(self.cfg.vocab), "draft_vocab_size": d2t.numel()}
            return d2t, t2d
        hint = self._dataset_vocab_hint()
        counts = self.data.token_counts(vocab, self.cfg.max_len)  # what the loss can see
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            v = build_vocab(counts, min(self.cfg.draft_vocab_size, vocab), vocab)
        for w in said:  # the counted vocab's warnings, with the dataset's own vocab named
            warnings.warn(f"{w.message}{'; ' + hint if hint else ''}", w.category, stacklevel=2)
        if hint and not said:
            self.say(f"note: {hint}")
        self.vocab_summary = v.summary()
        return v.d2t, v.t2d

    def _dataset_vocab_hint(self) -> str | None:
        """Where neither --vocab nor --draft-vocab-size was given and the dataset holds the
        vocab `data make` wrote: that it is not used (the default counts one on the data)."""
        path = Path(self.cfg.data or "") / "vocab.safetensors"
        if not (self.cfg.data and self.vocab_defaulted and path.is_file()):
            return None
        try:
            n = read_vocab(str(path), self.target.cfg.vocab_size)[0].numel()
        except DraftsmithError:
            return None  # not this target's vocab: nothing to point at
        return (f"the dataset holds a vocab made by `data make` ({path}, {n} draft tokens), "
                f"not used: without --vocab a vocab of up to {self.cfg.draft_vocab_size} is "
                f"counted on the data; pass --vocab {path} to train on it")

    def _check_vocab_size(self, n: int) -> None:
        """An explicit --draft-vocab-size against the --vocab file's: fewer is refused; more is
        a cap the file already meets (as a counted vocab caps at the distinct tokens)."""
        size = self.cfg.draft_vocab_size
        if size is not None and size < n:
            raise DraftsmithError(
                f"--draft-vocab-size {size} conflicts with --vocab {self.cfg.vocab}, which holds "
                f"{n} draft tokens; leave --draft-vocab-size out, or make a vocab of {size} with "
                f"`draftsmith data vocab --size {size}`"
            )
        if size is not None and size > n:
            self.say(f"--vocab {self.cfg.vocab} holds {n} draft tokens (fewer than "
                     f"--draft-vocab-size {size}): using {n}")

    def _total_steps(self) -> int:
        if self.cfg.max_steps is None:
            return sum(self.plan.steps_per_epoch(e) for e in range(self.cfg.epochs))
        # packs every epoch the steps reach, so an epoch too small for a batch is refused here,
        # not in a loader worker mid-run
        self.plan.locate(self.cfg.max_steps - 1)
        return self.cfg.max_steps

    def _check_warmup(self) -> None:
        """Refuse a warm-up longer than the run: the learning rate would never reach --lr."""
        c = self.cfg
        if c.warmup_steps is not None and c.warmup_steps > self.total:
            raise DraftsmithError(
                f"--warmup-steps {c.warmup_steps} is more than the run's {self.total} steps: the "
                f"learning rate would never reach --lr {c.lr:g} nor decay; lower --warmup-steps "
                "(or use --warmup-ratio)")

    def _check_profile(self) -> None:
        """Warn, before training, of a --profile-steps window the run ends before: no profile is
        written, which nothing said (it was found missing after the run)."""
        n, left = self.cfg.profile_steps, self.total - self.step
        if not n or WARMUP + n <= left or not self.ctx.main:
            return
        fix = (f"pass --profile-steps {left - WARMUP} or fewer" if left > WARMUP else
               "profile a longer run (--max-steps)")
        warnings.warn(
            f"--profile-steps {n}: the profile starts after {WARMUP} warm-up steps, but this run "
            f"has {left} step(s) {'left ' if self.step else ''}to train, so no profile.json will "
            f"be written; {fix}", stacklevel=2)

    def _optimizer(self, split: bool = True,
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        c = self.cfg
        opt = torch.optim.AdamW(decay_groups(self.drafter, c.weight_decay, split), lr=c.lr,
                                betas=(0.9, 0.95))
        warm = c.warmup_steps if c.warmup_steps is not None else round(c.warmup_ratio * self.total)
        warm, total, ratio = max(1, warm), self.total, c.min_lr / c.lr
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, warm, total, ratio)
        )
        return opt, sched

    def _wrap(self, model: TTTModel) -> nn.Module:
        if self.ctx.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = self.ctx.device
        return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                   broadcast_buffers=False)

    def _same_options(self, found: Path, saved: dict[str, Any]) -> None:
        """Refuse an option that shapes the result other than the checkpoint's run had it;
        say once which speed-only options changed and which were not recorded."""
        if clashes := self._option_clashes(saved):
            said, fixes = zip(*clashes, strict=True)
            raise DraftsmithError(
                f"--resume from {found}: {'; '.join(said)}; resume with the same options: "
                f"{', '.join(fixes)} (or train into another --out)")
        unknown = [k for k in (*RESOLVED, *SPEED) if saved.get(k) is None]
        for key in (k for k in RESOLVED if k not in unknown):
            if saved[key] != getattr(self.cfg, key):
                flag = f"--{'' if saved[key] else 'no-'}{key.replace('_', '-')}"
                raise DraftsmithError(
                    f"--resume from {found}: {key} was {saved[key]!r} in that run, now "
                    f"{getattr(self.cfg, key)!r}; resume with {flag} (or train into another "
                    "--out)")
        changed = [f"{k} {saved[k]!r} -> {getattr(self.cfg, k)!r}" for k in SPEED
                   if k not in unknown and saved[k] != getattr(self.cfg, k)]
        if changed:
            self.say(f"--resume: {', '.join(changed)} since that run (speed only: the same "
                     "loss is trained)")
        if unknown:
            self.say(f"--resume: {found} does not record {', '.join(unknown)} (an older run): "
                     "taken as given now")

    def _option_clashes(self, saved: dict[str, Any]) -> list[tuple[str, str]]:
        """(what differs, the option as that run had it) for each IDENTITY option the checkpoint
        recorded otherwise, those set by a differing one (`DERIVED`) left to it."""
        differ = {}
        for key in sorted(IDENTITY, key=lambda k: k not in PATHS):  # the options others follow
            default = TrainConfig.__dataclass_fields__[key].default  # runs saved before the key
            old, new = saved.get(key, default), getattr(self.cfg, key)
            if key == "draft_vocab_size" and self.cfg.vocab:
                continue  # the --vocab file (compared itself) sets it; older runs saved 32000
            if key in PATHS and same_path(old, new):
                continue  # `data/` for `data`, or an absolute path for a relative one
            if old != new:
                differ[key] = (old, new)
        return [option_clash(k, *v) for k, v in differ.items()
                if not any(d in differ for d in DERIVED.get(k, ()))]

    def _same_data(self, found: Path, old: dict[str, Any] | None) -> None:
        """Refuse data other than the checkpoint's run trained on; a checkpoint that recorded
        less of it (an older run) is compared on what it recorded, and says so."""
        new = self.data_id
        unrecorded = old is None or old.get("content") is None
        old = {**new, **(old or {})} if unrecorded else old
        if old != new:
            raise DraftsmithError(f"--resume from {found}: the data changed since that run: "
                                  f"{self._data_change(old, new)}; resume with the data it "
                                  "trained on (or train into another --out)")
        if unrecorded:
            self.say(f"--resume: {found} does not record the data's contents (an older run): "
                     "only its sample count and lengths were compared")

    def _data_change(self, old: dict[str, Any], new: dict[str, Any]) -> str:
        if {**old, "content": None} != {**new, "content": None}:
            return (f"{old['samples']} samples of {old['tokens']} tokens then, {new['samples']} "
                    f"of {new['tokens']} now (or the same counts in other lengths), so the data "
                    "order would change")
        other = ("other token ids" if self.data.online else
                 "other shard contents in its manifest: captured again or rewritten since")
        return (f"the same {new['samples']} samples in the same lengths, but other contents "
                f"({other})")

    def _restore(self, found: Path, state: dict[str, Any], rng: Any) -> None:
        """The checkpoint's state (options compared in `_check_resume`) into this run."""
        self._same_data(found, state.get("data"))
        if len(state["optimizer"]["param_groups"]) != len(self.opt.param_groups):
            # a run that began decaying every weight (one group) goes on as it began
            self.opt, self.sched = self._optimizer(split=False)
            self.say(f"--resume: {found} decays every weight, norm gains too (an older run): "
                     "it goes on so")
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.tokens = state["step"], state["tokens"]
        self.window.load(state["window"])
        # a window was logged (and judged) before this one began: its warnings said their say
        self.watched = self.step > self.window.n
        if rng is not None:
            ckpt.set_rng_state(rng)
        self.say(f"resumed from {found} at step {self.step}")

    def run(self) -> Path:
        try:
            return self._run()
        finally:
            if self.held is not None:
                self.held.release()  # the --out lock goes with it
                self.held = None
            if self.ctx.world > 1:
                # DDP's reducer goes while the process group is still registered: freed last
                # by the reducer, a gloo group's destructor joined its worker thread holding
                # the GIL while that thread freed the last all_gather's tensors, which needs it
                self.model = None

    def _run(self) -> Path:
        from tqdm import tqdm

        workers = self.cfg.loader_workers
        if workers is None:
            workers = min(4, (os.cpu_count() or 1) // 2)
        gpu = self.ctx.device.type == "cuda"
        # first: an open-file limit too low for the workers is refused before --out is made
        with shared_failure(self.ctx.world):  # a rank's own limit: every rank stops
            self.loader = batches(self.plan, self.data.source, self.step, self.total, workers,
                                  pin=gpu, multiple=self.cfg.pad_multiple)
        try:
            self._hold_out()
        except BaseException:
            self.loader.close()
            raise
        self._describe()
        # off a terminal (a log file, a pipe) a bar is one endless line of carriage returns,
        # and --no-progress asks for none: each logged step is a line of its own there instead
        self.lines = not (self.cfg.progress and on_terminal())
        bar = tqdm(total=self.total, initial=self.step,
                   disable=not self.ctx.main or self.lines, desc="train", dynamic_ncols=True)
        start = self.started = time.perf_counter()
        self.first = self.step  # steps before are a resumed run's: not this process's pace
        try:
            with Interrupt(self.ctx.world == 1) as ctrl_c:
                while self.step < self.total:
                    t0 = time.perf_counter()
                    self.train_step()
                    self.step += 1
                    log = self.step % self.cfg.log_every == 0 or self.step == self.total
                    saved = self.step % self.cfg.save_every == 0 or self.step == self.total
                    if log or saved:
                        self._flush()  # the host waits here only
                    self.window.seconds += time.perf_counter() - t0
                    bar.update(1)
                    if log:
                        self._show(bar, self._log())
                    if saved:
                        self._checkpoint()
                    if ctrl_c.asked and self.step < self.total:
                        self._stop_interrupted(saved, ctrl_c.asked)
                    if log and self.step < self.total and self._out_of_time(start):
                        if not saved:
                            self._checkpoint()  # pending stats were flushed at the log step
                        self.say(f"time limit ({self.cfg.time_limit:g} s): stopped at step "
                                 f"{self.step} of {self.total} with a checkpoint; the same "
                                 "command with --resume continues")
                        return self.out
        except KeyboardInterrupt:
            if not self.stopped:  # a ctrl-C that could not wait for the step (or under DDP)
                self._say_aborted()
            raise
        finally:
            self.loader.close()
            bar.close()
            self.prof.close()
        return self._finish()

    def _stop_interrupted(self, saved: bool, sig: signal.Signals) -> None:
        """After the first ctrl-C or SIGTERM: the step in flight done, a checkpoint at this step
        (its statistics in), then KeyboardInterrupt (the CLI exits 130) or `Terminated` (143)."""
        if not saved:
            self._flush()
            self._checkpoint()
        self.stopped = True
        how = "interrupted" if sig == signal.SIGINT else f"terminated ({sig.name})"
        self.say(f"{how} at step {self.step} of {self.total}: checkpoint written to "
                 f"{ckpt.checkpoint_dir(self.out, self.step)}; the same command with --resume "
                 "continues")
        if sig == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated

    def _say_aborted(self) -> None:
        """A ctrl-C that stopped the run mid-step: where --resume would start."""
        latest = ckpt.latest_checkpoint(self.out) if self.ctx.main else None
        where = (f"the last checkpoint is {latest}; the same command with --resume continues "
                 "from it" if latest is not None else
                 "no checkpoint written yet; the same command starts over")
        self.say(f"aborted after {self.step} of {self.total} steps: {where}")

    def _hold_out(self) -> None:
        """--out made and locked (flock on the folder, rank 0) while this run writes: a second
        `train` into it (a rerun in another shell) would delete the first's checkpoints. The
        lock dies with its process, so a killed run leaves none behind."""
        with shared_failure(self.ctx.world):  # every rank stops
            if self.ctx.main:
                make_folder(self.out)
                self._lock_out()
                # rows past the checkpoint, or of an earlier run that left none
                report.truncate_log(self.out, self.step)

    def _lock_out(self) -> None:
        """An flock on the folder, or where its file system has none a lock file naming this
        run (`checkpoint.lock_out`); forked loader workers close their copies of the flock."""
        self.held = ckpt.lock_out(self.out)

    def _show(self, bar: Any, stats: str) -> None:
        if self.lines:  # what the bar shows on a terminal: time spent and time left
            from tqdm import tqdm

            spent = time.perf_counter() - self.started
            left = spent / max(1, self.step - self.first) * (self.total - self.step)
            self.say(f"step {self.step}/{self.total}: {stats}, {tqdm.format_interval(spent)} "
                     f"spent, eta {tqdm.format_interval(left)}")
        else:
            bar.set_postfix_str(stats)

    def _out_of_time(self, start: float) -> bool:
        if self.cfg.time_limit is None:
            return False
        late = torch.tensor(float(time.perf_counter() - start >= self.cfg.time_limit))
        return bool(self.ctx.all_reduce_sum(late.to(self.ctx.device)) > 0)  # every rank stops

    def _describe(self) -> None:
        d = self.drafter.cfg
        ranks = (", loss: each rank's mean over its counted positions, averaged over ranks"
                 if self.ctx.world > 1 else "")  # the DDP weighting (module docstring)
        self.say(
            f"{self.data.summary['samples']} samples ({self.data.summary['kind']}), "
            f"{self.total} steps of {self.cfg.batch_size}x{self.cfg.max_len} tokens on "
            f"{self.ctx.world} rank(s), draft vocab {d.draft_vocab_size}, aux layers "
            f"{d.aux_layer_ids} (canonical), {self.drafter.param_groups()['trainable']:,} "
            f"trainable parameters{ranks}"
        )

    def _batch(self) -> tuple[int, int, Batch]:
        e, b, batch = next(self.loader)
        batch = batch.to(self.ctx.device)
        self.prof.mark("batch")
        if self.target_model is not None:
            run_target(self.target_model, batch, tuple(self.data.aux_layer_ids))
        self.prof.mark("target")
        return e, b, batch

    def _forward(self, batch: Batch) -> tuple[Targets, tuple[torch.Tensor, ...]]:
        tg = make_targets(batch.hidden, self.head, self.used, batch.loss_mask, batch.doc)
        self.prof.mark("targets")
        with torch.autocast(self.ctx.device.type, torch.bfloat16, enabled=self.cfg.bf16):
            out = self.model(
                batch.tokens, batch.aux, batch.positions, batch.doc, tg.prob, tg.label, tg.ok
            )
        self.prof.mark("forward")
        return tg, out

    @contextmanager
    def _step_failure(self, check: bool = True) -> Iterator[None]:
        """A rank's error before the step's first collective (DDP's) raised on every rank: one
        flag over the host group (a rank that raised alone left the others in DDP's all-reduce
        until the group's timeout, a timeout their only line)."""
        if not check:
            yield
            return
        with shared_failure(self.ctx.world, self.ctx.host_group, cheap=True, who=who(self.ctx)):
            yield

    @contextmanager
    def _own(self) -> Iterator[None]:
        """This rank's error named by its rank and host; out of memory as the flags to lower."""
        with ranked(self.ctx), out_of_memory(self.cfg, self.step + 1):
            yield

    def _rebuilding(self) -> bool:
        """DDP's second forward of this process broadcasts its gradient buckets (once): a
        rank whose loader failed must say so before it, not after the forward."""
        return self.ctx.world > 1 and self.step - self.first < DDP_REBUILD_STEPS

    def train_step(self) -> None:
        """One optimizer step. Its statistics reach the host one step later (`_account`), so
        the host never waits for the GPU inside the loop; a non-finite loss still stops the
        run before any log row or checkpoint is written after it."""
        self.prof.begin()
        with self._step_failure():  # one check a step, before backward: the loader and forward
            with self._step_failure(self._rebuilding()), self._own():
                e, b, batch = self._batch()
            with self._own():
                tg, (loss, losses, correct, valid) = self._forward(batch)
        with self._own():  # out of memory here is this rank's alone: DDP's collectives run
            grad = self._backward(loss)
        dev = loss.device
        vec = torch.cat([  # float64 on the device: nothing here may make the host wait
            loss.detach().double().view(1), losses.double(),
            grad.detach().double().view(1).to(dev), (batch.doc >= 0).sum().double().view(1),
            chain_counts(correct, valid).flatten().double(), counted_positions(tg).view(1),
        ])
        self.ctx.all_reduce_sum(vec)
        prev, self.pending = self.pending, Pending.of(vec, loss.detach(),
                                                     (self.step + 1, e, b, batch.samples))
        if prev is not None:
            self._account(prev)
        self.prof.mark("stats")
        self.prof.end()

    def _backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward and the optimizer step; the gradient norm (before clipping)."""
        loss.backward()
        self.prof.mark("backward")
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        grad = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.window.lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.prof.mark("optimizer")
        return grad

    def _flush(self) -> None:
        if self.pending is not None:
            p, self.pending = self.pending, None
            self._account(p)

    def _account(self, p: Pending) -> None:
        if p.event is not None:
            p.event.synchronize()
        v, s, world = p.reduced, self.cfg.ttt_steps, self.ctx.world
        if not torch.isfinite(v[: s + 2]).all():  # the losses and the gradient norm
            step, e, b, samples = p.where
            self._non_finite(float(v[0] / world), float(v[s + 1] / world),
                             bool(torch.isfinite(p.local_loss)), step, e, b, samples)
        w = self.window
        w.n += 1
        w.loss += float(v[0] / world)
        w.step_loss += v[1 : s + 1] / world
        w.grad += float(v[s + 1] / world)
        w.tokens += int(v[s + 2])
        w.counts += v[s + 3 : 5 * s + 3].view(4, s)
        w.counted += float(v[5 * s + 3])
        self.tokens += int(v[s + 2])

    def _non_finite(self, value: float, grad: float, local_ok: bool, step: int, e: int, b: int,
                    samples: list[int]) -> None:
        names = self._sample_names(samples)
        where = "this rank's batch is finite" if local_ok else "this rank's batch is not finite"
        what = f"loss is {value}"
        if math.isfinite(value):
            what = f"gradient norm is {grad} with a finite loss"
            if self.ctx.world > 1:
                where = "gradients are summed over ranks: any rank's batch may be the cause"
        raise DraftsmithError(
            f"{what} at step {step} (epoch {e}, batch {b}, rank "
            f"{self.ctx.rank}: samples {names}; {where}); check those samples' hidden states, "
            "or lower --lr"
        )

    def _sample_names(self, samples: list[int]) -> list[str]:
        sid = getattr(self.data.source, "sample_id", None)
        if sid is None:
            return [str(i) for i in samples]
        return [f"{i} (id {sid(i)})" for i in samples]

    def _log(self) -> str:
        w = self.window
        s = summarize(w.counts)
        row = {
            "step": self.step, "epoch": self.plan.locate(self.step - 1)[0],
            "lr": w.lr, "loss": w.loss / w.n,
            "step_loss": (w.step_loss / w.n).tolist(), **s, "grad_norm": w.grad / w.n,
            "tokens": self.tokens, "tokens_per_s": w.tokens / max(w.seconds, 1e-9),
            "coverage": w.coverage(),
        }
        with shared_failure(self.ctx.world):  # a full disk stops every rank
            if self.ctx.main:
                report.append_log(self.out, row)
        if self.ctx.main and not self.watched:
            self._warn_untrained(w)
        self.watched = True
        self.window = Window(self.cfg.ttt_steps)
        span = measured_words(s["cond_acc"])  # an accept length stops where no chain reached
        return (f"loss {row['loss']:.3f} acc0 {figure(s['acc'][0], '.3f')} "
                f"accept {s['accept_length']:.2f}{f' ({span})' if span else ''} "
                # of the target's own next tokens, not the data's (data vocab's figure)
                f"cover(target) {figure(row['coverage'], '.3f')} "
                f"tok/s {row['tokens_per_s']:.0f}")

    def _warn_untrained(self, w: Window) -> None:
        """One warning line where the first logged window trained on no position (loss 0, the
        weights unmoved), naming the likely cause; a vocab that misses the target stays so."""
        c, steps = self.cfg, f"the first {w.n} step(s)"
        if w.counts[1, 0] == 0:
            why = (f"{steps} held no assistant token a drafter learns: most answers may lie "
                   f"past --max-len {c.max_len} (raise it), or check the data's loss masks")
        elif w.counted == 0:
            why = (f"in {steps} the target's next token was never one of the "
                   f"{self.drafter.cfg.draft_vocab_size} draft tokens (at "
                   f"{int(w.counts[1, 0])} assistant positions): {self._vocab_cause()}")
        else:
            return self._warn_coverage(w)
        warnings.warn(f"nothing trained: {why}; the loss was 0 and the weights did not move",
                      stacklevel=2)

    def _warn_coverage(self, w: Window) -> None:
        """One warning line where the first logged window's draft vocab misses the target's
        next token at many positions: the drafter can never propose those tokens."""
        cov = w.coverage()
        if cov is None or cov >= COVERAGE_FLOOR:
            return
        warnings.warn(
            f"low draft vocab coverage: in the first {w.n} step(s) the target's next token was "
            f"one of the {self.drafter.cfg.draft_vocab_size} draft tokens at {cov:.1%} of "
            f"{int(w.assistant())} assistant positions (under {COVERAGE_FLOOR:.0%}), so no "
            f"draft position can accept more than that: {self._small_vocab_cause()}",
            stacklevel=2)

    def _small_vocab_cause(self) -> str:
        c, size = self.cfg, self.drafter.cfg.draft_vocab_size
        if self._holds_every_data_token:
            return self._data_too_small()
        if c.vocab:
            return (f"--vocab {c.vocab} is too small or was counted on other data; make a larger "
                    "one on this data (`draftsmith data vocab --size N`), or leave --vocab out "
                    "and give --draft-vocab-size")
        if c.init_from and c.draft_vocab_size is None:
            return (f"the vocab of --init-from {c.init_from} is too small or was counted on "
                    "other data; regrow it on this data with a larger --draft-vocab-size")
        return (f"raise --draft-vocab-size (now {size}; on the default target 4,096 tokens "
                "cover ~0.91 of its answers, 16,384 ~0.98), or regenerate the answers with "
                "this target if another model wrote them")

    def _vocab_cause(self) -> str:
        c = self.cfg
        if self._holds_every_data_token:
            return ("the draft vocab holds every token of the data's answers, yet the target "
                    "predicted none of them: the answers were not written by this target, "
                    "or were sampled far from its own choices (a high temperature, a target "
                    "with flat predictions); regenerate them with it, greedily "
                    "(`draftsmith data regenerate --temperature 0`)")
        if c.vocab:
            return (f"--vocab {c.vocab} was likely counted on other data; leave --vocab out (it "
                    "is then counted on this data) or make one with `draftsmith data vocab`")
        if c.init_from:
            return (f"the vocab of --init-from {c.init_from} was likely counted on other data; "
                    "regrow it on this data (--vocab from `draftsmith data vocab`, or another "
                    "--draft-vocab-size)")
        return ("the answers were likely not made by this target (counted on them, the vocab "
                "misses its predictions); regenerate them with the target, or raise "
                "--draft-vocab-size")

    @functools.cached_property
    def _holds_every_data_token(self) -> bool:
        """Whether the draft vocab holds every distinct assistant token of the data, so that no
        larger vocab counted on it could cover more (ids only, read once, for a warning)."""
        counts = self.data.token_counts(self.target.cfg.vocab_size, self.cfg.max_len)
        t2d = self.drafter.t2d.detach().cpu().bool()
        ids = counts.nonzero().flatten()
        inside = bool(ids.numel()) and bool((ids < t2d.numel()).all())
        return inside and bool(t2d[ids].all())

    def _data_too_small(self) -> str:
        c, size = self.cfg, self.drafter.cfg.draft_vocab_size
        who = (f"--vocab {c.vocab}" if c.vocab else f"the vocab of --init-from {c.init_from}"
               if c.init_from and c.draft_vocab_size is None else "the draft vocab")
        return (f"{who} ({size} tokens) already holds every token of the data's answers, so no "
                "larger vocab counted on this data covers more: the rest are the target's own "
                "next tokens (its greedy choice at each position, which cover(target) counts) "
                "that those answers never hold (too little data, or answers sampled or "
                f"retokenized); {more_data_advice(self.data, c.data)}")

    def _summary(self) -> dict[str, Any]:
        rows = report.read_log(self.out) if self.ctx.main else []
        last = rows[-1] if rows else {}
        training = {"steps": self.step, "tokens": self.tokens, "world_size": self.ctx.world,
                    "config": asdict(self.cfg)}
        for key in ("loss", "acc", "cond_acc", "accept_length", "coverage"):
            if key in last:
                training[f"last_{key}"] = last[key]
        return {"training": training, "data": self.data.summary, "vocab": self.vocab_summary}

    def _checkpoint(self) -> None:
        state = {"step": self.step, "tokens": self.tokens, "world": self.ctx.world,
                 "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                 "window": self.window.state(), "config": asdict(self.cfg),
                 "data": self.data_id, "packing": self.plan.packing,
                 "shards": self.shard_stamps}
        ckpt.save_checkpoint(self.out, self.step, self.drafter, state, self._summary(),
                             self.cfg.keep_last, self.ctx.rank, self.ctx.world)
        with shared_failure(self.ctx.world):
            if self.ctx.main:
                report.plot(self.out)

    def _finish(self) -> Path:
        with shared_failure(self.ctx.world):  # every rank ends as rank 0's write did
            if self.ctx.main:
                with ckpt.writing(self.out / WEIGHTS_FILE):  # save_drafter removes its tmp files
                    save_drafter(self.drafter, self.out, **self._summary())
                report.plot(self.out)
        self.say(f"drafter written to {self.out}")
        return self.out


def packing_of(state: dict[str, Any] | None) -> str:
    """The data order a run goes on in: a multi-rank checkpoint written before the epoch was
    packed once and dealt out (no `packing` recorded) resumes in its per-rank packing; one
    process packed alike either way."""
    if state is None or state.get("world", 1) == 1:
        return "global"
    return str(state.get("packing", "per_rank"))


def train(cfg: TrainConfig) -> Path:
    """Train a drafter as `cfg` says; under torchrun every rank calls this."""
    ctx = setup(cfg.device)
    try:
        return Trainer(cfg, ctx).run()
    finally:
        ctx.close()


# how to get more answers, and greedy ones, by the command that made the data
MORE_DATA = {
    "data make": ("a larger `draftsmith data make --n`", "`data make --temperature 0`"),
    "demo": ("a larger `draftsmith demo --conversations`",
             "`draftsmith data make --temperature 0`"),
    "data capture": ("more conversations captured: `draftsmith data regenerate` on more "
                     "prompts, then `data capture`", "`data regenerate --temperature 0`"),
    "online": ("more answered conversations in --prompts, e.g. from `draftsmith data "
               "regenerate`", "`data regenerate --temperature 0`"),
    None: ("a larger `draftsmith data make --n`, or more conversations through `data "
           "regenerate` and `data capture`", "`--temperature 0` in `data make` or `data "
           "regenerate`"),
}


def more_data_advice(data: Any, folder: str | None) -> str:
    """Train on more (or greedy) answers, naming the command that made this data where its
    manifest's commands (or a make.json beside the dataset) record it."""
    from draftsmith.compare.describe import commands

    maker = "online" if data.online else data_maker(commands(data.manifest or {}), folder)
    more, greedy = MORE_DATA[maker]
    return f"train on more data ({more}), or on answers the target wrote greedily ({greedy})"


def data_maker(commands: list[Any], folder: str | None) -> str | None:
    """The last of `commands` that made data (`MORE_DATA`'s keys), else "data make" where its
    make.json lies beside the dataset, else None."""
    found = [m for c in commands if isinstance(c, str) and (m := _maker_of(c))]
    if found:
        return found[-1]
    return "data make" if folder and (Path(folder).parent / "make.json").is_file() else None


def _maker_of(line: str) -> str | None:
    if line.startswith("draftsmith.data.pipeline.make_dataset"):  # make_dataset's own default
        return "data make"
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    names = [w for w in words[1:] if not w.startswith("-")]
    return next((m for m in ("data make", "data capture", "demo")
                 if names[:len(m.split())] == m.split()), None)
