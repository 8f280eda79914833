"""Chain 3 at batch 1 on each chat prompt alone: how far one prompt's accept length strays."""
import json

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.runtime import Runtime
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.tune import measure
from draftsmith.tune.cli import suite
from draftsmith.tune.cost_model import SpecSetting

t = load_target("default")
model = t.build(torch.float32, "cpu")
drafter = load_drafter("runs/cpu/drafter", "cpu", torch.float32, embed=model.embed.weight)
ids = [t.chat_ids([{"role": "user", "content": p}]) for p in suite(None)]
new = 128
max_seq = max(len(p) for p in ids) + new + 64
rt = Runtime(model, 1, max_seq + 40)
eng = measure.Engine(rt, DrafterRuntime(drafter, 1, max_seq + 40 + 64 * 6, False), drafter)
dec = measure.decoder(eng, SpecSetting(3, 1, 4))
per = [dec.generate([p], new, []).mean_accept_length for p in ids]
print(json.dumps({"prompt0": round(per[0], 3), "mean": round(sum(per) / len(per), 3),
                  "min": round(min(per), 3), "max": round(max(per), 3), "n": len(per)}))
