"""Process groups, third review: a bounded join (DRAFTSMITH_DIST_TIMEOUT) named in one line,
collectives keeping their own timeout, and bench-allreduce's --device refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from draftsmith import dist
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP

JOIN = """
import sys, time, torch
from draftsmith import dist
from draftsmith.errors import DraftsmithError
t = time.monotonic()
try:
    dist.start_group(int(sys.argv[1]), 2, torch.device("cpu"))
except DraftsmithError as e:
    print(f"{time.monotonic() - t:.1f}|{e}")
"""


def _join_alone(rank: int, port: int, timeout: str) -> tuple[float, str]:
    """start_group as `rank` of 2 in a fresh process whose partner never comes."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DRAFTSMITH_DIST_TIMEOUT": timeout, "TORCH_CPP_LOG_LEVEL": "FATAL"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", JOIN, str(rank)], env=env, timeout=60,
                         capture_output=True, text=True)
    assert "|" in out.stdout, out.stderr[-2000:]
    took, said = out.stdout.strip().split("|", 1)
    return float(took), said


@pytest.mark.parametrize("rank", [1, 0])
def test_a_join_nobody_answers_fails_within_the_timeout_in_one_line(rank):
    """A rank whose MASTER_ADDR:MASTER_PORT nobody listened on (or whose partners never came)
    waited torch's default 30 minutes before failing."""
    port = dist.free_port()
    took, said = _join_alone(rank, port, "2")
    assert took < 20
    assert "\n" not in said
    assert said.startswith(f"rank {rank} of 2 could not join the process group at "
                           f"127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s")
    assert "DRAFTSMITH_DIST_TIMEOUT" in said


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
def test_a_join_timeout_that_is_no_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(dist.free_port()))
    monkeypatch.setenv("DRAFTSMITH_DIST_TIMEOUT", value)
    with pytest.raises(DraftsmithError, match=f"^environment variable DRAFTSMITH_DIST_TIMEOUT="
                                              f"{value!r}: give seconds > 0"):
        dist.start_group(0, 1, torch.device("cpu"))
    assert not torch.distributed.is_initialized()


def _late_sum(tp: TP) -> float:
    if tp.rank == 1:
        time.sleep(4)  # past the join timeout, well within a collective's
    x = torch.ones(1)
    torch.distributed.all_reduce(x, group=tp.group)
    return float(x.item())


def test_the_join_timeout_leaves_collectives_their_own(monkeypatch):
    """The join is bounded; a collective that waits past it on a slow rank still completes."""
    monkeypatch.setenv("DRAFTSMITH_DIST_TIMEOUT", "2")
    assert dist.spawn(_late_sum, 2, device="cpu", timeout_s=60) == [2.0, 2.0]


def test_a_lone_group_keeps_the_default_timeouts(monkeypatch):
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(dist.free_port()))
    monkeypatch.setenv("DRAFTSMITH_DIST_TIMEOUT", "2")
    dist.start_group(0, 1, torch.device("cpu"))
    try:
        assert c10d._get_default_store().timeout == timedelta(minutes=30)
    finally:
        dist.shutdown()


def _bench(**kw):
    from draftsmith.bench import allreduce

    args = dict(hidden=64, layers=2, target=None, batch="1", q="1", dtype="fp32", iters=2,
                graph_ops=2, tp=0, device="cpu", nccl_proto=None, nccl_algo=None,
                nccl_p2p_level=None, nccl=None, out=None)
    return allreduce.allreduce_bench(**{**args, **kw})


@pytest.mark.parametrize("device, tp", [("cuda", 0), ("cuda", 2), ("cuda:1", 1)])
def test_bench_allreduce_on_cuda_without_a_gpu_names_device(monkeypatch, device, tp):
    """--device cuda on a machine without a GPU said 'local rank 0 needs cuda:0' or '--tp 2 on
    cuda needs 2 CUDA devices': neither named --device, nor --device cpu as the way out."""
    from draftsmith.bench import allreduce

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(DraftsmithError, match=f"^--device {device}: no CUDA device is visible "
                                              "here; .*--device cpu") as e:
        _bench(device=device, tp=tp)
    assert "\n" not in str(e.value)


def test_bench_allreduce_names_a_device_it_does_not_know(monkeypatch):
    from draftsmith.bench import allreduce

    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(DraftsmithError, match="^--device gpu: use cuda, cuda:N, cpu or auto$"):
        _bench(device="gpu")


def test_a_one_rank_bench_does_not_race_for_its_store_port(monkeypatch):
    """--tp 1 bound its store to a port free_port had seen free; another process taking it in
    between ended the run in a DistNetworkError traceback (the OS now picks the port)."""
    import socket

    from draftsmith.bench import allreduce

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(allreduce, "free_port", lambda: taken.getsockname()[1],
                            raising=False)
        opts = {"hidden": 8, "batches": [1], "qs": [1], "dtype": "fp32", "iters": 1,
                "graph_ops": 1, "layers": 1}
        res = allreduce.bench_rank(TP(device=torch.device("cpu")), opts)
    assert res["world"] == 1 and len(res["rows"]) == 1
    assert not torch.distributed.is_initialized()
