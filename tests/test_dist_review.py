"""Spawned TP ranks on CPU over gloo: failures name their cause, a taken port is picked again,
and no rank's end leaves the launch waiting."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from draftsmith import dist
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP


def _sum_ranks(tp: TP) -> list[float]:
    x = torch.full((2,), float(tp.rank + 1))
    return tp.all_reduce(x).tolist()


def _rank1_crashes_mid_collective(tp: TP) -> list[float]:
    if tp.rank == 1:
        time.sleep(0.3)  # rank 0 is waiting in the all-reduce by now
        os._exit(3)  # as an OOM kill or a segfault: no message, the peer's sockets close
    return _sum_ranks(tp)


def _teardown_crashes(tp: TP) -> str:
    dist.shutdown = lambda: os._exit(1)  # the group's teardown dies right after the result
    return "finished"


def _rank1_refuses_rank0_ignores_sigterm(tp: TP) -> None:
    if tp.rank == 1:
        time.sleep(0.3)
        raise DraftsmithError("bad input on rank 1")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_a_rank_that_dies_is_named_not_the_peer_whose_collective_it_broke():
    """Rank 0's gloo traceback ("Connection closed by peer") was the error shown, and rank 1's
    death (exit code 3) went unmentioned."""
    # rank 0's own failure follows when it is reported in time (it raced the launcher once in
    # ~20 runs on a loaded host): the rank that died comes first either way
    with pytest.raises(RuntimeError, match=r"^rank 1 died \(exit code 3\)(; rank 0 then failed|$)"):
        dist.spawn(_rank1_crashes_mid_collective, 2, device="cpu", timeout_s=60)


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_a_port_taken_before_rank_0_binds_it_is_picked_again(monkeypatch):
    """The port free_port found was another process's by the time rank 0 listened (seconds of
    spawning later): the launch failed naming a port the user never chose."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real = dist.free_port
        monkeypatch.setattr(dist, "free_port", lambda: next(ports, None) or real())
        assert dist.spawn(_sum_ranks, 1, device="cpu", timeout_s=60) == [[1.0, 1.0]]


def test_a_port_taken_every_time_is_one_clear_error(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(dist, "free_port", lambda: port)
        monkeypatch.setattr(dist, "PORT_TRIES", 1)
        with pytest.raises(DraftsmithError, match=f"127.0.0.1:{port}: .*address already in use"):
            dist.spawn(_sum_ranks, 1, device="cpu", timeout_s=60)


def test_a_result_sent_before_a_crashing_teardown_arrives():
    """The rank's result sat in its queue's feeder thread when the teardown ended the process:
    'rank 0 died (exit code 1)' for a rank that had finished."""
    assert dist.spawn(_teardown_crashes, 1, device="cpu", timeout_s=60) == ["finished"]


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_a_rank_that_ignores_sigterm_does_not_hold_the_failed_launch(monkeypatch):
    """The launch terminated rank 0 and joined it without a limit: it waited forever."""
    monkeypatch.setattr(dist, "TERM_S", 0.5, raising=False)
    caught: list[str] = []

    def launch() -> None:
        try:
            dist.spawn(_rank1_refuses_rank0_ignores_sigterm, 2, device="cpu", timeout_s=60)
        except DraftsmithError as e:
            caught.append(str(e))

    waiter = threading.Thread(target=launch, daemon=True)
    waiter.start()
    waiter.join(40)
    assert not waiter.is_alive(), "the launch still waits on the rank that ignores SIGTERM"
    assert caught == ["rank 1: bad input on rank 1"]


def test_an_explicit_gpu_of_spawned_ranks_is_refused_before_any_starts(monkeypatch):
    """Spawned rank r runs on cuda:r: --device cuda:4 --tp 2 ran on cuda:0 and cuda:1 without a
    word; too few GPUs failed only inside the ranks."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "_launch", lambda *a: pytest.fail("ranks were started"))
    with pytest.raises(DraftsmithError, match=r"^--device cuda:1 with --tp 2: spawned rank r "):
        dist.launch_tp(_sum_ranks, 2, device="cuda:1")
    with pytest.raises(DraftsmithError, match=r"^--tp 4 on cuda needs 4 CUDA devices.*2 visible"):
        dist.spawn(_sum_ranks, 4, device="cuda")


def test_a_torchrun_rank_given_another_ranks_gpu_is_refused(monkeypatch):
    """As training refuses it: rank 1 of `torchrun ... --device cuda:0` ran on cuda:1."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "start_group", lambda *a: pytest.fail("joined the group"))
    with pytest.raises(DraftsmithError, match=r"^--device cuda:0: rank 1 runs on cuda:1 "):
        dist.init_tp(2, "cuda:0")


@pytest.mark.parametrize(("given", "other"), [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_half_a_torchrun_environment_is_refused_as_training_refuses_it(monkeypatch, given, other):
    """RANK=1 alone: `generate` ran as a lone process and printed nothing (a rank other than 0
    prints nothing), exit 0; WORLD_SIZE=2 alone ran as the only rank."""
    monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(given, "1")
    with pytest.raises(DraftsmithError, match=f"^environment variable {given} is set but {other} "
                                              "is not"):
        dist.launch_tp(_sum_ranks, 1, device="cpu")
