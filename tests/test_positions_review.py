"""Position limits of speculative decoding and a few CLI gaps: a request that ends exactly at
the target's max_position_embeddings decodes as plain greedy does (chain, tree, refilled rows);
--steps capped as tune caps it; compare's drafting checked by flag before loading; tune's --seed
at temperature 0; serve's startup line."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from test_cli_review import run_main
from test_cli_review2 import NEVER, error_of
from test_speculative import make_drafter, tiny_target

from draftsmith.bench.run import BenchConfig, _runtimes
from draftsmith.compare import CompareOptions
from draftsmith.engine.generate import check_positions, generate
from draftsmith.engine.spec_refill import generate_refill
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError

MOST = 48  # the tiny target's max_position_embeddings
PROMPTS = [[1, 5, 9, 30, 44, 3, 4, 5, 6, 7, 8, 9], [1, 60, 61, 62]]
SETTINGS = [(5, 1, 6), (4, 3, 10)]  # a chain and a tree: steps, topk, verify tokens


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(max_position_embeddings=MOST)
    return target, make_drafter(target, 96)


@pytest.mark.parametrize("setting", SETTINGS, ids=["chain", "tree"])
def test_a_request_ending_at_the_targets_last_position_decodes_as_plain_greedy(pair, setting):
    """The verify and the drafter run up to `steps` positions past the last token kept, past
    max_position_embeddings here: RoPE is computed per position and the caches are sized with
    that margin (bench's sizing), so what is kept is plain greedy's."""
    target, drafter = pair
    new = MOST - max(map(len, PROMPTS))
    check_positions(PROMPTS, new, MOST)  # exactly at the limit: allowed
    cfg = BenchConfig(drafter="random", steps=[setting[0]], topk=[setting[1]],
                      num_draft_tokens=[setting[2]] if setting[1] > 1 else [],
                      batch_sizes=[2], max_new_tokens=new)
    rt, drt = _runtimes(target, drafter, {"chat": PROMPTS}, cfg, cfg.settings())
    steps, topk, n = setting
    dec = SpecDecoder(rt, drt, steps, topk, None if topk == 1 else n)
    want = generate(target, PROMPTS, new)
    assert dec.generate(PROMPTS, new).tokens == want
    assert generate_refill(dec, PROMPTS[::-1], new, [], rows=1).tokens == want[::-1]


@pytest.mark.parametrize("command", [
    ["bench", "--drafter", "random", "--steps", "3,65"],
    ["serve", "--port", "0", "--drafter", "none", "--steps", "65"],
    ["compare", "a", "b", "--steps", "65"],
])
def test_steps_past_tunes_limit_are_refused_before_loading(monkeypatch, capsys, tmp_path,
                                                           command):
    """tune refused --max-steps past 64; bench, serve and compare took any --steps on to the
    target's minutes of loading."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, *command, "--target", NEVER, "--device", "cpu") == (
        "--steps must be at most 64, got 65")


def test_steps_at_the_limit_are_taken():
    assert BenchConfig(steps=[64]).settings() == [(64, 1, 65)]
    CompareOptions(["a", "b"], target=NEVER, steps=64)


@pytest.mark.parametrize("flags, words", [
    (["--steps", "4", "--num-draft-tokens", "9"],
     "--num-draft-tokens 9: a chain (--topk 1) verifies --steps + 1 = 5 tokens; leave it out, "
     "or give --topk > 1"),
    (["--steps", "2", "--topk", "2", "--num-draft-tokens", "50"],
     "--num-draft-tokens 50: a tree of --topk 2 and --steps 2 verifies 2 to 7 tokens"),
    (["--topk", "2"], "--topk > 1 (a tree) needs --num-draft-tokens: a tree of --topk 2 and "
                      "--steps 4 verifies 2 to 15 tokens"),
    (["--topk", "0"], "--topk must be >= 1, got 0"),
])
def test_compare_checks_its_drafting_by_flag_before_loading(monkeypatch, capsys, tmp_path,
                                                            flags, words):
    """compare named the engine's fields (`num_draft_tokens`), and a tree too big for its steps
    and topk was refused only after the target and drafters loaded."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, "compare", "a", "b", *flags, "--target", NEVER,
                    "--device", "cpu") == words


def test_tune_refuses_seed_at_temperature_0(monkeypatch, capsys, tmp_path):
    """bench and generate refused --seed at temperature 0; tune took it and drew nothing."""
    monkeypatch.chdir(tmp_path)
    args = ("tune", "--drafter", str(tmp_path / "none"), "--target", NEVER, "--device", "cpu")
    assert error_of(monkeypatch, capsys, *args, "--seed", "3") == (
        "--seed applies to sampling: give --temperature > 0 with it (at temperature 0 decoding "
        "is greedy)")
    assert "no such folder" in error_of(monkeypatch, capsys, *args, "--seed", "3",
                                        "--temperature", "0.5")


def fake_engine(steps: int, topk: int, tokens: int | None) -> SimpleNamespace:
    from draftsmith.serve.engine import EngineConfig

    target = SimpleNamespace(fingerprint="f", kind="hf", source="t")
    return SimpleNamespace(target=target, speculative=True,
                           cfg=EngineConfig(2, 16, 16, steps, topk, tokens))


def ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "127.0.0.1"),
    pytest.param("::1", "[::1]", marks=pytest.mark.skipif(not ipv6(), reason="no IPv6")),
])
def test_serve_startup_line_names_the_port_bound_and_the_trees_size(monkeypatch, capsys,
                                                                    tmp_path, host, url):
    """--port 0 printed http://127.0.0.1:0/v1, where no client can connect; a tree's
    --num-draft-tokens was left out of the line; --host ::1 printed http://::1:8000/v1."""
    import draftsmith.serve.app as app
    import draftsmith.serve.engine as engine

    monkeypatch.setattr("draftsmith.models.eagle3.check_drafter",
                        lambda d: SimpleNamespace(draft_vocab_size=64))
    monkeypatch.setattr(engine, "load_engine", lambda *a, **k: fake_engine(3, 4, 12))
    served = {}
    monkeypatch.setattr(app, "run_server",
                        lambda eng, cfg, host, port, *a, **k: served.update(port=port, **k))
    code, _, err = run_main(monkeypatch, capsys, "serve", "--drafter", str(tmp_path), "--steps",
                            "3", "--topk", "4", "--num-draft-tokens", "12", "--port", "0",
                            "--host", host, "--device", "cpu", "--frontends", "0")
    assert code == 0, err
    port = served["port"]
    assert port > 0 and f"on http://{url}:{port}/v1 (" in err
    assert "steps 3, topk 4, 12 draft tokens" in err
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with served["sock"] as sock, socket.socket(family) as s:
        # the server is handed the socket it announced, already listening: no race for port 0
        assert sock.getsockname()[1] == port
        s.connect((host, port))


def test_a_request_past_the_targets_positions_is_still_refused():
    with pytest.raises(DraftsmithError, match="= 49 exceeds the target's max_position_"):
        check_positions(PROMPTS, MOST - 11, MOST)
