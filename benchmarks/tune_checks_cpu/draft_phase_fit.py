"""Does tune price the draft phase right? The old price (steps x one drafter forward of topk
tokens) and the new one (a line through the engine's own draft phase at 2 and 4 steps) against
the draft phase profiled at other depths, batch 1, default target and its drafter."""
import json
import time

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.runtime import Runtime
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.tune import measure
from draftsmith.tune.cli import suite
from draftsmith.tune.cost_model import SpecSetting, tree_capacity

torch.manual_seed(0)
torch.set_num_threads(2)
t = load_target("default")
model = t.build(torch.float32, "cpu")
drafter = load_drafter("runs/cpu/drafter", "cpu", torch.float32, embed=model.embed.weight)
ids = [t.chat_ids([{"role": "user", "content": p}]) for p in suite(None)][:4]
max_seq = max(len(p) for p in ids) + 64 + 64
rt = Runtime(model, 1, max_seq + 40)
drt = DrafterRuntime(drafter, 1, max_seq + 40 + 64 * 7, False)
eng = measure.Engine(rt, drt, drafter)
start = time.time()
probes = [(1, k, s) for k in (1, 2, 4) for s in (measure.SHALLOW, measure.DEEP)]
first, step, _ = measure.draft_phase_costs(eng, probes, ids)
forward = measure.drafter_costs(eng, [(1, q) for q in (1, 2, 4)])[1]
for k in (1, 2, 4):
    for s in (3, 5, 6):
        n = s + 1 if k == 1 else min(tree_capacity(s, k), 16)
        got = measure.probe_phases(eng, SpecSetting(s, k, n), ids, 1).get("draft", 0.0)
        new = first[1][k] + (s - 1) * step[1][k]
        print(json.dumps({"topk": k, "steps": s, "measured_ms": round(got, 2),
                          "old_price_ms": round(s * forward[k], 2), "new_price_ms": round(new, 2),
                          "old_error_pct": round(100 * (s * forward[k] - got) / got, 1),
                          "new_error_pct": round(100 * (new - got) / got, 1)}), flush=True)
print(json.dumps({"seconds": round(time.time() - start)}))
