"""dist.py, second review: torchrun variables read strictly, NCCL settings validated one way
and written in NCCL's spelling, a running group of another shape refused, and spawn's bad
input, unpicklable results, Ctrl-C and a dead launcher handled."""

from __future__ import annotations

import multiprocessing.context
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from draftsmith import dist
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP


def _returns_a_lambda(tp: TP):
    return lambda: tp.rank


def _sleeps(tp: TP) -> None:
    import time

    time.sleep(60)


@pytest.mark.parametrize("value", ["1_0", "\u0661", "0x1"])
def test_a_rank_that_int_would_read_loosely_is_refused(monkeypatch, value):
    """RANK=1_0 was read as rank 10 (int() takes underscores), RANK=<Arabic-Indic one> as 1."""
    monkeypatch.setenv("RANK", value)
    monkeypatch.setenv("WORLD_SIZE", "20")
    with pytest.raises(DraftsmithError, match=f"^environment variable RANK={value!r} is not an "
                                              "integer$"):
        dist.ranks()
    monkeypatch.setenv("RANK", " 1")
    assert dist.ranks()[0] == 1


def test_a_local_rank_outside_the_world_is_refused(monkeypatch):
    """LOCAL_RANK=7 with WORLD_SIZE=2 was taken (as cuda:7)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "7"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DraftsmithError, match=r"^environment variable LOCAL_RANK=7: with "
                                              r"WORLD_SIZE=2 a local rank is 0 to 1$"):
        dist.ranks()


def test_nccl_values_are_written_in_nccls_spelling():
    """' nvl' was accepted and passed on as is: NCCL matches NCCL_P2P_LEVEL case- and
    space-sensitively, so the setting was ignored while the record claimed it."""
    assert dist.nccl_env(p2p_level=" nvl")["NCCL_P2P_LEVEL"] == "NVL"
    assert dist.nccl_env(proto=" ll , simple")["NCCL_PROTO"] == "LL,Simple"
    assert dist.nccl_env(algo="ring;allreduce: ^tree")["NCCL_ALGO"] == "Ring;allreduce:^Tree"
    assert dist.nccl_env(algo="^nvls,nvlstree")["NCCL_ALGO"] == "^NVLS,NVLSTree"
    # per-collective NCCL_PROTO, as NCCL documents it, was refused as an unknown protocol
    assert dist.nccl_env(proto="LL,Simple;allreduce:^LL")["NCCL_PROTO"] == "LL,Simple;allreduce:^LL"


@pytest.mark.parametrize(("extra", "what"), [
    ({"NCCL_PROTO": "LL256"}, r"^NCCL_PROTO='LL256': unknown value \['LL256'\]"),
    ({"NCCL_ALGO": "Butterfly"}, r"^NCCL_ALGO='Butterfly': unknown value"),
    ({"NCCL_P2P_LEVEL": "FAR"}, r"^NCCL_P2P_LEVEL='FAR': unknown value"),
])
def test_settings_given_through_extra_are_validated_as_named_ones(extra, what):
    """proto='LL256' was refused but extra={'NCCL_PROTO': 'LL256'} passed."""
    with pytest.raises(DraftsmithError, match=what):
        dist.nccl_env(extra=extra)


@pytest.mark.parametrize("algo", ["Ring,", "^", "allreduce:"])
def test_empty_entries_in_an_nccl_list_are_refused(algo):
    with pytest.raises(DraftsmithError, match=r"unknown value \[''\]"):
        dist.nccl_env(algo=algo)


def test_nvls_asked_for_in_an_nccl_conf_file_is_refused(monkeypatch, tmp_path):
    """NCCL reads nccl.conf for what the environment leaves unset: NCCL_ALGO=NVLS there passed
    the check; and NCCL_CONF_FILE hid /etc/nccl.conf, which NCCL reads as well."""
    conf = tmp_path / "nccl.conf"
    conf.write_text("# site settings\nNCCL_ALGO=NVLS\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with pytest.raises(DraftsmithError, match=f"^{conf}: NCCL_ALGO='NVLS' asks for NVLS"):
        dist.ensure_nvls_off()
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # the environment wins over the file
    dist.ensure_nvls_off()
    assert Path("/etc/nccl.conf") in dist._conf_files()


def test_a_bad_tp_size_or_device_is_named():
    with pytest.raises(DraftsmithError, match=r"^tensor-parallel size 0: must be an integer >= 1$"):
        dist.init_tp(0, "cpu")  # was: "needs 0 processes: run under torchrun --nproc-per-node 0"
    with pytest.raises(DraftsmithError, match=r"^device 'cuda:x': tensor parallelism runs on"):
        dist.init_tp(1, "cuda:x")  # was: cuda:0 (or "local rank 0 needs cuda:0")


def test_spawn_refuses_bad_input_before_any_rank_starts(monkeypatch):
    """A lambda was a raw pickling AttributeError, timeout_s=-1 a RuntimeError after starting the
    ranks, nprocs=2.0 a TypeError, device='mps' an error in every started rank."""
    monkeypatch.setattr(dist, "_launch", lambda *a: pytest.fail("ranks were started"))
    cases = [((lambda tp: 1, 1), {}, r"^spawned ranks get fn and args pickled: "),
             ((_sleeps, 1), {"timeout_s": -1}, r"^timeout_s=-1: give seconds > 0"),
             ((_sleeps, 2.0), {}, r"^cannot spawn 2.0 processes: give an integer >= 1$"),
             ((_sleeps, 2), {"device": "mps"}, r"^device 'mps': tensor parallelism runs on ")]
    for args, kwargs, what in cases:
        with pytest.raises(DraftsmithError, match=what):
            dist.spawn(*args, **kwargs)


def test_a_running_group_of_another_shape_is_refused_not_reused():
    """A one-rank gloo group already running here was kept for rank 0 of 2 (or for CUDA tensors):
    collectives hung or failed far from the cause."""
    store = tdist.TCPStore("127.0.0.1", dist.free_port(), 1, is_master=True)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(DraftsmithError, match=r"^this process already runs a process group as "
                                                  r"rank 0 of 1 \(gloo\); rank 0 of 2 on cpu"):
            dist.start_group(0, 2, torch.device("cpu"))
        with pytest.raises(DraftsmithError, match=r"rank 0 of 1 on cuda needs nccl"):
            dist.start_group(0, 1, torch.device("cuda", 0))
        dist.start_group(0, 1, torch.device("cpu"))  # the same group: kept
    finally:
        tdist.destroy_process_group()


def test_a_result_that_cannot_be_pickled_is_one_clear_error():
    """Was a RuntimeError carrying the rank's whole pickling traceback."""
    with pytest.raises(DraftsmithError, match=r"^rank 0: _returns_a_lambda returned a function "
                                              r"that cannot travel back pickled: "):
        dist.spawn(_returns_a_lambda, 1, device="cpu", timeout_s=60)


