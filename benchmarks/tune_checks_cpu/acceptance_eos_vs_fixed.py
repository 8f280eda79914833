"""Does tune's acceptance differ between rows stopped at EOS and fixed-length rows?"""
import json
import sys
import time

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.tune import measure
from draftsmith.tune.cli import suite
from draftsmith.tune.cost_model import SpecSetting, chain_tokens_per_cycle

temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
torch.manual_seed(0)
t = load_target("default")
model = t.build(torch.float32, "cpu")
drafter = load_drafter("runs/cpu/drafter", "cpu", torch.float32, embed=model.embed.weight)
ids = [t.chat_ids([{"role": "user", "content": p}]) for p in suite(None)][:16]
new = 96
max_seq = max(len(p) for p in ids) + new + 64
rt = Runtime(model, 8, max_seq + 40)
drt = DrafterRuntime(drafter, 8, max_seq + 40 + 64 * 6, False)
eng = measure.Engine(rt, drt, drafter, SamplingParams(temp))
out = {"temperature": temp}
for name, eos in (("eos", t.eos_ids), ("fixed", [])):
    s = time.time()
    acc, _ = measure.chain_acceptance(eng, ids, 6, new, eos)
    out[name] = {"chain": [round(x, 3) for x in acc.chain],
                 "tokens_per_cycle_chain3": round(chain_tokens_per_cycle(acc, 3), 3),
                 "s": round(time.time() - s)}
    print(json.dumps(out), flush=True)
# what the sweep measures: chain 3 on fixed-length rows, 8 rows a batch
dec = measure.decoder(eng, SpecSetting(3, 1, 4))
res = [dec.generate(ids[i:i + 8], new, []) for i in (0, 8)]
out["sweep_chain3_fixed_accept"] = round(sum(r.mean_accept_length for r in res) / 2, 3)
print(json.dumps(out), flush=True)
