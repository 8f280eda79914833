"""Training review 17: an error in one rank's forward (a bug, out of memory) stops every rank
with its line, through the step's one shared check before backward, instead of leaving the
others in DDP's all-reduce until the launcher's timeout."""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_review3 import config, log_rows
from test_train_review7 import run_rank, two_ranks
from test_train_review16 import _rank_env

from draftsmith.errors import DraftsmithError
from draftsmith.train import TrainConfig

OOM = ("CUDA out of memory. Tried to allocate 80.00 GiB. GPU 0 has a total capacity of 79.10 "
       "GiB of which 1.00 GiB is free.\nOf the allocated memory 70.00 GiB is allocated by "
       "PyTorch")


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def _fail_at(fault: str, at: int) -> None:
    """This rank's `at`-th forward (fault "error" or "oom") or batch read ("loader") raises."""
    from draftsmith.train import loop

    made = {"error": lambda: RuntimeError("boom"), "oom": lambda: torch.OutOfMemoryError(OOM),
            "loader": lambda: DraftsmithError("shard-00001.safetensors: shard read came back "
                                              "short")}[fault]
    calls = [0]

    def counted(real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == at:
                raise made()
            return real(*args, **kwargs)
        return call

    if fault != "loader":
        loop.TTTModel.forward = counted(loop.TTTModel.forward)  # type: ignore[method-assign]
        return
    real_batches = loop.batches

    class Batches:  # the loader's iterator, its `at`-th batch unreadable
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.it = real_batches(*args, **kwargs)
            self.next = counted(lambda: next(self.it))

        def __next__(self) -> Any:
            return self.next()

        def close(self) -> None:
            self.it.close()

    loop.batches = Batches  # type: ignore[assignment,misc]


def _faulty(rank: int, world: int, port: int, cfg: TrainConfig, dump: str, fault: str,
            at: int) -> None:
    _rank_env(rank, world, port, hosts=False)
    if rank == 1:
        _fail_at(fault, at)
    run_rank(cfg, dump, rank)


@pytest.mark.parametrize("at", [1, 3])
def test_an_error_in_one_ranks_forward_stops_every_rank_with_its_line(root, tmp_path, at):
    """Rank 1 raised alone, rank 0 waiting in DDP's all-reduce of the backward: now rank 1
    keeps its own error and rank 0 stops with a line naming it, its rank and host."""
    cfg = config(root, str(tmp_path / "out"), max_steps=4, batch_size=1, log_every=10)
    said = two_ranks(_faulty, (cfg, str(tmp_path), "error", at), tmp_path, 20)
    assert said == [f"rank 1 (host {socket.gethostname()}) failed (RuntimeError: boom); its log "
                    "says more", "RuntimeError: boom"], said


def test_out_of_memory_on_one_rank_names_the_flags_to_lower_on_every_rank(root, tmp_path):
    cfg = config(root, str(tmp_path / "out"), max_steps=4, batch_size=1, log_every=10)
    said = two_ranks(_faulty, (cfg, str(tmp_path), "oom", 3), tmp_path, 20)
    assert said[0] == said[1] == (
        f"rank 1 (host {socket.gethostname()}): out of memory at step 3 allocating 80.00 GiB "
        "(--batch-size 1 rows of --max-len 48 tokens a rank): lower --batch-size or --max-len"
    ), said


def test_out_of_memory_in_one_process_is_the_line_naming_the_flags(root, tmp_path):
    from test_train_review6 import quiet_train

    from draftsmith.train import loop

    real = loop.TTTModel.forward
    try:
        _fail_at("oom", 2)
        with pytest.raises(DraftsmithError, match=r"^out of memory at step 2 allocating 80.00 "
                           r"GiB \(--batch-size 1 rows of --max-len 48 tokens a rank\): lower "
                           "--batch-size or --max-len$"):
            quiet_train(config(root, str(tmp_path / "out"), max_steps=3, batch_size=1))
    finally:
        loop.TTTModel.forward = real  # type: ignore[method-assign]


def _watched(rank: int, world: int, port: int, cfg: TrainConfig, dump: str,
             checked: bool) -> None:
    """Each forward and shared check of this rank, in order, to dump/events{rank}.txt; not
    `checked`: the step's checks left out (the losses they must not change)."""
    from draftsmith.train import dist as tdist
    from draftsmith.train import loop

    _rank_env(rank, world, port, hosts=False)
    events: list[str] = []
    real_forward, real_check = loop.TTTModel.forward, tdist._any_failed

    def forward(*args, **kwargs):
        events.append("forward")
        return real_forward(*args, **kwargs)

    def check(*args, **kwargs):
        events.append("check")
        return real_check(*args, **kwargs)

    @contextmanager
    def unchecked(self, check: bool = True):
        yield

    loop.TTTModel.forward, tdist._any_failed = forward, check  # type: ignore[method-assign]
    loop.report.plot = lambda out: None  # seconds of matplotlib, no part of this test
    if not checked:
        loop.Trainer._step_failure = unchecked  # type: ignore[method-assign]
    run_rank(cfg, dump, rank)
    Path(dump, f"events{rank}.txt").write_text(" ".join(events))


def test_the_steps_one_check_follows_the_forward_covers_the_loader_and_changes_no_loss(
        root, tmp_path):
    """Checked before the forward only, an error there went unshared; now one check a step
    follows it (one before it too in the first two steps: DDP's bucket rebuild). A loader
    error past those steps is still every rank's, the losses of a run without one unchanged."""
    runs, events = {}, {}
    for checked in (True, False):
        out = tmp_path / f"out-{checked}"
        cfg = config(root, str(out), max_steps=5, batch_size=1)
        assert two_ranks(_watched, (cfg, str(tmp_path), checked), tmp_path, 20) == \
            ["finished", "finished"]
        runs[checked] = [row["loss"] for row in log_rows(out)]
        events[checked] = [(tmp_path / f"events{r}.txt").read_text() for r in range(2)]
    assert events[True] == [" ".join(["check forward check"] * 2 + ["forward check"] * 3)] * 2
    assert len(runs[True]) == 5 and runs[True] == runs[False], runs
    cfg = config(root, str(tmp_path / "out"), max_steps=5, batch_size=1, log_every=10)
    said = two_ranks(_faulty, (cfg, str(tmp_path), "loader", 4), tmp_path, 20)
    assert said[0] == said[1] == (f"rank 1 (host {socket.gethostname()}): "
                                  "shard-00001.safetensors: shard read came back short"), said