def test_ctrl_c_while_ranks_start_ends_those_already_started(monkeypatch):
    """Ranks started before the interrupt were left running (waiting for the rest of the group)."""
    started: list = []
    real = multiprocessing.context.SpawnProcess.start

    def start(self) -> None:
        if started:
            raise KeyboardInterrupt
        real(self)
        started.append(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    monkeypatch.setattr(dist, "TERM_S", 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            dist.spawn(_sleeps, 2, device="cpu", timeout_s=60)
        assert not started[0].is_alive()
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
                p.join()


def test_a_rank_ends_when_its_launcher_dies(monkeypatch):
    """A launcher killed by SIGKILL (no finally runs) left its ranks waiting in collectives until
    the group's timeout, holding their GPUs."""
    read, write = os.pipe()
    ended = threading.Event()
    monkeypatch.setattr(os, "_exit", lambda code: ended.set())
    dist._exit_with(read)
    assert not ended.wait(0.2)
    os.close(write)  # as the launcher's end of the sentinel pipe closes when it dies
    assert ended.wait(10)  # at once, not the group's timeout (minutes); load may delay it
    os.close(read)


def test_an_nccl_conf_this_process_cannot_read_is_skipped_as_nccl_skips_it(tmp_path,
                                                                          monkeypatch):
    """An unreadable /etc/nccl.conf (mode 600 root, not UTF-8) was a PermissionError or
    UnicodeDecodeError traceback at every group start, where NCCL itself skips it."""
    conf = tmp_path / "nccl.conf"
    conf.write_bytes(b"NCCL_ALGO=\xff\xfe\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # put back after: ensure_nvls_off pins it
    dist.ensure_nvls_off()
    assert dist.nccl_record()["conf_files"][str(conf)] == {}
