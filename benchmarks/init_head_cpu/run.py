"""60 CPU steps of online training, draft head random or from the target (../init_head_cpu.md).

Usage: python benchmarks/init_head_cpu/run.py random|target STEPS [ANSWERS_JSONL]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from draftsmith.train import TrainConfig, train


def main() -> None:
    init, steps = sys.argv[1], int(sys.argv[2])
    answers = sys.argv[3] if len(sys.argv) > 3 else "/tmp/gpu/runs/demo/data/answers.jsonl"
    torch.set_num_threads(1)
    t = time.time()
    train(TrainConfig(out=f"/tmp/initexp/{init}", prompts=answers, target="default",
                      max_steps=steps, batch_size=4, max_len=256, ttt_steps=3, lr=5e-4,
                      warmup_steps=5, draft_vocab_size=8192, log_every=10, device="cpu",
                      loader_workers=0, progress=False, save_every=10**6, init_head=init))
    print(init, "seconds", time.time() - t)
    with open(f"/tmp/initexp/{init}/train_log.jsonl") as f:
        for line in f:
            r = json.loads(line)
            acc = [None if a is None else round(a, 3) for a in r["acc"]]  # None: unmeasured
            print(r["step"], round(r["loss"], 3), acc)


if __name__ == "__main__":
    main()
