"""The stages agree with each other: a drafter trained by `train` on data made by `data` is
accepted by `SpecDecoder` on the same conversations (train and inference wire alike)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_folder


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {}),
    ("qwen3", {}),  # q/k norms, its own head size
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, a tied head
    ("mistral", {"sliding_window": 64}),  # the engine's cache must stay within the window
])
def test_overfit_drafter_is_accepted_by_the_engine(tmp_path, arch, over):
    from draftsmith.data.capture import CaptureConfig, capture
    from draftsmith.data.prompts import Conversation
    from draftsmith.data.shards import Dataset
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target
    from draftsmith.train import TrainConfig, train

    t = load_target(write_tiny_folder(tmp_path / "t", arch, num_hidden_layers=8, **over))
    model = t.build(torch.float32)
    users = ["hello there", "what is two", "abc", "tell me"]
    prompts = [t.chat_ids([{"role": "user", "content": u}]) for u in users]
    answers = generate(model, prompts, 24)  # the target's own greedy answers
    convs = [
        Conversation([{"role": "user", "content": u},
                      {"role": "assistant", "content": t.tokenizer.decode(a)}])
        for u, a in zip(users, answers, strict=True)
    ]
    capture(t, convs, tmp_path / "data", CaptureConfig(None, 4, 256), progress=False,
            model=model)
    train(TrainConfig(out=str(tmp_path / "d"), data=str(tmp_path / "data"), epochs=150,
                      lr=3e-3, warmup_steps=5, batch_size=4, max_len=64, draft_vocab_size=128,
                      ttt_steps=3, device="cpu", save_every=10**6, progress=False,
                      loader_workers=0, log_every=50))
    drafter = load_drafter(tmp_path / "d")
    fed = []  # what the engine feeds the drafter's fc: an overfit drafter accepts even states
    fuse = drafter.fuse  # a layer off, so the acceptance alone cannot see the wiring
    drafter.fuse = lambda aux: fuse(fed.append(aux.clone()) or aux)
    dec = SpecDecoder(Runtime(model, 4, 64), drafter, steps=3)
    res = dec.generate(prompts, 24)
    assert res.tokens == [a[:24] for a in answers]  # lossless
    assert res.mean_accept_length > 2.0, res.to_dict()  # memorised drafts get accepted
    ds = Dataset(tmp_path / "data")
    for r, p in enumerate(prompts):  # the prompt pass feeds the states the data holds
        s = ds[r]
        assert s["input_ids"][: len(p)].tolist() == p
        want, got = s["aux"][: len(p)].float(), fed[0][r, : len(p)]
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.02, r
