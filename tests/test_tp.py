"""Tensor parallelism on CPU over gloo: 2 and 4 processes give the single-process answers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from draftsmith.dist import launch_tp, spawn
from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.llama import Transformer
from draftsmith.models.parallel import SINGLE, TP

GQA8 = dict(num_attention_heads=8, num_key_value_heads=4)
CASES = {  # name: (arch, HF config overrides, drop lm_head.weight from the checkpoint)
    "llama": ("llama", {}, False),  # 4 heads / 2 kv heads: TP 2 only
    "llama8": ("llama", GQA8, False),
    "qwen2_bias": ("qwen2", GQA8, False),
    "qwen3": ("qwen3", GQA8, False),
    "tied_odd_vocab": ("llama", {**GQA8, "tie_word_embeddings": True, "vocab_size": 131}, True),
}
PROMPTS = [[1, 5, 9, 30, 44], [1, 60, 61]]
NEW = 12
# six prompts through two refilled rows; qwen3's greedy answers hold 55 at 0 to 12 tokens in
REFILLED = [*PROMPTS, [1, 7, 8, 9], [1, 20], [1, 3, 3, 3, 3, 3], [1, 9]]
EOS = [55]


def make_case(name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    arch, over, drop_head = CASES[name]
    hf = tiny_hf_model(arch, seed=3, num_hidden_layers=4, **over)
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    if drop_head:
        weights.pop("lm_head.weight")
    return ModelConfig.from_hf(hf.config.to_dict()), weights


def run_case(tp: TP, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict:
    """Everything compared between TP and one process, computed on this rank."""
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.models.loading import build_model

    model = build_model(cfg, weights, torch.float32, tp.device, tp)
    ids = (torch.arange(13).repeat(2, 1) * 7 % 97 + 3).to(tp.device)
    pos = torch.arange(13).expand(2, 13).to(tp.device)
    with torch.no_grad():
        out = model(ids, pos, aux_ids=(-1, 1, 3))
        rt = Runtime(model, max_batch=2, max_seq=32)
        rt.capture([2], [6, 7])  # on CUDA the cached forwards below are graph replays
        cached = torch.cat([rt.forward(ids[:, :6], pos[:, :6]).logits,
                            rt.forward(ids[:, 6:], pos[:, 6:]).logits], 1)
    greedy = generate(model, PROMPTS, NEW, eos_ids=[])
    torch.manual_seed(0)  # every rank draws the same noise, as a TP deployment must
    sampled = generate(model, PROMPTS, NEW, SamplingParams(temperature=1.0), eos_ids=[])
    return {  # on the CPU: results of spawned CUDA ranks come back pickled
        "logits": out.logits.cpu(), "aux": out.aux.cpu(), "hidden": out.hidden.cpu(),
        "cached": cached.cpu(),
        "tokens": greedy, "sampled": sampled,
        "tied": model.lm_head.weight is model.embed.weight,
        "kv_heads": model.layers[0].attn.kv_heads,
    }


def run_cases(tp: TP, cases: dict[str, tuple]) -> dict[str, dict]:
    return {name: run_case(tp, *case) for name, case in cases.items()}


def check_equal(single: dict, sharded: dict, tp_size: int) -> None:
    for key in ("logits", "aux", "hidden", "cached"):
        assert sharded[key].shape == single[key].shape, key
        assert torch.allclose(sharded[key], single[key], atol=1e-5, rtol=0), key
    assert sharded["tokens"] == single["tokens"]
    assert sharded["sampled"] == single["sampled"]
    assert sharded["tied"] == single["tied"]
    assert sharded["kv_heads"] * tp_size == single["kv_heads"]


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple]:
    return {name: make_case(name) for name in CASES}


@pytest.fixture(scope="module")
def single(cases) -> dict[str, dict]:
    return run_cases(SINGLE, cases)


def run_tp2(tp: TP, cases: dict[str, tuple], spec: tuple | None) -> dict:
    return {"cases": run_cases(tp, cases), "spec": spec and run_speculative(tp, *spec)}


@pytest.fixture(scope="module")
def spec_args(cases) -> tuple:
    cfg, weights = cases["qwen3"]  # greedy answers of many tokens (qwen2_bias repeats one)
    return (cfg, weights, *make_drafter(cfg))


@pytest.fixture(scope="module")
def tp2(cases, spec_args) -> dict:
    """One launch of 2 ranks for every TP-2 check (process start-up dominates on CPU)."""
    return launch_tp(run_tp2, 2, cases, spec_args, device="cpu")


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_tp2_through_launch_tp_matches_single_process(tp2, single):
    for name in CASES:
        check_equal(single[name], tp2["cases"][name], 2)
    assert single["tied_odd_vocab"]["tied"]


@pytest.mark.slow  # ~25 s; TP 2 covers the same path in the default suite
def test_tp4_every_rank_matches_single_process(cases, single):
    four = {k: v for k, v in cases.items() if k != "llama"}
    ranks = spawn(run_cases, 4, four, device="cpu", timeout_s=120)
    for out in ranks:
        for name in four:
            check_equal(single[name], out[name], 4)


class MirrorTP(TP):
    """Rank 0 of `size` ranks that all hold rank 0's shard: collectives without peers, so the
    rest of the TP path (vocab masking, padded head, shapes) can be graphed on one GPU."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.size)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=-1)


