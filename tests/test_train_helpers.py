"""Shared helpers for the drafter/train/export tests (no tests here): tiny targets and datasets."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import write_tiny_folder

from draftsmith.data.shards import Sample, ShardWriter
from draftsmith.layers import CANONICAL_WORDS
from draftsmith.targets import Target, load_target

AUX = [1, 2, 4]




def tiny_target(folder: Path, **over) -> Target:
    if not (folder / "config.json").is_file():
        write_tiny_folder(folder, "llama", **over)
    return load_target(folder)


def token_samples(n: int, vocab: int = 128, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """(ids, loss mask) pairs: a short 'prompt' then an 'answer' drawn from a small repetitive
    alphabet, so a drafter has something to learn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 12 + (i * 7) % 13
        prompt = torch.randint(6, vocab, (4,), generator=g)
        period = torch.randint(6, 40, (3,), generator=g)
        answer = period.repeat(t // 3 + 1)[: t - 4]
        ids = torch.cat([prompt, answer])
        mask = torch.zeros(t, dtype=torch.bool)
        mask[4:] = True
        out.append((ids, mask))
    return out


@torch.no_grad()
def write_dataset(folder: Path, target: Target, n: int = 24, seed: int = 0,
                  per_shard: int = 8, aux: list[int] = AUX, poison: int | None = None) -> Path:
    model = target.build(torch.float32)
    header = {
        "target": {"fingerprint": target.fingerprint, "source": target.source,
                   "num_layers": target.cfg.num_layers},
        "aux_layer_ids": aux, "aux_convention": CANONICAL_WORDS,
        "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size,
    }
    writer = ShardWriter(folder, header, ("target", "aux_layer_ids"))
    samples = []
    for i, (ids, mask) in enumerate(token_samples(n, target.cfg.vocab_size, seed)):
        pos = torch.arange(len(ids))[None]
        fo = model(ids[None], pos, aux_ids=tuple(aux), want_logits=False)
        a = fo.aux[0].clone()
        if i == poison:
            a[len(ids) // 2] = float("nan")
        samples.append(Sample(f"s{i}", ids, mask, a, fo.hidden[0]))
    for k in range(0, n, per_shard):
        writer.write(k // per_shard, samples[k : k + per_shard])
    writer.finish()
    return folder
