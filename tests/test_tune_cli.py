"""`draftsmith tune` end to end on CPU: tiny target, random drafter; a report per batch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_folder


def _tiny_pair(tmp_path):
    """A tiny target folder, a random drafter for it in tmp_path / "d", and a prompt file."""
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    folder = write_tiny_folder(tmp_path / "t", "llama")
    target = load_target(folder)
    torch.manual_seed(0)
    cfg = Eagle3Config.for_target(target.cfg, 64, [0, 2, 4])
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.zeros(64, dtype=torch.long), torch.arange(128) < 64)
    drafter.embed_tokens.weight.data.copy_(target.weights["model.embed_tokens.weight"])
    save_drafter(drafter, tmp_path / "d")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"hello {i}"}) for i in range(3)))
    return folder, prompts


def test_tune_writes_a_recommendation_per_batch(tmp_path):
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    out = tmp_path / "tune"
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu",
                      torch.float32, False, out, max_topk=2, max_draft=5)
    recs = report["recommendations"]
    drafts = [int(r["setting"].split(", ")[2].split()[0]) for r in report["rows"]
              if r["setting"] != "no speculation"]
    assert max(drafts) <= 5 and max(report["costs"]["verify"][1]) == 5
    assert [r["batch"] for r in recs] == [1, 2]
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["best_measured_tok_s"] is not None
        assert r["tokens_per_s"] == r["best_measured_tok_s"]  # measured best wins
    assert (out / "tune.png").stat().st_size > 1000
    spec = [r for r in report["phases"] if r["setting"] != "no speculation"]
    assert spec and all(r["measured_phases_ms"].get("verify", 0) > 0 for r in spec)
    assert all(r["measured_cycle_ms"] > 0 for r in spec if r["measured_accept"])
    assert all(0 < r["measured_busy"] <= 1 and 0 < r["predicted_busy"] <= 1 for r in spec
               if r["predicted_phases_ms"])
    assert any(r["predicted_phases_ms"] for r in spec)
    first, step = report["costs"]["draft_first"], report["costs"]["draft_step"]
    assert set(first) == set(step) == {1, 2} and all(set(first[b]) == {1, 2} for b in first)
    assert all(ms >= 0 for b in step for ms in [*step[b].values(), *first[b].values()])
    tree = report["acceptance"]["tree"]  # --max-topk 2: measured by depth and rank
    assert tree and all(len(row) == 2 and sum(row) <= 1 + 1e-9 for row in tree)
    own = report["prompt_acceptance"]  # each prompt's chain and tree, as the model used them
    assert len(own) == len(prompts.read_text().splitlines()) and all(a["tree"] for a in own)
    counts = report["prompt_tree_counts"]  # what they came from, to refit TREE_PRIOR offline
    assert len(counts) == len(own) and report["new_tokens"] == 4
    assert "no stop at EOS" in report["answers"]  # what the figures assume, said
    assert (out / "tune.md").read_text().startswith("Priced and swept with every row decoding")
    assert "--speculative-num-steps" in (out / "tune.md").read_text() or any(
        "no speculation" in t for t in report["texts"]
    )


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_tune_for_sampling_samples_every_decode_it_times(tmp_path, monkeypatch):
    """--temperature reaches every decode tune runs: the acceptance run, the cost probes, the
    baselines and the sweep, and the report says what it was tuned for."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.tune import measure
    from draftsmith.tune.cli import run_tune

    seen = []

    def generation(rt, rows, new, params=SamplingParams(), eos=None):
        seen.append(("baseline", params))
        return real_generation(rt, rows, new, params, eos)

    def spec(*args, **kw):
        dec = real_spec(*args, **kw)
        seen.append(("speculative", dec.params))
        return dec

    real_generation, real_spec = measure.run_generation, measure.SpecDecoder
    monkeypatch.setattr(measure, "run_generation", generation)
    monkeypatch.setattr(measure, "SpecDecoder", spec)
    folder, prompts = _tiny_pair(tmp_path)
    params = SamplingParams(0.8, top_k=20)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 4, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", 2, params, 3)
    assert {kind for kind, _ in seen} == {"baseline", "speculative"}
    assert all(p == params for _, p in seen)
    assert report["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 20}
    assert "temperature 0.8" in report["texts"][0]
    assert [r["batch"] for r in report["recommendations"]] == [1, 2]


def test_prompt_groups_take_every_prompt_in_full_batches():
    from draftsmith.tune.measure import prompt_groups

    p = [[i] for i in range(5)]
    assert prompt_groups(p, 1) == [[[i]] for i in range(5)]
    assert prompt_groups(p, 2) == [[[0], [1]], [[2], [3]], [[4], [0]]]
    assert prompt_groups(p, 8) == [[[0], [1], [2], [3], [4], [0], [1], [2]]]


def test_a_setting_is_measured_over_every_prompt(tmp_path, monkeypatch):
    """At batch 1 the sweep decodes each prompt in turn (it measured the first prompt alone, whose
    acceptance stood for all: H200 tune run 3), speculative and baseline alike, and its accept
    length is the mean over all of them."""
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target
    from draftsmith.tune import measure
    from draftsmith.tune.cost_model import SpecSetting

    folder, _ = _tiny_pair(tmp_path)
    model = load_target(folder).build(torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "d", "cpu", torch.float32, embed=model.embed.weight)
    eng = measure.Engine(Runtime(model, 2, 64), DrafterRuntime(drafter, 2, 256, False), drafter)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    seen, real_spec, real_generation = [], measure.SpecDecoder.generate, measure.run_generation

    def spec(self, rows, new, eos=None):
        res = real_spec(self, rows, new, eos)
        if new == 6 and not self.profile:
            seen.append(("spec", rows, res.accept_hist))
        return res

    def generation(rt, rows, new, *args):
        seen.append(("base", rows, None))
        return real_generation(rt, rows, new, *args)

    monkeypatch.setattr(measure.SpecDecoder, "generate", spec)
    monkeypatch.setattr(measure, "run_generation", generation)
    m = measure.run_setting(eng, SpecSetting(2, 1, 3), prompts, 1, 6, [])
    runs = [(rows, hist) for kind, rows, hist in seen if kind == "spec"]
    assert [rows for rows, _ in runs] == [[p] for p in prompts]
    hist = [sum(c) for c in zip(*(h for _, h in runs), strict=True)]
    assert m.accept_length == pytest.approx(sum(k * c for k, c in enumerate(hist)) / sum(hist))
    seen.clear()
    measure.run_setting(eng, SpecSetting.baseline(), prompts, 1, 6, [])
    assert [rows for _, rows, _ in seen[1:]] == [[p] for p in prompts]  # after the warm-up


def test_acceptance_is_measured_per_prompt_and_pooled(tmp_path, monkeypatch):
    """Each prompt decoded alone gives its own chain acceptance, and its row of a batched tree
    run its own tree acceptance (the mix the batches' idle rows are predicted from); their
    counts pooled equal one greedy batch's, as they must; a setting's measurement carries the
    engine's cycle time and the share of row slots that decoded."""
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.tree import RankCounts
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target
    from draftsmith.tune import measure
    from draftsmith.tune.cost_model import Acceptance, SpecSetting, prompt_tree, tree_capacity

    folder, _ = _tiny_pair(tmp_path)
    model = load_target(folder).build(torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "d", "cpu", torch.float32, embed=model.embed.weight)
    eng = measure.Engine(Runtime(model, 3, 64), DrafterRuntime(drafter, 3, 256, False), drafter)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    pooled, mix = measure.chain_acceptance(eng, prompts, 2, 8, [])
    res = measure.decoder(eng, SpecSetting(2)).generate(prompts, 8, [])
    assert pooled == Acceptance.from_chain_counts(res.reached, res.accepted)
    assert len(mix.prompts) == 3
    first = measure.decoder(eng, SpecSetting(2)).generate(prompts[:1], 1, []).tokens[0][0]
    pooled, mix = measure.chain_acceptance(eng, prompts, 2, 8, [first])  # prompt 0: done at once
    assert len(mix.prompts) == 3 and mix.prompts[0] == pooled  # the mix stays aligned
    tree, own = measure.tree_acceptance(eng, prompts, 2, 3, 8, [], pooled, mix)
    assert tree.chain == pooled.chain and tree.tree  # a random drafter: depth 1 at least
    dec = measure.decoder(eng, SpecSetting(2, 3, min(tree_capacity(2, 3), 32)))  # its tree
    dec.rank_counts = counts = RankCounts(2, 3, eng.device)
    dec.generate(prompts, 8, [])  # the same run, counted here
    assert tree == Acceptance.from_rank_counts(*counts.counts(), chain=pooled.chain)
    assert own.prompts == tuple(prompt_tree(tree, r, a, p.chain) for (r, a), p in
                                zip(counts.row_counts(), mix.prompts, strict=True))
    assert own.tree_counts == tuple(counts.row_counts())
    assert all(len(r) == 2 and len(r[0]) == 3 for r, _ in own.tree_counts)  # [depth][rank]
    assert [p.chain for p in own.prompts] == [p.chain for p in mix.prompts]
    # two rows a batch: [0, 1], then [2], which ends at its prefill (no cycle counted)
    small = measure.Engine(Runtime(model, 2, 64), DrafterRuntime(drafter, 2, 256, False), drafter)
    last = measure.decoder(small, SpecSetting(2)).generate(prompts[2:], 1, []).tokens[0][0]
    tree, own = measure.tree_acceptance(small, prompts, 2, 3, 8, [last], pooled, mix)
    dec = measure.decoder(small, SpecSetting(2, 3, min(tree_capacity(2, 3), 32)))
    dec.rank_counts = counts = RankCounts(2, 3, small.device)
    dec.generate(prompts[:2], 8, [last])
    assert own.tree_counts == (*counts.row_counts(), ([[0] * 3] * 2,) * 2)
    assert tree == Acceptance.from_rank_counts(*counts.counts(), chain=pooled.chain)
    flat = [[q for row in a.tree for q in row] for a in (own.prompts[2], tree)]
    assert flat[0] == pytest.approx(flat[1])  # no counts of its own: the pooled tree
    from draftsmith.engine import speculative
    from draftsmith.engine.sampling import SamplingParams

    eng.params = SamplingParams(0.8)
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")  # siblings may repeat a token
    assert measure.tree_acceptance(eng, prompts, 2, 2, 8, [], pooled, mix) == (pooled, mix)
    m = measure.run_setting(eng, SpecSetting(2), prompts, 3, 8, [])
    assert m.cycle_ms is not None and m.cycle_ms > 0
    assert m.busy is not None and 0 < m.busy <= 1


def test_tune_refuses_a_bad_sampler_before_loading(tmp_path):
    from draftsmith.errors import DraftsmithError

    res = invoke_tune("--drafter", str(tmp_path / "none"), "--temperature", "-1")
    assert isinstance(res.exception, DraftsmithError) and "temperature" in str(res.exception)


def invoke_tune(*args: str):
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune.cli import tune

    app = typer.Typer()
    app.command()(tune)
    return CliRunner().invoke(app, list(args), catch_exceptions=True)


@pytest.mark.slow
def test_tune_under_tp2_recommends_and_sweeps_nccl_in_fresh_processes(tmp_path):
    folder, prompts = _tiny_pair(tmp_path)
    out = tmp_path / "tune"
    res = invoke_tune(*[
        "--drafter", str(tmp_path / "d"), "--target", str(folder), "--prompts",
        str(prompts), "--batch-sizes", "1,2", "--max-steps", "2", "--max-new-tokens", "4",
        "--top", "1", "--max-topk", "2", "--device", "cpu", "--tp", "2", "--nccl-sweep",
        "--out", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    report = json.loads((out / "tune.json").read_text())
    assert [r["batch"] for r in report["recommendations"]] == [1, 2]
    assert report["tp"] == 2
    sweep = json.loads((out / "nccl" / "nccl.json").read_text())
    widths = {(r["batch"], r["verify_tokens"]) for r in report["recommendations"]}
    assert widths <= {tuple(s) for s in sweep["shapes"]}
    pids = [r["ranks"][0]["pid"] for r in sweep["results"] if r.get("ranks")]
    assert len(pids) == len(set(pids)) > 1  # every setting ran in its own processes


def test_tune_refuses_an_nccl_sweep_without_tp(tmp_path):
    from draftsmith.errors import DraftsmithError

    res = invoke_tune("--drafter", str(tmp_path), "--nccl-sweep")
    assert isinstance(res.exception, DraftsmithError) and "--nccl-sweep" in str(res.exception)


def test_tune_refuses_bad_step_and_topk_limits_before_loading(tmp_path):
    from draftsmith.errors import DraftsmithError

    for flag in ("--max-steps", "--max-topk", "--max-draft-tokens"):
        res = invoke_tune("--drafter", str(tmp_path / "none"), flag, "0")
        assert isinstance(res.exception, DraftsmithError) and flag in str(res.exception)


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_tune_refill_prices_and_sweeps_refilled_rows(tmp_path):
    """--refill: the prompt passes are timed at every padded row count, each setting runs with
    rows refilled (the refills profiled), and where every prompt's cycles are known (the random
    drafter accepts nothing; the baseline's plain steps) the model's busy share is the
    engine's own."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 8, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=2, max_draft=5,
                      refill=True)
    assert report["refill"] is True and "continuous batching" in report["texts"][0]
    for name in ("refill", "spec_refill"):
        assert set(report["costs"][name]) == {1, 2} and min(report["costs"][name].values()) > 0
    spec = [r for r in report["phases"] if r["setting"] != "no speculation"]
    assert spec and all("refill" in r["measured_phases_ms"] for r in spec)
    priced = [r for r in spec if r["predicted_phases_ms"]]
    assert priced and all("refill" in r["predicted_phases_ms"] for r in priced)
    # the settings swept follow the timed costs, so a loaded machine may sweep one (a wider
    # tree) that the random drafter hits by chance: its cycles are then not known in advance
    known = [r for r in priced if r["measured_accept"] == 1.0]
    assert known, [r["measured_accept"] for r in priced]
    assert all(r["measured_busy"] == pytest.approx(r["predicted_busy"]) for r in known)
    base = [r for r in report["phases"] if r["setting"] == "no speculation"]
    assert [r["batch"] for r in base] == [1, 2]  # the plain loop's steps are the model's too
    # 7 steps a prompt after its prompt pass, the done flags read every 2: one idle step in 8
    assert all(r["measured_busy"] == pytest.approx(r["predicted_busy"]) == 7 / 8 for r in base)
    assert all(r["measured_cycle_ms"] > 0 for r in base)
    assert not any("idle rows" in t for t in report["texts"])


@pytest.mark.slow
def test_tune_refill_under_tp2_prices_and_sweeps_refilled_rows(tmp_path):
    """--refill --tp 2: both ranks time, refill and sweep in step (rank 0's costs planned on),
    and the report is the one-process report's shape, refills priced."""
    folder, prompts = _tiny_pair(tmp_path)
    out = tmp_path / "tune"
    res = invoke_tune(*[
        "--drafter", str(tmp_path / "d"), "--target", str(folder), "--prompts",
        str(prompts), "--batch-sizes", "1,2", "--max-steps", "2", "--max-new-tokens", "8",
        "--top", "1", "--max-topk", "2", "--max-draft-tokens", "5", "--device", "cpu",
        "--tp", "2", "--refill", "--out", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    report = json.loads((out / "tune.json").read_text())
    assert report["tp"] == 2 and report["refill"] is True
    assert [r["batch"] for r in report["recommendations"]] == [1, 2]
    for name in ("refill", "spec_refill"):
        assert set(report["costs"][name]) == {"1", "2"} and min(report["costs"][name].values()) > 0
    spec = [r for r in report["phases"] if r["setting"] != "no speculation"]
    assert spec and all("refill" in r["measured_phases_ms"] for r in spec)


def test_tune_refuses_an_empty_prompts_file_a_top_of_0_and_an_output_file_before_loading(
        tmp_path):
    from draftsmith.errors import DraftsmithError

    (empty := tmp_path / "empty.jsonl").write_text("")
    (taken := tmp_path / "taken").write_text("x")
    never = str(tmp_path / "never-loaded")
    for args, says in ((["--prompts", str(empty)], "no conversations in it"),
                       (["--top", "0"], "--top must be >= 1"),
                       (["--out", str(taken)], "is a file, not a folder")):
        res = invoke_tune("--drafter", never, "--target", never, "--device", "cpu", *args)
        assert isinstance(res.exception, DraftsmithError) and says in str(res.exception), (
            args, res.exception)
    assert taken.read_text() == "x"
