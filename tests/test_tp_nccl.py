"""NCCL settings: validated, recorded, and NVLink multicast never turned on; the all-reduce
benchmark's command on a one-rank gloo group."""

from __future__ import annotations

import json
import os

import pytest

from draftsmith.dist import apply_nccl_env, nccl_env, nccl_record
from draftsmith.errors import DraftsmithError


def test_nccl_env_always_turns_nvls_off():
    assert nccl_env() == {"NCCL_NVLS_ENABLE": "0"}
    env = nccl_env("LL,LL128", "Ring", "NVL", {"NCCL_MIN_NCHANNELS": 4})
    assert env == {"NCCL_PROTO": "LL,LL128", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "NVL",
                   "NCCL_MIN_NCHANNELS": "4", "NCCL_NVLS_ENABLE": "0"}
    assert nccl_env(algo="^NVLS,NVLSTree")["NCCL_ALGO"] == "^NVLS,NVLSTree"
    assert nccl_env(algo="allreduce:tree;allgather:ring")["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"algo": "NVLS"},
        {"algo": "ring,nvlstree"},
        {"algo": "allreduce:NVLS"},
        {"extra": {"NCCL_NVLS_ENABLE": "1"}},
    ],
)
def test_asking_for_nvls_is_refused(kwargs):
    with pytest.raises(DraftsmithError, match="NVLink multicast"):
        nccl_env(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"proto": "LL256"}, "NCCL_PROTO"),
        ({"algo": "Butterfly"}, "NCCL_ALGO"),
        ({"p2p_level": "FAR"}, "NCCL_P2P_LEVEL"),
        ({"extra": {"OMP_NUM_THREADS": "1"}}, "must start with NCCL_"),
    ],
)
def test_bad_settings_are_refused(kwargs, what):
    with pytest.raises(DraftsmithError, match=what):
        nccl_env(**kwargs)


def test_applied_settings_are_recorded(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    apply_nccl_env(nccl_env(proto="LL"))
    rec = nccl_record()
    assert rec["env"]["NCCL_PROTO"] == "LL"
    assert rec["env"]["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(DraftsmithError, match="NVLink multicast"):
        apply_nccl_env(dict(os.environ))


def test_allreduce_bench_command_on_one_cpu_rank(tmp_path, capsys, monkeypatch):
    from draftsmith.bench.allreduce import allreduce_bench

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("NCCL_PROTO", "LL")  # restored after the command sets it
    out = tmp_path / "ar.jsonl"
    allreduce_bench(hidden=64, layers=2, target=None, batch="1,8", q="1,4", dtype="fp32",
                    iters=3, graph_ops=4, tp=1, device="cpu", nccl_proto="Simple",
                    nccl_algo=None, nccl_p2p_level=None, nccl=None, out=out)
    res = json.loads(out.read_text().splitlines()[-1])
    assert [(r["batch"], r["q"]) for r in res["rows"]] == [(1, 1), (1, 4), (8, 1), (8, 4)]
    assert res["rows"][3]["bytes"] == 8 * 4 * 64 * 4
    assert res["nccl"]["env"]["NCCL_PROTO"] == "Simple"
    assert res["backend"] == "gloo" and res["world"] == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res


@pytest.mark.parametrize("flag", ["iters", "layers", "graph_ops", "hidden"])
def test_allreduce_bench_refuses_counts_below_one_by_their_flag(flag):
    from draftsmith.bench.allreduce import allreduce_bench
    from draftsmith.errors import DraftsmithError

    kw = dict(hidden=64, layers=2, target=None, batch="1", q="1", dtype="fp32", iters=3,
              graph_ops=4, tp=1, device="cpu", nccl_proto=None, nccl_algo=None,
              nccl_p2p_level=None, nccl=None, out=None)
    with pytest.raises(DraftsmithError, match=f"--{flag.replace('_', '-')} must be >= 1, got 0"):
        allreduce_bench(**{**kw, flag: 0})


@pytest.mark.gpu
def test_allreduce_bench_nccl_on_one_gpu(tmp_path, monkeypatch):
    import torch

    from draftsmith.bench.allreduce import allreduce_bench

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    out = tmp_path / "ar.jsonl"
    allreduce_bench(hidden=4096, layers=2, target=None, batch="1,8", q="1,4", dtype="bf16",
                    iters=10, graph_ops=8, tp=1, device="cuda", nccl_proto=None,
                    nccl_algo=None, nccl_p2p_level=None, nccl=None, out=out)
    res = json.loads(out.read_text())
    assert res["backend"] == "nccl" and all(r["eager_us"] > 0 for r in res["rows"])


def test_one_process_runs_on_the_gpu_its_device_names(monkeypatch):
    """--device cuda:1 without TP is cuda:1, not the local rank's cuda:0; a missing one is named."""
    import torch

    from draftsmith.dist import init_tp

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert init_tp(1, "cuda:1").device == torch.device("cuda", 1)
    assert init_tp(None, "cuda").device == torch.device("cuda", 0)
    with pytest.raises(DraftsmithError, match="cuda:2, but 2 CUDA device"):
        init_tp(1, "cuda:2")
