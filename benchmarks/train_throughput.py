"""Training throughput of `draftsmith train` (tokens/s), offline (hidden states from a dataset
folder) and online (the target computes them per batch), on a random target.

Usage: python benchmarks/train_throughput.py [--preset smollm|tiny] [--max-len 2048]
       [--batch-size 4] [--steps 10] [--warmup 3] [--samples 64] [--device auto] [--out DIR]
       [--modes offline,online,online-compiled-loss] [--draft-vocab-size 32000]
The `smollm` preset has SmolLM2-135M's shapes (the default target): 30 layers, hidden 576,
9 heads (3 KV), vocab 49152; the drafter is one such layer with a 32000-token draft vocab.
Prints a table, then one JSON line. Random weights: the speed is real, the accuracy is not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.shards import Sample, ShardWriter
from draftsmith.layers import CANONICAL_WORDS, default_aux_layers
from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import write_byte_tokenizer
from draftsmith.train import TrainConfig
from draftsmith.train.batches import TokenSource
from draftsmith.train.dist import setup
from draftsmith.train.loop import Trainer
from draftsmith.train.report import read_log
from draftsmith.train.sources import Data

PRESETS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2),
    "smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   rope_theta=100000.0, tie_word_embeddings=True),
}


def make_target(folder: Path, preset: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, **PRESETS[preset])
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    write_byte_tokenizer(folder, vocab_size=128)


def token_samples(n: int, vocab: int, max_len: int) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = int(torch.randint(max_len // 4, max_len + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (t,), generator=g).tolist()
        out.append((ids, [i >= t // 5 for i in range(t)]))
    return out


@torch.no_grad()
def capture(target, samples, folder: Path, device: str) -> None:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = target.build(dtype, device)
    aux = default_aux_layers(target.cfg.num_layers)
    header = {"target": {"fingerprint": target.fingerprint, "source": target.source,
                         "num_layers": target.cfg.num_layers},
              "aux_layer_ids": aux, "aux_convention": CANONICAL_WORDS,
              "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size}
    w = ShardWriter(folder, header, ("target",))
    shard = []
    for i, (ids, mask) in enumerate(samples):
        x = torch.tensor([ids], device=device)
        fo = model(x, torch.arange(len(ids), device=device)[None], aux_ids=tuple(aux),
                   want_logits=False)
        shard.append(Sample(f"s{i}", x[0].cpu(), torch.tensor(mask), fo.aux[0].cpu(),
                            fo.hidden[0].cpu()))
        if len(shard) == 16:
            w.write(i // 16, shard)
            shard = []
    if shard:
        w.write(len(samples) // 16, shard)
    w.finish()


class OnlineTrainer(Trainer):
    samples: list = []

    def _open_data(self) -> Data:
        src = TokenSource(self.samples)
        ids = default_aux_layers(self.target.cfg.num_layers)
        return Data(src, src.lengths(), ids, True, {"kind": "online", "samples": len(src)})


def measure(cls, cfg: TrainConfig, warmup: int) -> dict:
    ctx = setup(cfg.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cls(cfg, ctx).run()
    wall = time.perf_counter() - t0
    rows = read_log(Path(cfg.out))[warmup:]
    tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(rows, rows[1:], strict=False))
    seconds = sum((r["tokens"] - p["tokens"]) / r["tokens_per_s"]
                  for p, r in zip(rows, rows[1:], strict=False))
    out = {"tokens_per_s": tokens / seconds, "s_per_step": seconds / max(1, len(rows) - 1),
           "tokens_per_step": tokens / max(1, len(rows) - 1), "wall_s": wall,
           "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}
    if ctx.device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "cpu"
    return f"{name} ({os.cpu_count()} cores)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm", choices=sorted(PRESETS))
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--modes", default="offline,online",
                    help="offline, online, online-compiled-loss (online with --compile-loss)")
    ap.add_argument("--draft-vocab-size", type=int, default=32000)
    ap.add_argument("--loader-workers", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    root = Path(a.out or tempfile.mkdtemp(prefix="train-bench-"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    make_target(root / "target", a.preset)
    target = load_target(root / "target")
    samples = token_samples(a.samples, target.cfg.vocab_size, a.max_len)
    base = dict(target=str(root / "target"), max_steps=a.warmup + a.steps, log_every=1,
                save_every=10**9, batch_size=a.batch_size, max_len=a.max_len,
                ttt_steps=a.ttt_steps, device=device, progress=False,
                loader_workers=a.loader_workers, draft_vocab_size=a.draft_vocab_size)
    modes = a.modes.split(",")
    if unknown := set(modes) - {"offline", "online", "online-compiled-loss"}:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}")
    results = {}
    if "offline" in modes:
        capture(target, samples, root / "data", device)
        cfg = TrainConfig(out=str(root / "offline"), data=str(root / "data"), compile_loss=False,
                          **base)  # like "online": the eager loss
        results["offline"] = measure(Trainer, cfg, a.warmup)
    OnlineTrainer.samples = samples
    for mode in ("online", "online-compiled-loss"):  # one process: a side-by-side A/B
        if mode in modes:
            cfg = TrainConfig(out=str(root / mode), prompts="(in memory)",
                              compile_loss=mode.endswith("compiled-loss"), **base)
            results[mode] = measure(OnlineTrainer, cfg, a.warmup)
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else cpu_name()
    print(f"{'mode':<20} {'tokens/s':>10} {'s/step':>8} {'tokens/step':>12} {'peak GiB':>9}")
    for mode, r in results.items():
        print(f"{mode:<20} {r['tokens_per_s']:>10.0f} {r['s_per_step']:>8.3f} "
              f"{r['tokens_per_step']:>12.0f} {r.get('peak_gib', float('nan')):>9.2f}")
    print(json.dumps({"bench": "train_throughput", "preset": a.preset, "device": dev,
                      "threads": torch.get_num_threads(), "max_len": a.max_len,
                      "batch_size": a.batch_size, "ttt_steps": a.ttt_steps,
                      "draft_vocab_size": a.draft_vocab_size,
                      "loader_workers": a.loader_workers,
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                      **{m: r for m, r in results.items()}}))


if __name__ == "__main__":
    main()
