import json, sys, time
import torch
from draftsmith.train import TrainConfig, train
init = sys.argv[1]
torch.set_num_threads(1)
t = time.time()
train(TrainConfig(out=f"/tmp/initexp/{init}", prompts="/tmp/gpu/runs/demo/data/answers.jsonl",
                  target="default", max_steps=int(sys.argv[2]), batch_size=4, max_len=256, ttt_steps=3,
                  lr=5e-4, warmup_steps=5, draft_vocab_size=8192, log_every=10, device="cpu",
                  loader_workers=0, progress=False, save_every=10**6, init_head=init))
print(init, "seconds", time.time() - t)
for l in open(f"/tmp/initexp/{init}/train_log.jsonl"):
    r = json.loads(l); print(r["step"], round(r["loss"], 3), [round(a, 3) for a in r["acc"]])
