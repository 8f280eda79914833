"""A drafter whose d2t sends two draft ids to one target token: a warning when it loads, and a
server over it that answers sampled requests it cannot decode exactly with a 400, not a 500."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import ask, live, reference  # noqa: E402
from test_serve_frontends import linked, remote_job, wait_for  # noqa: E402

from draftsmith.engine import speculative  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402

SAID = "draft ids 0 and 5 to one target id 5"  # d2t[0] = 5: draft ids 0 and 5 both give 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("review11_target"), "llama", seed=2)


def _drafter(tiny_dir: Path, folder: Path, shared: bool) -> Path:
    from draftsmith.layers import default_aux_layers
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    t = load_target(str(tiny_dir))
    cfg = Eagle3Config.for_target(t.cfg, t.cfg.vocab_size, default_aux_layers(t.cfg.num_layers),
                                  target_fingerprint=t.fingerprint)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.init_weights()
    d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    d2t[0] = 5 if shared else 0
    d.set_vocab(d2t, torch.ones(cfg.vocab_size, dtype=torch.bool))
    return save_drafter(d, folder)


@pytest.fixture(scope="module")
def shared_dir(tiny_dir: Path, tmp_path_factory) -> Path:
    return _drafter(tiny_dir, tmp_path_factory.mktemp("shared"), shared=True)


def test_loading_a_drafter_of_shared_target_ids_warns_once_naming_the_pair(
        tiny_dir: Path, shared_dir: Path, tmp_path: Path) -> None:
    """It loaded without a word; greedy decoding is exact with it, so a warning, not a refusal."""
    from draftsmith.models.eagle3 import load_drafter

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        load_drafter(shared_dir)
    said = [str(w.message) for w in got]
    assert len(said) == 1 and SAID in said[0] and "greedy decoding with it is exact" in said[0]
    assert str(shared_dir) in said[0]
    fine = _drafter(tiny_dir, tmp_path / "fine", shared=False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        load_drafter(fine)
    assert [str(w.message) for w in got] == []


def _engine(tiny_dir: Path, drafter: Path, topk: int, logs: list[str]) -> ServeEngine:
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=64, max_tokens=16, steps=2, topk=topk,
                       num_draft_tokens=4 if topk > 1 else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_engine(str(tiny_dir), drafter, "cpu", torch.float32, cfg, log=logs.append)


@pytest.fixture(scope="module")
def tree(tiny_dir: Path, shared_dir: Path) -> tuple[ServeEngine, list[str]]:
    logs: list[str] = []
    return _engine(tiny_dir, shared_dir, 2, logs), logs


def test_a_tree_server_answers_sampled_requests_400_and_greedy_ones(tiny_dir: Path, tree) -> None:
    """The sampled decoder was built on the first sampled request and refused there: a 500
    'engine error' with a traceback (a stream: 200, then an error event)."""
    eng, logs = tree
    assert any("sampled requests will be refused (400)" in x and SAID in x for x in logs)
    eng.warmup(kinds=("temperature", "filtered"))  # sampled kinds never served: not warmed
    assert list(eng._spec) == ["greedy"]
    assert eng.warmed_kinds(("temperature", "filtered")) == ("greedy",)  # serve's line says so
    with live(eng, str(tiny_dir)) as s:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                ask(s, "hello", 8, stream=stream, extra_body={"temperature": 0.7})
            assert e.value.status_code == 400 and SAID in str(e.value)
            assert "greedily only, send temperature 0" in str(e.value)
        r = httpx.post(s["url"] + "/v1/completions", json={
            "model": s["model"], "prompt": "abc", "max_tokens": 4, "top_p": 0.9,
            "temperature": 1.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        out = ask(s, "hello", 8)
        ids = eng.target.chat_ids([{"role": "user", "content": "hello"}])
        assert out.choices[0].message.content == reference(eng, ids, 8)


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
def test_a_chain_server_refuses_sampling_only_under_drawn_drafts(tiny_dir: Path,
                                                                 shared_dir: Path, drafts: str,
                                                                 monkeypatch) -> None:
    """A chain matched against the target's draws keeps its distribution with such a d2t: served;
    drafts drawn from the drafter read its q: refused."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    logs: list[str] = []
    eng = _engine(tiny_dir, shared_dir, 1, logs)
    with live(eng, str(tiny_dir)) as s:
        r = httpx.post(s["url"] + "/v1/completions", json={
            "model": s["model"], "prompt": "abc", "max_tokens": 4, "temperature": 0.8,
            "seed": 1})
        if drafts == "topk":
            assert r.status_code == 200, r.text
            assert eng.greedy_only is None and not any("refused" in x for x in logs), logs
        else:
            assert r.status_code == 400 and SAID in r.json()["error"]["message"]


@pytest.mark.slow  # ~5 s: the default suite stays under 10 minutes on 2 cores
def test_the_frontends_pass_the_400_on(tree) -> None:
    """`serve --frontends N`: the engine process's scheduler refuses the job at submit, and the
    refusal crosses the pipe with its status."""
    from draftsmith.engine.params import SamplingParams
    from draftsmith.serve.scheduler import Scheduler

    sched = Scheduler(tree[0])
    sched.start()
    link, remote, _ = linked(sched)
    try:
        events: list = []
        job = remote_job(events)
        job.req.params = SamplingParams(0.7)
        remote.submit(job)
        wait_for(lambda: events)
        assert events[0][:2] == ("error", 400) and SAID in events[0][2]
    finally:
        remote.stop()
        link.close()
        sched.stop()


@pytest.mark.parametrize("topk", [1, 2])
def test_a_server_over_shared_target_ids_says_so_once_in_its_own_log(
        tiny_dir: Path, shared_dir: Path, topk: int) -> None:
    """serve printed the load's Python warning and then its own 'refused (400)' line naming the
    same pair: the pair twice at start. Now its log says it once, a chain server (which samples
    with it) as the load's warning, a tree server as its refusal."""
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=64, max_tokens=16, steps=2, topk=topk,
                       num_draft_tokens=4 if topk > 1 else None)
    logs: list[str] = []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        load_engine(str(tiny_dir), shared_dir, "cpu", torch.float32, cfg, log=logs.append)
    said = [x for x in logs + [str(w.message) for w in got] if SAID in x]
    assert len(said) == 1 and said[0] in logs, said
    assert ("refused (400)" in said[0]) == (topk > 1)