@pytest.mark.gpu
def test_tp_path_captures_in_cuda_graphs(cases):
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.models.loading import build_model

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg, weights = cases["tied_odd_vocab"]
    model = build_model(cfg, weights, torch.float32, "cuda", MirrorTP(0, 2, None, "cuda"))
    ids = (torch.arange(12, device="cuda").repeat(2, 1) * 7 % 97 + 3)
    pos = torch.arange(12, device="cuda").expand(2, 12)
    graphed, eager = Runtime(model, 2, 32), Runtime(model, 2, 32, graphs=False)
    graphed.capture([2], [12])
    with torch.no_grad():
        assert torch.equal(graphed.forward(ids, pos).logits, eager.forward(ids, pos).logits)
    assert generate(model, PROMPTS, NEW, eos_ids=[]) == generate(
        Runtime(model, 2, 32, graphs=False), PROMPTS, NEW, eos_ids=[])


@pytest.mark.gpu
def test_tp2_on_gpus_with_graphed_collectives_matches_one_gpu(cases):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = run_cases(TP(device=torch.device("cuda", 0)), cases)
    for out in spawn(run_cases, 2, cases, device="cuda", timeout_s=300):
        for name in CASES:
            for key in ("logits", "aux", "hidden", "cached"):
                assert torch.allclose(out[name][key], one[name][key], atol=1e-4, rtol=0), key
            assert out[name]["tokens"] == one[name]["tokens"]


@pytest.mark.parametrize(
    ("over", "size", "what"),
    [
        ({}, 3, "num_attention_heads = 4"),
        ({"num_attention_heads": 8, "num_key_value_heads": 2}, 4, "num_key_value_heads = 2"),
        ({**GQA8, "intermediate_size": 130}, 4, "intermediate_size = 130"),
    ],
)
def test_indivisible_shapes_are_refused(over, size, what):
    cfg = ModelConfig.from_hf(tiny_hf_model("llama", **over).config.to_dict())
    with pytest.raises(DraftsmithError, match=what), torch.device("meta"):
        Transformer(cfg, TP(1, size))


def test_rank_errors_reach_the_caller():
    with pytest.raises(DraftsmithError, match="rank 0: .*not divisible"):
        spawn(_build_with_three_heads, 1, device="cpu", timeout_s=60)


def test_a_rank_that_exits_without_a_result_fails_the_launch(monkeypatch):
    """Without a time limit (launch_tp's) the launch waited forever for it."""
    from draftsmith import dist

    monkeypatch.setattr(dist, "QUIET_S", 1.0)
    with pytest.raises(RuntimeError, match="rank 0 exited .code 0. without a result"):
        spawn(_exit_quietly, 1, device="cpu", timeout_s=20)


