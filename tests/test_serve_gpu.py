"""`draftsmith serve` on the GPU: continuous batching over CUDA-graphed rows, baseline and
speculative, through the real uvicorn server and `openai` client. Every answer, whichever row it
joined and whenever, equals eager greedy decoding of its prompt alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import PROMPTS, ask, chat_ids, live, reference, streamed, write_drafter  # noqa: E402

from draftsmith.engine.refill import prefill_runtime  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402
from draftsmith.targets import load_target  # noqa: E402

pytestmark = pytest.mark.gpu
LENS = [20, 6, 14, 9, 17, 4, 25, 11, 3, 16]  # rows end apart: queued requests join running ones


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("serve_gpu_target"), "llama", seed=2)


def check_continuous(engine: ServeEngine, tiny_dir: Path) -> dict:
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), n, i % 3 == 0)
            for i, n in enumerate(LENS)]
    with live(engine, str(tiny_dir)) as s:
        def one(job: tuple[str, int, bool]) -> str:
            text, n, stream = job
            return streamed(s, text, n)[0] if stream else ask(s, text, n).choices[0].message.content

        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(one, jobs))
        m = httpx.get(s["url"] + "/metrics").json()
    for (text, n, _), out in zip(jobs, got, strict=True):
        assert out == reference(engine, chat_ids(engine, text), n), (text, n)
    assert m["completed"] == len(jobs) and m["batches"] < len(jobs)
    assert m["joined_rows"] > 0  # some requests joined rows that were already decoding
    return m


def graph_keys(engine: ServeEngine) -> tuple[set, set]:
    """The rows' decode steps and the prompt passes captured so far."""
    steps = {k[:2] for k in engine.rt.graphs.graphs if k[0] == "refill"}
    return steps, set(prefill_runtime(engine.rt).graphs.graphs)


@pytest.mark.parametrize("compile", [False, True])
def test_baseline_server_continuous_rows_on_cuda_graphs(tiny_dir: Path, compile: bool) -> None:
    cfg = EngineConfig(max_batch=4, max_prompt_tokens=64, max_tokens=32, compile=compile)
    engine = load_engine(str(tiny_dir), None, "cuda", torch.float32, cfg)
    assert engine.rt.graph_compiled == compile
    engine.warmup()
    steps, prompts = graph_keys(engine)
    assert steps == {("refill", b) for b in (1, 2, 4)}  # every size a batch opens at
    # prompt passes: rows padded to 1, 2 or 4, every bucket up to 64 tokens
    assert {k[1:3] for k in prompts} == {(b, q) for b in (1, 2, 4) for q in (16, 24, 32, 48, 64)}
    check_continuous(engine, tiny_dir)
    assert graph_keys(engine) == (steps, prompts)  # serving captured nothing new


@pytest.mark.parametrize(("topk", "ndt", "compile"), [(1, None, False), (2, 6, False),
                                                      (2, 6, True)])
def test_speculative_server_continuous_rows_on_cuda_graphs(tiny_dir: Path, tmp_path: Path,
                                                           topk: int, ndt: int | None,
                                                           compile: bool) -> None:
    cfg = EngineConfig(max_batch=4, max_prompt_tokens=64, max_tokens=32, steps=3, topk=topk,
                       num_draft_tokens=ndt, compile=compile)
    t = load_target(str(tiny_dir))
    drafter = write_drafter(t, t.build(torch.float32, "cpu").embed.weight, tmp_path)
    engine = load_engine(str(tiny_dir), drafter, "cuda", torch.float32, cfg)
    engine.warmup()
    prompts = graph_keys(engine)[1]
    m = check_continuous(engine, tiny_dir)
    assert graph_keys(engine)[1] == prompts and prompts
    assert m["speculative"] is True and sum(m["accept_hist"]) > 0  # cycles ran speculatively
