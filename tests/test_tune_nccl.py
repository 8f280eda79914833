"""`draftsmith tune-nccl` and the TP benchmark on CPU (gloo): every NCCL setting in fresh
processes with NVLS off, failures recorded, the compute/communication split, the recommendation,
and a smoke run of benchmarks/tp_bench.py --tiny."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from draftsmith.dist import spawn
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP
from draftsmith.tune import nccl
from draftsmith.tune.tp_targets import (
    RANDOM_8B,
    TINY,
    QuietTP,
    check_split,
    quiet_twin,
    random_model,
)

ROOT = Path(__file__).resolve().parents[1]
LL, RING = nccl.NcclSetting("LL", proto="LL"), nccl.NcclSetting("Ring", algo="Ring")


@pytest.mark.slow  # 10-14 s of spawned ranks: the default suite near 10 min
def test_every_setting_runs_in_fresh_processes_with_its_env_and_nvls_off(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_PROTO", "Simple")  # the parent's own setting must not leak in
    rep = nccl.run_nccl_sweep(2, "tiny", [nccl.DEFAULTS, LL, RING], [(1, 1), (2, 2)], "cpu",
                              "fp32", iters=1, out=tmp_path, log=lambda _: None)
    res = rep["results"]
    assert [r["status"] for r in res] == ["ok", "ok", "ok"]
    pids = [rank["pid"] for r in res for rank in r["ranks"]]
    assert len(set(pids)) == 6 and os.getpid() not in pids
    seen = [[rank["env"] for rank in r["ranks"]] for r in res]
    assert all(env["NCCL_NVLS_ENABLE"] == "0" for envs in seen for env in envs)
    assert [envs[0].get("NCCL_PROTO") for envs in seen] == [None, "LL", None]
    assert [envs[1].get("NCCL_ALGO") for envs in seen] == [None, None, "Ring"]
    assert os.environ["NCCL_PROTO"] == "Simple" and "NCCL_ALGO" not in os.environ
    assert all(r["backend"] == "gloo" for r in res) and nccl.GLOO_NOTE in rep["notes"]
    assert [(v["batch"], v["tokens"]) for v in res[0]["verify"]] == [(1, 1), (2, 2)]
    assert all(v["ms"] > 0 for r in res for v in r["verify"])
    assert [(a["batch"], a["q"]) for a in res[1]["allreduce"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert json.loads((tmp_path / "nccl.json").read_text())["recommendation"]["overall"]
    assert "environment to use: `NCCL_" in (tmp_path / "nccl.md").read_text()


def _flaky_rank(tp: TP, job: dict) -> dict:
    proto, algo = os.environ.get("NCCL_PROTO"), os.environ.get("NCCL_ALGO")
    if proto == "LL128" and tp.rank == 1:
        os._exit(3)  # as a crash inside NCCL would end the process
    if algo == "Tree":
        raise RuntimeError("ncclInvalidUsage: simulated rejection")
    return {**nccl.rank_identity(tp), "verify": [{"batch": 1, "tokens": 1, "ms": 1.0}]}


@pytest.mark.slow  # 10-14 s of spawned ranks: the default suite near 10 min
def test_a_failing_setting_is_recorded_and_the_sweep_goes_on():
    settings = [nccl.DEFAULTS, nccl.NcclSetting("LL128", proto="LL128"),
                nccl.NcclSetting("Tree", algo="Tree"), LL]
    res = nccl.sweep(settings, 2, {}, "cpu", _flaky_rank, timeout_s=60, log=lambda _: None)
    assert [r["status"] for r in res] == ["ok", "failed", "failed", "ok"], [
        r.get("error") for r in res]
    assert "died" in res[1]["error"] and "simulated rejection" in res[2]["error"]
    assert res[2]["env"]["NCCL_ALGO"] == "Tree" and res[3]["ranks"][0]["env"]["NCCL_PROTO"] == "LL"
    assert nccl.recommend(res)["overall"]["choice"] in ("defaults", "LL")


def test_a_setting_past_the_deadline_is_skipped_not_run():
    res = nccl.sweep([nccl.DEFAULTS], 2, {}, "cpu", _flaky_rank, log=lambda _: None, deadline=0.0)
    assert res[0]["status"] == "skipped" and "ranks" not in res[0]


def test_nvls_never_enters_a_setting(monkeypatch):
    for s in nccl.grid("full"):
        env = s.env()
        assert env["NCCL_NVLS_ENABLE"] == "0" and "nvls" not in env.get("NCCL_ALGO", "").lower()
    assert len(nccl.grid("full")) == 14 and len(nccl.grid("quick")) == 6
    with pytest.raises(DraftsmithError, match="NVLink multicast"):
        nccl.NcclSetting("x", algo="NVLS").env()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with nccl.environment(LL):
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NCCL_PROTO"] == "LL"
    assert os.environ["NCCL_NVLS_ENABLE"] == "1" and "NCCL_PROTO" not in os.environ


def _split_rank(tp: TP) -> dict:
    import torch.distributed as dist

    from draftsmith.layers import default_aux_layers

    calls = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real_all_reduce(*a, **k))[1]
    model = random_model(TINY, tp, torch.float32)
    twin = quiet_twin(model)
    ids = torch.arange(6).view(1, 6) % TINY.vocab_size
    pos = torch.arange(6).view(1, 6)
    with torch.no_grad():
        real, quiet = model(ids, pos), twin(ids, pos)
        real_calls = len(calls)
        calls.clear()
        twin(ids, pos)
        quiet_calls = len(calls)
        aux = tuple(default_aux_layers(TINY.num_layers))
        dist.all_reduce = real_all_reduce
        rows = nccl.verify_split(tp, model, [(1, 1), (2, 4)], aux, iters=1, repeats=2)
    return {"real_calls": real_calls, "quiet_calls": quiet_calls, "rows": rows,
            "shapes": (real.logits.shape, quiet.logits.shape),
            "shared": all(a.data_ptr() == b.data_ptr() for a, b in
                          zip(twin.parameters(), model.parameters(), strict=True)),
            "differs": not torch.allclose(real.hidden, quiet.hidden)}


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_compute_only_twin_skips_every_collective_with_the_same_shapes():
    for out in spawn(_split_rank, 2, device="cpu", timeout_s=90):
        assert out["real_calls"] == 2 * TINY.num_layers + 1  # 2 row layers a layer + embedding
        assert out["quiet_calls"] == 0
        assert out["shapes"][0] == out["shapes"][1] and out["shared"] and out["differs"]
        for r in out["rows"]:
            assert r["total_ms"] > 0 and r["compute_ms"] > 0
            assert r["comm_ms"] == pytest.approx(r["total_ms"] - r["compute_ms"])
            assert r["comm_pct"] == pytest.approx(100 * r["comm_ms"] / r["total_ms"])
        assert [(r["batch"], r["tokens"]) for r in out["rows"]] == [(1, 1), (2, 4)]


def test_quiet_tp_collectives_are_no_ops():
    q = QuietTP(0, 4, None, "cpu")
    x = torch.randn(2, 3)
    assert q.all_reduce(x) is x
    assert torch.equal(q.all_gather_last(x), torch.cat([x] * 4, -1))


def test_random_model_holds_only_its_shard_and_shapes_are_checked():
    model = random_model(TINY, TP(1, 2, None, "cpu"), torch.bfloat16)
    qkv = model.layers[0].attn.qkv.weight
    assert qkv.shape == ((4 + 2 + 2) * 16 // 2, 64) and qkv.dtype == torch.bfloat16
    assert model.embed.weight.shape == (256, 64) and not qkv.is_meta
    assert check_split(RANDOM_8B, 2) is None and check_split(RANDOM_8B, 8) is None
    smol = TINY.__class__(**{**TINY.to_dict(), "num_heads": 9, "num_kv_heads": 3,
                                 "intermediate_size": 96})
    assert "9 attention heads" in check_split(smol, 2) and check_split(smol, 3) is None


def _result(name: str, times: dict, spread: float = 0.0) -> dict:
    env = {"NCCL_PROTO": name} if name != "defaults" else {}
    return {"setting": name, "status": "ok", "env": {**env, "NCCL_NVLS_ENABLE": "0"},
            "verify": [{"batch": b, "tokens": n, "ms": ms, "spread_pct": spread}
                       for (b, n), ms in times.items()]}


def test_recommendation_picks_the_fastest_beyond_noise_else_defaults():
    res = [_result("defaults", {(1, 1): 10.0, (8, 4): 10.0, (8, 8): 10.0}),
           _result("LL", {(1, 1): 8.0, (8, 4): 9.8, (8, 8): 10.5}),
           _result("Simple", {(1, 1): 9.0, (8, 4): 11.0, (8, 8): 9.0}, spread=12.0),
           {"setting": "LL128", "status": "failed", "error": "boom"}]
    rec = nccl.recommend(res, noise_pct=3.0)
    by = {(p["batch"], p["tokens"]): p for p in rec["per_shape"]}
    assert by[(1, 1)]["choice"] == "LL" and by[(1, 1)]["gain_pct"] == pytest.approx(20.0)
    assert by[(1, 1)]["env_line"] == "NCCL_PROTO=LL NCCL_NVLS_ENABLE=0"
    assert by[(8, 4)]["choice"] == "defaults" and by[(8, 4)]["best"] == "LL"  # 2 % < 3 %
    # Simple is 10 % faster at (8, 8), but its runs spread by 12 %: not a win
    assert by[(8, 8)]["choice"] == "defaults" and by[(8, 8)]["best"] == "Simple"
    assert by[(8, 8)]["margin_pct"] == pytest.approx(12.0)
    overall = rec["overall"]
    assert overall["choice"] == "LL" and overall["env_line"].startswith("NCCL_PROTO=LL ")
    gm = (0.8 * 0.98 * 1.05) ** (1 / 3)
    assert overall["gain_pct"] == pytest.approx(100 * (1 - gm))


def test_recommendation_says_defaults_when_nothing_wins_and_copes_with_failures():
    flat = [_result("defaults", {(1, 1): 10.0}), _result("LL", {(1, 1): 9.9})]
    rec = nccl.recommend(flat)
    assert rec["overall"]["choice"] == "defaults"
    assert rec["overall"]["env_line"] == "NCCL_NVLS_ENABLE=0"
    no_base = [{"setting": "defaults", "status": "failed", "error": "x"},
               _result("LL", {(1, 1): 9.9}), _result("Ring", {(1, 1): 9.0})]
    rec = nccl.recommend(no_base)
    assert rec["overall"]["choice"] == "Ring" and rec["overall"]["gain_pct"] is None
    assert "defaults failed" in rec["note"]
    assert nccl.recommend(no_base[:1])["overall"] is None


@pytest.mark.slow  # ~29 s: the whole script; the sweep and TP runs it calls are tested above
def test_tp_bench_tiny_end_to_end(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # spawned ranks import it by name
    import tp_bench
    rep = tp_bench.main(["--tiny", "--out", str(tmp_path), "--new", "8"])
    assert [(r["target"], r["tp"], r["status"]) for r in rep["runs"]] == [
        ("tiny", 1, "ok"), ("tiny", 2, "ok")]
    on_disk = json.loads((tmp_path / "tp_bench.json").read_text())
    assert on_disk["answer"] == rep["answer"] and len(rep["answer"]) == 2
    kinds = {(r["tp"], r["batch"], r["comm"]) for r in rep["step_sweep"]}
    assert kinds == {(1, 1, True), (1, 8, True), (2, 1, True), (2, 8, True),
                     (2, 1, False), (2, 8, False)}
    assert all(0 <= r["best_steps"] <= tp_bench.MAX_STEPS for r in rep["step_sweep"])
    tp2 = rep["runs"][1]
    assert len({tp2["pid"], rep["runs"][0]["pid"], os.getpid()}) == 3
    assert all(s["accept_length"] >= 1.0 for s in tp2["spec"]) and tp2["allreduce"]
    assert [r["status"] for r in rep["nccl_sweep"]["results"]] == ["ok", "ok"]
    md = (tmp_path / "tp_bench.md").read_text()
    for head in ("Baseline and speculative", "compute vs all-reduce", "Step sweep",
                 "NCCL settings sweep", "timing only"):
        assert head in md
    assert (tmp_path / "nccl" / "nccl.json").is_file()


def test_bad_sweep_flags_are_refused_before_any_setting_runs(tmp_path):
    (taken := tmp_path / "taken").write_text("x")
    kw = dict(target="tiny", settings=[nccl.DEFAULTS], shapes=[(1, 1)], device="cpu",
              dtype="fp32", iters=1, rank_fn=_flaky_rank, log=lambda _: None)
    with pytest.raises(DraftsmithError, match="--tp must be >= 1, got 0"):
        nccl.run_nccl_sweep(0, **kw)
    with pytest.raises(DraftsmithError, match="--iters must be >= 1, got 0"):
        nccl.run_nccl_sweep(2, **{**kw, "iters": 0})
    with pytest.raises(DraftsmithError, match="--out .*taken: is a file, not a folder"):
        nccl.run_nccl_sweep(2, **kw, out=taken)
    assert taken.read_text() == "x"


def test_verifies_wider_than_the_context_fit_the_timing_runtime():
    model = random_model(TINY, TP(), torch.float32)
    with torch.no_grad():
        rows = nccl.verify_times(TP(), model, [(1, 4), (2, 72)], (0, 2), iters=1, repeats=1)
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 4), (2, 72)]
    assert all(r["ms"] > 0 for r in rows)


def _unmet_once_rank(tp: TP, job: dict) -> dict:
    """Fails as dist.join does where the ranks could not meet, on the first launch only: a rank
    of it fails where no rank has yet (a rank of its own mark alone raced: one the launcher
    ended, after its peer failed, before it ran failed the second launch too)."""
    mark = Path(job["mark"]) / f"rank{tp.rank}"
    if not any(Path(job["mark"]).glob("rank*")):
        mark.touch()
        raise DraftsmithError(f"rank {tp.rank} of 2 could not join the process group at "
                              "127.0.0.1:1: Connection closed by peer")
    return {**nccl.rank_identity(tp), "verify": [{"batch": 1, "tokens": 1, "ms": 1.0}]}


@pytest.mark.slow  # spawned ranks, three launches
def test_ranks_that_could_not_meet_are_launched_once_more(tmp_path):
    settings = [nccl.DEFAULTS, nccl.NcclSetting("Tree", algo="Tree")]
    res = nccl.sweep(settings, 2, {"mark": str(tmp_path)}, "cpu", _unmet_once_rank,
                     timeout_s=60, log=lambda _: None)
    assert [r["status"] for r in res] == ["ok", "ok"], [r.get("error") for r in res]
    assert res[0]["launches"] == 2 and "launches" not in res[1]
