"""Review of data making and the training process group: server sampling fields, torchrun's
environment, templates whose end of turn is the eos token, one check and one bar a run."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from test_data_chat import masked_text as masked
from test_data_regenerate import ok_reply, running
from transformers import AutoTokenizer

from draftsmith.data.prompts import Conversation, encode_conversations
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate, request_seed
from draftsmith.errors import DraftsmithError

# --- regenerate against a server: every sampling field the run records is sent ---------------


def recording_app(bodies: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        bodies.append(await request.json())
        return ok_reply()

    return app


def test_server_requests_carry_every_sampling_field(target, tmp_path):
    """vLLM and SGLang fill a field a request leaves out from the model's generation_config.json
    (top_k 20, top_p 0.8, repetition_penalty 1.05): answers recorded as "top_k 0" were sampled
    with top_k 20. Every field is sent, "off" as both servers take it (top_k -1)."""
    bodies: list[dict] = []
    ask = [Conversation([{"role": "user", "content": "hi"}])]
    with running(recording_app(bodies)) as url:
        for k, top_k in enumerate((0, 20)):
            cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.7,
                              top_p=1.0, top_k=top_k, seed=5)
            backend = OpenAIBackend(url, "m", cfg, retries=0)
            try:
                regenerate(ask, tmp_path / f"{k}.jsonl", backend, target.tokenizer, cfg, False,
                           lambda s: None)
            finally:
                backend.close()
    off, on = bodies
    want = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seed": request_seed(5, off["messages"]), "max_tokens": 8}
    assert {k: off.get(k) for k in want} == want
    assert on["top_k"] == 20 and on["min_p"] == 0.0 and on["repetition_penalty"] == 1.0


def test_each_server_request_has_its_own_seed(target, tmp_path):
    """Every request carried --seed itself: vLLM and SGLang seed a generator per request, so
    every prompt drew the same noise at each step. A request's seed now comes from --seed and
    its messages: other prompts other seeds, the same prompt (a rerun) the same one."""
    bodies: list[dict] = []
    ask = [Conversation([{"role": "user", "content": t}]) for t in ("hi", "hello", "hi")]
    with running(recording_app(bodies)) as url:
        cfg = RegenConfig(max_new_tokens=4, max_len=128, batch_size=3, temperature=0.7, seed=5)
        backend = OpenAIBackend(url, "m", cfg, retries=0)
        try:
            regenerate(ask, tmp_path / "a.jsonl", backend, target.tokenizer, cfg, False,
                       lambda s: None)
        finally:
            backend.close()
    seeds = {b["messages"][-1]["content"]: b["seed"] for b in bodies}
    assert len(bodies) == 3 and seeds["hi"] != seeds["hello"]
    assert {b["seed"] for b in bodies if b["messages"][-1]["content"] == "hi"} == {seeds["hi"]}
    assert request_seed(6, bodies[0]["messages"]) != bodies[0]["seed"]
    assert all(0 <= s < 2**31 for s in seeds.values())


# --- train/dist.py: torchrun's environment, checked --------------------------------------------


@pytest.fixture()
def no_group(monkeypatch):
    """A process group that would be started fails at once (it would wait for ranks that never
    come); torchrun's variables start unset."""
    import torch.distributed as dist

    def wait(*a, **kw):
        raise AssertionError("init_process_group reached: this rank would wait for the others")

    monkeypatch.setattr(dist, "init_process_group", wait)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, why", [
    ({"RANK": "0", "WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, r"RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     r"RANK=2: with WORLD_SIZE=2 a rank is 0 to 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, r"LOCAL_RANK=-1"),
    ({"RANK": "1"}, r"RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, r"WORLD_SIZE is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"MASTER_ADDR and MASTER_PORT not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
     r"MASTER_PORT=99999: a port is 1 to 65535"),
])
def test_training_setup_names_a_bad_torchrun_environment(no_group, env, why):
    """Bare int() made these a ValueError traceback, and a rank outside the world (or a world
    with no rendezvous) waited for ever."""
    from draftsmith.train.dist import setup

    for k, v in env.items():
        no_group.setenv(k, v)
    with pytest.raises(DraftsmithError, match=why):
        setup("cpu")


def test_training_setup_alone_and_in_a_world_of_one(no_group):
    from draftsmith.train.dist import setup

    ctx = setup("cpu")
    assert (ctx.rank, ctx.world, ctx.main, ctx.owns_group) == (0, 1, True, False)
    no_group.setenv("RANK", "0")
    no_group.setenv("WORLD_SIZE", "1")
    assert setup("cpu").world == 1


