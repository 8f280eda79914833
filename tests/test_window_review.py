"""Sliding-window targets' position limits: a request whose prompt and answer end exactly at the
window decodes as windowed greedy does (plain, chain, tree, refilled rows), though the drafting
margin's forwards reach past it; front ends refuse a request past the window before loading."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_tiny_folder
from test_cli_review2 import error_of
from test_speculative import Steered, make_drafter, tiny_target

from draftsmith.bench.run import BenchConfig, _runtimes
from draftsmith.data.regenerate import RegenConfig, within_positions
from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import check_positions, generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import save_drafter
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine
from draftsmith.targets import Target, load_target
from draftsmith.tune.cli import run_tune

WINDOW = 40
PROMPTS = [[1, 5, 9, 30, 44, 3, 4, 5, 6, 7], [1, 60, 61, 62]]
NEW = WINDOW - len(PROMPTS[0])  # the longest prompt's answer ends exactly at the window
SETTINGS = [(4, 1, None), (4, 3, 10)]  # a chain and a tree: steps, topk, verify tokens


def windowed_greedy(model, prompt: list[int], new: int) -> list[int]:
    """Greedy by uncached forwards, which attend over the window as HF does."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            x = torch.tensor([ids])
            ids.append(int(model(x, torch.arange(len(ids)).view(1, -1)).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(sliding_window=WINDOW)
    want = [windowed_greedy(target, p, NEW) for p in PROMPTS]
    seq = torch.zeros(len(PROMPTS), WINDOW + 2, dtype=torch.long)
    for i, (p, w) in enumerate(zip(PROMPTS, want, strict=True)):
        seq[i, : len(p) + NEW] = torch.tensor(p + w)
    return target, want, seq


def test_plain_generation_ending_at_the_window_is_taken(setup):
    """generate sized its cache prompt + answer + 1 and refused it: 41 > 40."""
    target, want, _ = setup
    assert generate(target, PROMPTS, NEW) == want
    assert generate(target, PROMPTS[:1], NEW) == want[:1]


@pytest.mark.parametrize("steps, topk, n", SETTINGS)
@pytest.mark.parametrize("oracle", [False, True])
def test_speculative_ending_at_the_window_equals_windowed_greedy(setup, steps, topk, n, oracle):
    """The decoder's drafting margin put its cache past the window: refused at any length. An
    oracle's accepted drafts and the verify reach past the window; only cut tokens come of
    them."""
    target, want, seq = setup
    drafter = make_drafter(target, 128, Steered if oracle else None)
    if oracle:
        drafter.steer(seq, 1.0)
    dec = SpecDecoder(target, drafter, steps, topk, n, max_batch=2, max_seq=WINDOW + 64)
    assert dec.rt.max_seq > WINDOW
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == want
    if oracle:
        assert res.mean_accept_length == steps + 1


@pytest.mark.parametrize("steps, topk, n", SETTINGS)
def test_refilled_rows_ending_at_the_window_equal_windowed_greedy(setup, steps, topk, n):
    """Refilled rows prefill in a second runtime sized like the first: refused alike."""
    target, want, _ = setup
    rt = Runtime(target, 2, WINDOW + 40, kept=WINDOW)
    assert refill.generate_refill(rt, PROMPTS[::-1], NEW, eos_ids=[], rows=1) == want[::-1]
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    assert spec_refill.generate_refill(dec, PROMPTS[::-1], NEW, [], rows=1).tokens == want[::-1]


def test_a_request_past_the_window_is_refused_with_the_window_named(setup):
    target, _, _ = setup
    words = "sliding window of 40 tokens.*prompt \\+ max_new_tokens = 41 > 40"
    with pytest.raises(DraftsmithError, match=words):
        generate(target, PROMPTS, NEW + 1)
    dec = SpecDecoder(target, make_drafter(target, 96), 4, max_batch=2, max_seq=WINDOW + 64)
    with pytest.raises(DraftsmithError, match=words):
        dec.generate(PROMPTS, NEW + 1)
    rt = Runtime(target, 2, WINDOW + 40, kept=WINDOW)
    with pytest.raises(DraftsmithError, match=words):
        refill.generate_refill(rt, PROMPTS, NEW + 1)
    with pytest.raises(DraftsmithError, match=words):
        Runtime(target, 2, WINDOW + 40, kept=WINDOW + 1)


def test_check_positions_names_the_window():
    check_positions(PROMPTS, NEW, 512, window=WINDOW)  # exactly at the window: allowed
    with pytest.raises(DraftsmithError, match=(
            "sliding window of 40 tokens.*keep prompt and answer within it "
            "\\(the longest prompt \\+ --max-new-tokens = 41 > 40\\)")):
        check_positions(PROMPTS, NEW + 1, 512, "--max-new-tokens", window=WINDOW)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("windowed"), "mistral",
                             sliding_window=WINDOW, num_hidden_layers=2)


@pytest.fixture(scope="module")
def drafter_dirs(windowed_dir, tmp_path_factory) -> list[str]:
    model = load_target(windowed_dir).build(torch.float32)
    root = tmp_path_factory.mktemp("drafters")
    return [str(save_drafter(make_drafter(model, 128, seed=s), root / f"d{s}")) for s in (1, 2)]


def never_build(monkeypatch) -> None:
    def build(*a, **k):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(Target, "build", build)


@pytest.mark.parametrize("command", [
    ["generate", "-p", "hello", "-n", str(WINDOW)],
    ["bench", "--drafter", "random", "--max-new-tokens", str(WINDOW), "--num-prompts", "1"],
    ["compare", "--max-new-tokens", str(WINDOW), "--num-prompts", "1"],
])
def test_front_ends_refuse_a_request_past_the_window_before_loading(monkeypatch, capsys,
                                                                    tmp_path, windowed_dir,
                                                                    drafter_dirs, command):
    """The CLIs checked max_position_embeddings only: the runtime refused the window after the
    weights loaded (bench and compare: anywhere near it, for their drafting margin)."""
    monkeypatch.chdir(tmp_path)
    never_build(monkeypatch)
    if command[0] == "compare":
        command = ["compare", *drafter_dirs, *command[1:]]
    err = error_of(monkeypatch, capsys, *command, "--target", str(windowed_dir),
                   "--device", "cpu")
    assert re.fullmatch(r"the target attends over a sliding window of 40 tokens, which "
                        r"draftsmith's cached engine does not apply: keep prompt and answer "
                        r"within it \(the longest prompt \+ --max-new-tokens = (\d+) > 40\)",
                        err), err


def test_serve_refuses_limits_past_the_window_before_loading(monkeypatch, windowed_dir):
    never_build(monkeypatch)
    with pytest.raises(DraftsmithError, match=(
            "--max-prompt-tokens \\+ --max-tokens-limit = 41 exceeds the target's sliding "
            "window of 40 tokens")):
        load_engine(str(windowed_dir), None, "cpu", torch.float32, EngineConfig(2, 30, 11))


@pytest.mark.parametrize("steps, topk, n", SETTINGS)
def test_serve_and_bench_runtimes_end_at_the_window(setup, steps, topk, n):
    """serve's and bench's runtimes hold a drafting margin past prompt + answer: refused."""
    target, want, _ = setup
    drafter = make_drafter(target, 128)
    served = SimpleNamespace(eos_ids=[], tokenizer=None, cfg=target.cfg)
    eng = ServeEngine(served, target, drafter, EngineConfig(2, len(PROMPTS[0]), NEW, steps,
                                                            topk, n))
    assert eng.run(PROMPTS, NEW, SamplingParams()).rows == want
    cfg = BenchConfig(drafter="random", steps=[steps], topk=[topk],
                      num_draft_tokens=[n] if n else [], batch_sizes=[2], max_new_tokens=NEW)
    rt, drt = _runtimes(target, drafter, {"chat": PROMPTS}, cfg, cfg.settings())
    assert SpecDecoder(rt, drt, steps, topk, n).generate(PROMPTS, NEW, []).tokens == want


def test_regenerate_holds_max_len_to_the_window():
    said = []
    cfg = within_positions(RegenConfig(max_new_tokens=30, max_len=2048), 512, said.append,
                           window=WINDOW)
    assert cfg.max_len == WINDOW and "sliding window of 40 tokens: prompts are held to 10" in (
        said[0])
    with pytest.raises(DraftsmithError, match="no room for a prompt within the target's "
                                              "sliding window of 40 tokens"):
        within_positions(RegenConfig(max_new_tokens=40, max_len=2048), 512, window=WINDOW)


def test_tune_times_and_sweeps_within_the_window(tmp_path, windowed_dir, drafter_dirs):
    """tune's runtime (its margin past position 64, where costs are timed) was refused for any
    window below it; its decode probes, requests, now stay within the window."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{i}"}) for i in range(2)))
    report = run_tune(Path(drafter_dirs[0]), str(windowed_dir), prompts, [1], 2, 4, 1, "cpu",
                      torch.float32, False, tmp_path / "tune")
    assert [r["batch"] for r in report["recommendations"]] == [1]


@pytest.mark.parametrize("steps, topk, n", SETTINGS)
def test_compare_measures_requests_ending_at_the_window(setup, steps, topk, n):
    """compare's baseline runtime held the drafting margin too: "max_seq 47 > 40"."""
    from draftsmith.compare.speed import measure

    target, want, _ = setup
    got = measure(target, {"A": make_drafter(target, 128)}, PROMPTS[:1], steps, NEW, [], topk,
                  n)
    assert got["baseline_tokens_per_s"] > 0 and got["drafters"]["A"]["tokens_per_s"] > 0


def test_self_made_prompts_end_at_the_window_and_not_past_it(tmp_path):
    """Self-made prompts sized their runtime prompt + answer + 1: refused at the window itself."""
    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts, user_prefix

    t = load_target(str(write_tiny_folder(tmp_path / "w", "mistral", sliding_window=WINDOW)))
    start = len(t.tokenizer(user_prefix(t.tokenizer, None)[0],
                            add_special_tokens=False)["input_ids"])
    with pytest.raises(DraftsmithError, match="sliding window of 40 tokens"):
        self_made_prompts(t, tmp_path / "p.jsonl", MagpieConfig(
            n=2, batch_size=2, max_new_tokens=WINDOW - start + 1), progress=False)
    assert not (tmp_path / "p.jsonl").exists()
    self_made_prompts(t, tmp_path / "p.jsonl", MagpieConfig(
        n=2, batch_size=2, max_new_tokens=WINDOW - start, max_batches=1), progress=False)