def _exit_quietly(tp: TP) -> None:
    import os

    os._exit(0)


def _build_with_three_heads(tp: TP) -> None:
    cfg = ModelConfig(arch="llama", vocab_size=16, hidden_size=12, intermediate_size=8,
                      num_layers=1, num_heads=3, num_kv_heads=3, head_dim=4)
    Transformer(cfg, TP(tp.rank, 2))


def test_tp_without_torchrun_is_refused(monkeypatch):
    from draftsmith.dist import init_tp

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DraftsmithError, match="torchrun --nproc-per-node 2"):
        init_tp(2)
    assert init_tp(1, "cpu").size == 1


def make_drafter(cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    from draftsmith.layers import default_aux_layers
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

    dcfg = Eagle3Config.for_target(cfg, cfg.vocab_size, default_aux_layers(cfg.num_layers))
    drafter = Eagle3Drafter(dcfg)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.05 if p.dim() > 1 else torch.ones_like(p))
    return dcfg.to_dict(), drafter.state_dict()


def run_speculative(tp: TP, cfg: ModelConfig, weights: dict, dcfg: dict, dsd: dict) -> dict:
    """Greedy speculative tokens, chain and tree, with the drafter replicated on every rank, and
    rows refilled as they end at EOS (plain, chain and tree)."""
    from draftsmith.engine.refill import generate_refill
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.spec_refill import generate_refill as spec_refill
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
    from draftsmith.models.loading import build_model

    target = build_model(cfg, weights, torch.float32, tp.device, tp)
    drafter = Eagle3Drafter(Eagle3Config.from_dict(dcfg))
    drafter.load_state_dict(dsd)
    drafter = drafter.to(tp.device).eval()
    out: dict = {"refill": generate_refill(Runtime(target, 2, 64), REFILLED, NEW, eos_ids=EOS,
                                           rows=2, check_every=2)}
    for topk, n in ((1, None), (2, 6)):
        dec = SpecDecoder(target, drafter, steps=3, topk=topk, num_draft_tokens=n,
                          max_batch=2, max_seq=64)
        out[topk] = dec.generate(PROMPTS, NEW, eos_ids=[]).tokens
        out["refill", topk] = spec_refill(dec, REFILLED, NEW, EOS, 2).tokens
    return out


def test_speculative_under_tp2_matches_single_process(tp2, spec_args, single):
    one = run_speculative(SINGLE, *spec_args)
    assert tp2["spec"] == one
    assert one[1] == one[2] == single["qwen3"]["tokens"]  # speculative == plain greedy
    assert len({tuple(t) for t in one[1]}) == 2 and len(set(one[1][0])) > 3  # not one token
    refilled = one["refill"]
    assert one["refill", 1] == one["refill", 2] == refilled  # speculative == plain, refilled
    lens = [len(t) for t in refilled]
    assert min(lens) < NEW and max(lens) == NEW and len(set(lens)) > 2  # EOS ended rows apart


@pytest.mark.parametrize("env,message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2: with WORLD_SIZE=2 a rank is 0 to 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1: with WORLD_SIZE=2 a rank is 0 to 1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0: must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1: must be >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not an int"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": ""}, "MASTER_PORT not set: run under"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": ""}, "MASTER_ADDR not set: run under"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an int"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "a port is 1 to 65535"),
])
def test_a_malformed_torchrun_environment_is_refused_not_waited_on(monkeypatch, env, message):
    """RANK outside WORLD_SIZE waited forever for ranks that never come; a missing or bad
    MASTER_* was a torch traceback."""
    from draftsmith.dist import init_tp

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DraftsmithError, match=message):
        init_tp(None, "cpu")


def test_a_port_in_use_is_one_clear_error(monkeypatch):
    import socket

    from draftsmith.dist import init_tp

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(DraftsmithError, match=f"rank 0 of 1 could not join the process "
                           f"group at 127.0.0.1:{port}: .*address already in use"):
            init_tp(None, "cpu")
