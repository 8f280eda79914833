"""Each prompt's chain-3 tokens a cycle from its answer (chain 4 decoded alone, stopped at EOS,
as `tune` measures a prompt) against its fixed-length row (chain 3, 48 tokens, no EOS, as the
sweep decodes it), for both CPU prompt sets. One JSON line a set: per prompt, (answer tokens
before EOS, predicted, measured on the fixed-length row, its cycles).

Run from the repository root with `.kept19` restored as runs/cpu/drafter.
"""

import json
from pathlib import Path

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.runtime import Runtime
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.tune import measure
from draftsmith.tune.cli import suite
from draftsmith.tune.cost_model import Acceptance, SpecSetting, chain_tokens_per_cycle

NEW = 48
SETS = ("benchmarks/tune_refill_cpu/prompts8.jsonl",
        "benchmarks/tune_checks_cpu/prompts_9_16.jsonl")


def main() -> None:
    t = load_target("default")
    model = t.build(torch.float32, "cpu")
    drafter = load_drafter("runs/cpu/drafter", "cpu", torch.float32, embed=model.embed.weight)
    for path in SETS:
        ids = [t.chat_ids([{"role": "user", "content": p}]) for p in suite(Path(path))]
        seq = max(len(p) for p in ids) + NEW + 104
        eng = measure.Engine(Runtime(model, 4, seq), DrafterRuntime(drafter, 4, seq + 256, False),
                             drafter)
        deep, chain3 = (measure.decoder(eng, SpecSetting(s, 1, s + 1)) for s in (4, 3))
        rows = []
        for p in ids:
            answer = deep.generate([p], NEW, t.eos_ids)
            own = Acceptance.from_chain_counts(answer.reached, answer.accepted)
            fixed = chain3.generate([p], NEW, [])
            rows.append((len(answer.tokens[0]), round(chain_tokens_per_cycle(own, 3), 2),
                         round((NEW - 1) / fixed.cycles, 2), fixed.cycles))
        print(json.dumps({"prompts": path, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