def test_capture_ranks_are_checked_as_training_checks_them(no_group):
    """capture read RANK/WORLD_SIZE/LOCAL_RANK with bare int() too (a ValueError; "cuda:x")."""
    from draftsmith.data.capture import dist_env, rank_device

    assert dist_env() == (0, 1) and rank_device("cuda") == "cuda"
    no_group.setenv("WORLD_SIZE", "2")
    no_group.setenv("RANK", "1")
    no_group.setenv("LOCAL_RANK", "x")
    with pytest.raises(DraftsmithError, match="LOCAL_RANK='x' is not an integer"):
        rank_device("cuda")
    no_group.setenv("LOCAL_RANK", "1")
    assert dist_env() == (1, 2) and rank_device("cuda") == "cuda:1"
    no_group.setenv("RANK", "one")
    with pytest.raises(DraftsmithError, match="RANK='one' is not an integer"):
        dist_env()


# --- templates whose end of turn is the eos token ----------------------------------------------

# Phi-3-mini / Phi-3.5's template: "<|end|>" closes every turn, and the conversation (rendered
# without a generation prompt) ends with eos_token once more.
PHI3 = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ '<|system|>\n' + m['content'] + "
    "'<|end|>\n' }}{% elif m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '<|end|>\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
)
# Llama-2's shape: no turn-end marker but the eos token itself.
EOS_ONLY = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CONV = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok, more."}]


def phi_tok(folder, eos: str, template: str):
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"eos_token": eos, "additional_special_tokens": [
        "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]})
    tok.chat_template = template
    return tok




@pytest.mark.parametrize("eos", ["<|end|>", "<|endoftext|>"])
def test_phi3_template_masks_each_answer_and_its_one_end(tiny_llama_dir, eos):
    """The eos the template adds after the last "<|end|>\\n" is no turn's: it was masked with
    the last answer ("\\n<|end|>" trained after the eos that ends generation), and with eos
    <|endoftext|> the first answer's span ran to the end, so the second was "not rendered"."""
    tok = phi_tok(tiny_llama_dir, eos, PHI3)
    assert masked(tok, CONV) == ["hello!<|end|>", "ok, more.<|end|>"]
    assert masked(tok, CONV, {1}) == ["hello!", "ok, more.<|end|>"]
    assert masked(tok, CONV, {1, 3}) == ["hello!", "ok, more."]
    opening = [{"role": "assistant", "content": "Hi!"}, *CONV]
    assert masked(tok, opening, {4})[0] == "Hi!<|end|>"
    assert masked(tok, opening, {4})[-1] == "ok, more."


def test_eos_only_turn_end_and_regenerates_cut_turns(tiny_llama_dir):
    """A template with no turn-end marker but eos: an answer trains its eos, one cut at max
    tokens (meta.answers finish "length", as regenerate records it) trains none."""
    tok = phi_tok(tiny_llama_dir, "</s>", EOS_ONLY)
    assert masked(tok, CONV) == [" hello!</s>", " ok, more.</s>"]
    meta = {"answers": [{"turn": 0, "finish": "stop"}, {"turn": 1, "finish": "length"}]}
    [(ids, mask)] = list(encode_conversations(tok, [Conversation(CONV, meta=meta)], "a.jsonl"))
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    eos = tok.convert_tokens_to_ids("</s>")
    assert trained.count(eos) == 1 and tok.decode(trained).endswith("ok, more.")


# --- one validation pass and one progress bar a run ---------------------------------------------


def test_self_made_prompts_check_each_batch_once_under_one_bar(target, model, tmp_path,
                                                                monkeypatch):
    import tqdm

    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
    from draftsmith.engine import generate as gen

    checks, runs, bars = [], [], []
    plain, run = gen.check_prompts, gen.run_generation
    monkeypatch.setattr(gen, "check_prompts", lambda p, v: (checks.append(len(p)), plain(p, v)))
    monkeypatch.setattr(gen, "run_generation", lambda *a: (runs.append(1), run(*a))[1])
    real = tqdm.tqdm

    def bar(*a, **kw):
        bars.append(kw.get("desc"))
        return real(*a, **kw)

    monkeypatch.setattr(tqdm, "tqdm", bar)
    cfg = MagpieConfig(n=50, batch_size=2, max_new_tokens=6, min_chars=1, max_batches=3)
    self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False, log=print)
    assert bars == ["prompts"] and len(runs) == 3 and checks == [2] * 3
