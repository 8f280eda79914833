"""`draftsmith tune` and `bench-allreduce`, third review: a static batch priced at its rows'
expected largest cycle count, the NCCL sweep on the drafter's aux layers, its recommendation
with shapes only some settings timed, deduplicated all-reduce shapes and the usual dtype names,
and a failed tune's measurements kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftsmith.tune.cost_model import (
    EXACT_TOKENS,
    Acceptance,
    PromptMix,
    SpecSetting,
    cycle_survival,
    cycle_tail,
    expected_cycles,
    expected_max_cycles,
)


def _simulated_max(tails: list[tuple[float, ...]], tokens: int, runs: int = 6000) -> float:
    """Monte Carlo E[max over independent rows of their cycles to make `tokens` tokens]."""
    rng, worst = np.random.default_rng(0), np.zeros(runs)
    for tail in tails:
        pmf = -np.diff(np.append(tail, 0.0))
        draws = rng.choice(np.arange(1, len(pmf) + 1), p=pmf, size=(runs, tokens))
        cycles = (np.cumsum(draws, axis=1) < tokens).sum(axis=1) + 1
        worst = np.maximum(worst, cycles)
    return float(worst.mean())


CHAIN = SpecSetting(3)
TREE = SpecSetting(3, 2, 6)
ROWS = [(Acceptance(chain=(0.6, 0.5, 0.4)), CHAIN), (Acceptance(chain=(0.7, 0.5, 0.4)), CHAIN),
        (Acceptance(chain=(0.5,) * 3, tree=((0.5, 0.2),) * 3), TREE)]


@pytest.mark.parametrize("tokens", [1, 5, 40, EXACT_TOKENS + 144])
def test_a_batchs_cycles_are_the_expected_largest_of_its_rows(tokens):
    tails = [cycle_tail(a, s) for a, s in ROWS]
    dists = [cycle_survival(t, tokens) for t in tails]
    for (start, sv), t in zip(dists, tails, strict=True):
        assert start + sv.sum() == pytest.approx(expected_cycles(t, tokens), rel=1e-3)
    got = expected_max_cycles(dists)
    assert got == pytest.approx(_simulated_max(tails, tokens), rel=0.01)
    if 1 < tokens < EXACT_TOKENS:  # the largest of the expectations undercounts
        assert got > max(expected_cycles(t, tokens) for t in tails) * 1.04


def test_static_batches_idle_their_rows_till_the_slowest_actual_end():
    """Eight prompts alike, 64 tokens after the prefill: the model said every slot decodes
    (busy 100 %), but a batch waits for its unluckiest row (simulated: 88 %)."""
    acc = Acceptance(chain=(0.6, 0.5, 0.4))
    busy, _ = PromptMix((acc,) * 8).fixed_length(CHAIN, 8, 65)
    tail = cycle_tail(acc, CHAIN)
    want = expected_cycles(tail, 64) / _simulated_max([tail] * 8, 64)
    assert busy == pytest.approx(want, rel=0.01) and busy < 0.95


def test_a_prompt_repeated_in_a_batch_decodes_alike_unless_sampled():
    acc = Acceptance(chain=(0.6, 0.5, 0.4))
    assert PromptMix((acc,)).fixed_length(CHAIN, 4, 65)[0] == pytest.approx(1.0)
    sampled = PromptMix((acc,), sampled=True).fixed_length(CHAIN, 4, 65)[0]
    tail = cycle_tail(acc, CHAIN)
    assert sampled == pytest.approx(expected_cycles(tail, 64) / _simulated_max([tail] * 4, 64),
                                    rel=0.01)


# ---- tune --nccl-sweep: the drafter's aux layers --------------------------------------------


def test_tune_nccl_sweep_times_verifies_with_the_drafters_aux_layers(tmp_path, monkeypatch):
    """The sweep captured EAGLE-3's default layers, not the drafter's (its config holds them)."""
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.tune import cli, nccl
    from draftsmith.tune.tp_targets import TINY

    save_drafter(Eagle3Drafter(Eagle3Config.for_target(TINY, 64, [0, 2, 3])), tmp_path / "d")
    seen = {}
    monkeypatch.setattr(nccl, "run_nccl_sweep", lambda *a, **k: seen.update(k) or {"x": 1})
    monkeypatch.setattr(nccl, "print_report", lambda res: None)
    report = {"recommendations": [{"batch": 1, "verify_tokens": 4}]}
    cli._nccl_for(report, 2, "t", "cpu", torch.float32, "quick", tmp_path / "n", tmp_path / "d")
    assert seen["aux"] == [0, 2, 3]


def test_an_nccl_setting_captures_the_layers_it_is_given(monkeypatch):
    import draftsmith.bench.allreduce
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.parallel import TP
    from draftsmith.tune import nccl

    seen = []
    monkeypatch.setattr(nccl, "verify_times", lambda tp, model, shapes, aux, *a: seen.append(aux))
    monkeypatch.setattr(draftsmith.bench.allreduce, "measure", lambda *a: [])
    for aux, want in (([1, 3], (1, 3)), (None, (0, 1, 2))):  # tiny: 4 layers
        res = nccl.nccl_rank(TP(), nccl.job_for("tiny", [(1, 2)], "fp32", 1, aux=aux))
        assert seen[-1] == want and res["aux"] == list(want)
    with pytest.raises(DraftsmithError, match=r"aux layer ids \[9\] out of range"):
        nccl.run_nccl_sweep(2, "tiny", [nccl.DEFAULTS], [(1, 2)], "cpu", "fp32", iters=1,
                            log=lambda _: None, aux=[1, 9], rank_fn=pytest.fail)


# ---- tune-nccl's recommendation --------------------------------------------------------------


def _result(name: str, times: dict) -> dict:
    from draftsmith.tune import nccl

    s = nccl.DEFAULTS if name == "defaults" else nccl.NcclSetting(name, proto=name)
    return {"setting": name, "status": "ok", "env": s.env(),
            "verify": [{"batch": b, "tokens": n, "ms": ms, "spread_pct": 1.0}
                       for (b, n), ms in times.items()]}


def test_a_shape_the_defaults_did_not_time_is_no_keyerror():
    from draftsmith.tune import nccl

    res = [_result("LL", {(1, 1): 8.0, (8, 4): 9.0}), _result("defaults", {(1, 1): 10.0}),
           _result("Simple", {(2, 2): 1.0})]
    rec = nccl.recommend(res)
    by = {(p["batch"], p["tokens"]): p for p in rec["per_shape"]}
    assert list(by) == [(1, 1), (8, 4), (2, 2)]
    assert by[(1, 1)]["choice"] == "LL" and by[(1, 1)]["gain_pct"] == pytest.approx(20.0)
    assert by[(8, 4)]["choice"] == "LL" and by[(8, 4)]["gain_pct"] is None  # nothing to compare
    assert rec["overall"]["choice"] == "LL"  # over the defaults' shapes; Simple missed them
    assert rec["overall"]["gain_pct"] == pytest.approx(20.0)


# ---- bench-allreduce: repeated shapes, dtype names ------------------------------------------


def _allreduce(monkeypatch, tmp_path, **kw) -> dict:
    import json

    from draftsmith.bench import allreduce

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    out = tmp_path / "ar.jsonl"
    opts = dict(hidden=32, layers=2, target=None, batch="1", q="1", dtype="fp32", iters=1,
                graph_ops=1, tp=1, device="cpu", nccl_proto=None, nccl_algo=None,
                nccl_p2p_level=None, nccl=None, out=out)
    allreduce.allreduce_bench(**{**opts, **kw})
    return json.loads(out.read_text().splitlines()[-1])


def test_allreduce_times_a_repeated_shape_once(monkeypatch, tmp_path):
    res = _allreduce(monkeypatch, tmp_path, batch="8,2,8", q="4,1,4,4")
    assert [(r["batch"], r["q"]) for r in res["rows"]] == [(8, 4), (8, 1), (2, 4), (2, 1)]


@pytest.mark.parametrize(("name", "key"), [("float32", "fp32"), ("bfloat16", "bf16"),
                                           ("float16", "fp16"), ("fp32", "fp32"),
                                           ("auto", "fp32")])
def test_allreduce_takes_every_commands_dtype_names(monkeypatch, tmp_path, name, key):
    from draftsmith.bench.allreduce import dtype_key, resolve_auto

    assert resolve_auto(dtype_key(name), "cpu", 1) == key
    if name in ("float32", "auto"):
        assert _allreduce(monkeypatch, tmp_path, dtype=name)["dtype"] == "fp32"


def test_allreduce_refuses_an_unknown_dtype_before_launching(monkeypatch, tmp_path):
    from draftsmith.bench import allreduce
    from draftsmith.errors import DraftsmithError

    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(DraftsmithError, match="--dtype 'float64': use float32, bfloat16"):
        _allreduce(monkeypatch, tmp_path, dtype="float64")


# ---- tune keeps what it measured when it fails --------------------------------------------


def test_a_tune_that_fails_partway_keeps_what_it_measured(tmp_path, monkeypatch):
    import json

    from test_tune_cli import _tiny_pair

    from draftsmith.errors import DraftsmithError
    from draftsmith.tune import cli, measure

    folder, prompts = _tiny_pair(tmp_path)
    real, runs = measure.run_setting, []

    def flaky(*a, **k):
        runs.append(a[4] == 3)  # the sweep's (the cost probes decode 32 tokens)
        if sum(runs) == 2 and runs[-1]:
            raise DraftsmithError("out of memory at batch 1")
        return real(*a, **k)

    monkeypatch.setattr(measure, "run_setting", flaky)
    out = tmp_path / "tune"
    with pytest.raises(DraftsmithError) as err:
        cli.run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 3, 1, "cpu", torch.float32,
                     False, out, max_topk=1)
    path = out / cli.PARTIAL
    assert str(err.value).startswith("out of memory at batch 1 (tune stopped; what it measured")
    assert str(path) in str(err.value) and not (out / "tune.json").exists()
    kept = json.loads(path.read_text())
    assert kept["acceptance"]["chain"] and len(kept["prompt_acceptance"]) == 3
    assert kept["costs"]["verify"] and len(kept["measured"]) == 1
    assert kept["measured"][0]["tokens_per_s"] > 0 and kept["run"]["new_tokens"] == 3
    monkeypatch.setattr(measure, "run_setting", real)
    cli.run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 3, 1, "cpu", torch.float32,
                 False, out, max_topk=1)
    assert (out / "tune.json").is_file() and not path.exists()  # the report holds it all


def test_an_error_not_ours_keeps_its_traceback_and_names_the_kept_file(tmp_path):
    from draftsmith.tune import cli

    kept = cli.Partial(tmp_path, {"new_tokens": 3})
    with pytest.raises(RuntimeError) as err, kept.on_failure():
        raise RuntimeError("nothing measured yet")
    assert not getattr(err.value, "__notes__", None)
    kept.save(costs={})
    with pytest.raises(RuntimeError) as err, kept.on_failure():
        raise RuntimeError("CUDA error: an illegal memory access")
    assert str(tmp_path / cli.PARTIAL) in " ".join(err.value.__notes__)
