"""Review of `data regenerate`: a refilled chunk (or later turn) of fewer prompts than
--batch-size decodes only the rows it needs, its answers still reproducible; a server's answer
cut off (finish_reason "abort") is a failed one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import (
    UNFINISHED,
    Answer,
    EngineBackend,
    RegenConfig,
    decode_rows,
    regenerate,
    reply,
)
from draftsmith.engine.refill import generate_refill


@contextmanager
def decode_batches(model: torch.nn.Module) -> Iterator[list[int]]:
    """The batch of every one-token forward (a decode step) `model` runs meanwhile."""
    seen: list[int] = []

    def hook(_mod, args, _out) -> None:
        if args and args[0].dim() == 2 and args[0].shape[1] == 1:
            seen.append(args[0].shape[0])

    handle = model.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def asks(n: int, tag: str = "q") -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i} " * (1 + i % 3)}],
                         f"{tag}{i}") for i in range(n)]


def run(convs, out, backend, target, cfg) -> dict[str, int]:
    return regenerate(convs, out, backend, target.tokenizer, cfg, False, lambda s: None)


def test_a_small_chunk_decodes_only_its_rows(target, model, tmp_path):
    """`data make --n 3` at --batch-size 8 decoded 8 rows a step, 5 of them idle."""
    cfg = RegenConfig(max_new_tokens=6, max_len=96, batch_size=8, temperature=0.0)
    backend = EngineBackend(target, model, cfg)
    with decode_batches(model) as seen:
        stats = run(asks(3), tmp_path / "a.jsonl", backend, target, cfg)
    assert stats["answered"] == 3
    assert seen and set(seen) == {3}, seen


def test_greedy_answers_are_those_of_the_full_batch(target, model, tmp_path):
    cfg = RegenConfig(max_new_tokens=8, max_len=96, batch_size=8, temperature=0.0)
    backend = EngineBackend(target, model, cfg)
    ids = [target.chat_ids(c.messages, True) for c in asks(3)]
    full = generate_refill(backend.rt, ids, 8, backend.params, target.eos_ids, 8)
    got = backend.answer([c.messages for c in asks(3)])
    dec = target.tokenizer.decode
    assert [a.text for a in got] == [dec(t, skip_special_tokens=True).strip() for t in full]


def test_sampled_small_chunks_repeat_and_resume_as_uninterrupted(target, model, tmp_path):
    """Chunks of 32 prompts (batch 4 x REFILL_CHUNK): the last of 3 prompts, and a second turn
    of one, decode in fewer rows; a rerun and a resumed run write the same answers."""
    convs = asks(35)
    convs[33] = Conversation([{"role": "user", "content": "first?"},
                              {"role": "assistant", "content": "old"},
                              {"role": "user", "content": "second?"}], "multi")
    cfg = RegenConfig(max_new_tokens=4, max_len=96, batch_size=4, temperature=1.0, seed=3)
    backend = EngineBackend(target, model, cfg)
    whole, again, part = (tmp_path / f"{n}.jsonl" for n in ("whole", "again", "part"))
    with decode_batches(model) as seen:
        run(convs, whole, backend, target, cfg)
    assert {1, 3} <= set(seen), seen  # the last chunk's 3 prompts, its second turn's one
    run(convs, again, backend, target, cfg)
    assert again.read_text() == whole.read_text()
    fresh = EngineBackend(target, model, cfg)  # a new process: no state of the small chunks
    run(convs[:32], part, fresh, target, cfg)
    stats = run(convs, part, fresh, target, cfg)
    assert stats["done_before"] == 32 and stats["answered"] == 3
    assert part.read_text() == whole.read_text()


def test_cuda_keeps_every_row():
    """On CUDA each row count is its own graph and kernels: the full batch stays."""
    assert decode_rows(3, 8, torch.device("cuda")) == 8
    assert decode_rows(3, 8, torch.device("cpu")) == 3
    assert decode_rows(20, 8, torch.device("cpu")) == 8


def _completion(content: str, finish: str) -> SimpleNamespace:
    msg = SimpleNamespace(content=content, tool_calls=None)
    return SimpleNamespace(model="m", choices=[SimpleNamespace(message=msg, finish_reason=finish)],
                           usage=SimpleNamespace(completion_tokens=3))


def test_an_answer_the_server_cut_off_is_failed_not_kept(target, tmp_path):
    """vLLM answers a request it aborted with the text so far and finish_reason "abort" (a proxy:
    "content_filter"): kept as finished, capture trained an end of turn after a partial answer."""
    for finish in UNFINISHED:
        got = reply(_completion("half an ans", finish), "m")
        assert got.finish.startswith("error: the server cut the answer off") and not got.text
        assert repr(finish) in got.finish
    assert reply(_completion("whole", "stop"), "m") == Answer("whole", 3, "stop")
    assert reply(_completion("long", "length"), "m") == Answer("long", 3, "length")

    class Server:
        name, model_name, base_url = "openai", "m", "http://x"

        def answer(self, batch):
            return [reply(_completion("text", "abort" if "cut" in m[-1]["content"] else "stop"),
                          "m") for m in batch]

    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=4)
    convs = [Conversation([{"role": "user", "content": t}]) for t in ("cut one", "whole one")]
    out = tmp_path / "a.jsonl"
    stats = regenerate(convs, out, Server(), target.tokenizer, cfg, False, lambda s: None)
    assert stats["failed"] == 1 and stats["answered"] == 1
    assert [r["meta"]["prompt_id"] for r in read_jsonl_tail_safe(out)] == [convs[1].id]
