"""Where does a drafter stop generalising? Its acceptance on four prompt sets, one run.

The same drafter and target decode greedy chains over: unseen self-made prompts (the kind it was
trained on, new seed), self-made prompts that start with `--openings builtin`, the built-in chat
suite and HumanEval. Acceptance is a property of drafter and prompts, not of the device, so a CPU
run in fp32 answers the question (speed figures come from the GPU benchmarks, not from here).

Usage: python benchmarks/acceptance_by_prompts.py --drafter DIR --out DIR [--n 24] [--new 64]
Writes OUT/acceptance.json, OUT/acceptance.md and OUT/acceptance.png.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch


def prompt_sets(t, model, n: int, work: Path) -> dict[str, list[list[int]]]:
    from draftsmith.bench.suites import suite_messages
    from draftsmith.data.prompts import read_prompts
    from draftsmith.data.selfmade import BUILTIN_OPENINGS, MagpieConfig, self_made_prompts

    sets = {}
    for name, opens in (("self-made, unseen", ()), ("self-made + openings", BUILTIN_OPENINGS)):
        path = work / f"{'openings' if opens else 'plain'}.jsonl"
        cfg = MagpieConfig(n, 16, 96, seed=7, openings=opens)
        self_made_prompts(t, path, cfg, model, progress=False)
        convs = list(read_prompts(path))[:n]
        sets[name] = [t.chat_ids([{"role": "user", "content": c.first_user()}]) for c in convs]
    for suite in ("chat", "humaneval"):
        sets[suite] = [t.chat_ids(m) for m in suite_messages(suite, n)]
    return sets


def measure(dec, prompts: list[list[int]], new: int, eos: list[int], batch: int) -> dict:
    from draftsmith.engine.spec_state import SpecResult

    m = SpecResult.merged([dec.generate(prompts[i : i + batch], new, eos)
                           for i in range(0, len(prompts), batch)])
    return {"prompts": len(prompts), "cycles": sum(m.accept_hist),
            "position_acceptance": m.position_rates, "accept_length": m.mean_accept_length}


def report(res: dict, out: Path) -> str:
    lines = ["| prompt set | prompts | cycles | accept length | per-position acceptance |",
             "|---|---|---|---|---|"]
    for name, r in res["sets"].items():
        pos = " ".join(f"{p:.2f}" for p in r["position_acceptance"])
        lines.append(f"| {name} | {r['prompts']} | {r['cycles']} | {r['accept_length']:.2f} | "
                     f"{pos} |")
    text = "\n".join(lines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res["sets"].items():
        pos = r["position_acceptance"]
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=name)
    ax.set_xlabel("drafted position (chain)")
    ax.set_ylabel("acceptance given the earlier ones")
    ax.set_ylim(0, 1)
    ax.set_title(f"Acceptance by prompt set ({res['steps']} chain steps, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    return text


def write_results(res: dict, out: Path, stem: str, report: Callable[[dict, Path], str]) -> None:
    """res as out/stem.json, its report (tables; plots written beside) as out/stem.md, and the
    report printed: the tail of this script and of acceptance_by_confidence.py and
    draft_vocab_coverage.py."""
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    text = report(res, out)
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)


def cpu_pair(target: str, drafter: str, out: str) -> tuple:
    """(the output folder, made; target, its model, the drafter) in fp32 on the CPU, the
    drafter's embedding the target's, autograd off: what the acceptance scripts measure with."""
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target

    torch.set_grad_enabled(False)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    t = load_target(target)
    model = t.build(torch.float32, "cpu")
    return folder, t, model, load_drafter(drafter, "cpu", torch.float32,
                                          embed=model.embed.weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()

    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder

    out, t, model, drafter = cpu_pair(a.target, a.drafter, a.out)
    t0 = time.perf_counter()
    sets = prompt_sets(t, model, a.n, out)
    dec = SpecDecoder(Runtime(model, a.batch, 1024), drafter, a.steps)
    res = {"drafter": a.drafter, "target": a.target, "steps": a.steps, "new_tokens": a.new,
           "device": "cpu, fp32", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "sets": {}}
    for name, prompts in sets.items():
        res["sets"][name] = measure(dec, prompts, a.new, list(t.eos_ids), a.batch)
        print(name, json.dumps(res["sets"][name]), flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_results(res, out, "acceptance", report)


if __name__ == "__main__":
    main()
