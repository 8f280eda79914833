"""Tensor-parallel figures (issue 10): baseline and speculative tokens/s at TP 1 and 2, the
verify forward split into compute and all-reduce, the step sweep per TP size from the tune cost
model, and the NCCL settings sweep of `draftsmith tune-nccl` at TP 2.

GPUs (2 for TP 2):  PYTHONPATH=src python3 benchmarks/tp_bench.py --out $OUT/tp
CPU smoke (gloo):   PYTHONPATH=src python3 benchmarks/tp_bench.py --tiny --out /tmp/tp

Targets: the default (SmolLM2-135M, TP 1 only: 9 heads / 3 kv heads split at TP 3, not 2) and a
random-weight Llama of the 8B shape built shard by shard on each GPU (timing only). The drafter
is random (timing only; its acceptance is ~0), replicated on every rank as under TP. The step
sweep applies an acceptance profile read from a tune.json (or a fixed, labelled one) to the
costs measured at each TP size. Every (target, TP) runs in fresh spawned processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.dist import nccl_record, spawn
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP
from draftsmith.tune import nccl
from draftsmith.tune.cost_model import Acceptance, CostTable, SpecSetting, predict
from draftsmith.tune.tp_targets import TargetSpec, check_split

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ACCEPTANCE = ROOT / "benchmarks" / "tune_default_h200_run2" / "tune.json"
FIXED_CHAIN = (0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35)
MAX_STEPS = 7
SPEC_STEPS = 3
PROMPT_LEN = 16


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- one (target, TP size) on one rank ---------------------------------------------------------

def _prompts(b: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(PROMPT_LEN)] for i in range(b)]


def decode_row(rt: Any, rows: list[list[int]], new: int) -> dict[str, Any]:
    """Baseline graphed decode, fixed length (no EOS), prefill left out."""
    from draftsmith.engine.generate import run_generation
    from draftsmith.tune.measure import decode_rate

    run_generation(rt, rows, 8, eos_ids=[])
    g = run_generation(rt, rows, new, eos_ids=[])
    return {"batch": len(rows), "new": new, "decode_ms": g.decode_s / (new - 1) * 1e3,
            "tok_s": decode_rate(g.new_tokens, len(rows), g.decode_s)}


def spec_row(eng: Any, rows: list[list[int]], new: int) -> dict[str, Any]:
    """Speculative tokens/s with the random drafter: a machinery check (acceptance ~0)."""
    from draftsmith.tune.measure import run_setting

    m = run_setting(eng, SpecSetting(SPEC_STEPS), rows, len(rows), new, [])
    return {"batch": len(rows), "steps": SPEC_STEPS, "tok_s": m.tokens_per_s,
            "accept_length": m.accept_length, "phases_ms": dict(m.phases or {}),
            "label": "random drafter: machinery check, acceptance ~0"}


def bench_rank(tp: TP, job: dict[str, Any]) -> dict[str, Any]:
    from draftsmith.bench.allreduce import measure as allreduce
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.layers import default_aux_layers
    from draftsmith.tune.measure import Engine, drafter_costs
    from draftsmith.tune.tp_targets import random_drafter_on

    dtype = nccl.DTYPES[job["dtype"]]
    batches, new = job["batches"], job["new"]
    t0 = time.perf_counter()
    model = TargetSpec(job["target"]).build(tp, dtype)
    cfg = model.cfg
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, **nccl.rank_identity(tp)}
    seq = PROMPT_LEN + new + 64 + 40
    rt = Runtime(model, max(batches), seq)
    with torch.no_grad():
        out["decode"] = [decode_row(rt, _prompts(b, cfg.vocab_size), new) for b in batches]
        aux = tuple(default_aux_layers(cfg.num_layers))
        shapes = [(b, n) for b in batches for n in job["ns"]]
        out["verify"] = nccl.verify_split(tp, model, shapes, aux, job["iters"], job["repeats"])
    drafter = random_drafter_on(cfg, tp.device, dtype)
    drt = DrafterRuntime(drafter, max(batches), seq + 64 * MAX_STEPS, rt.graphs or False)
    eng = Engine(rt, drt, drafter)
    out["draft"] = drafter_costs(eng, [(b, q) for b in batches for q in range(1, 9)])
    if tp.size > 1:
        out["allreduce"] = allreduce(tp, cfg.hidden_size, batches, [1, 4, 8, 16], dtype,
                                     job["ar_iters"], 32, cfg.num_layers)
    out["nccl"] = nccl_record()
    try:  # last, so a failure here keeps every figure above
        out["spec"] = [spec_row(eng, _prompts(b, cfg.vocab_size), new) for b in batches]
    except (DraftsmithError, RuntimeError) as e:
        out["spec"], out["spec_error"] = [], str(e)[-1000:]
    return out


# ---- the parent: runs, step sweep, report ------------------------------------------------------

def load_acceptance(path: Path | None) -> tuple[Acceptance, str]:
    if path is not None and path.is_file():
        chain = json.loads(path.read_text())["acceptance"]["chain"]
        return Acceptance(chain=tuple(chain)), (
            f"measured per-position chain acceptance from {path.name} ({_rel(path)}), applied "
            "to every target as an assumed profile")
    return Acceptance(chain=FIXED_CHAIN), (
        f"FIXED illustrative profile {list(FIXED_CHAIN)} (no tune.json given): not measured")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def plan(tiny: bool, gpus: int) -> list[tuple[str, int]]:
    if tiny:
        return [("tiny", 1), ("tiny", 2)]
    runs = [("default", 1), ("random-8b", 1)]
    return runs + ([("random-8b", 2)] if gpus >= 2 else [])


def why_not(target: str, tp: int) -> str | None:
    """A reason this (target, TP) cannot run here, or None."""
    try:
        cfg = TargetSpec(target).config()
    except DraftsmithError as e:
        return f"target unavailable: {e}"
    return check_split(cfg, tp)


def run_one(target: str, tp: int, job: dict[str, Any], device: str) -> dict[str, Any]:
    head = {"target": target, "label": TargetSpec(target).label, "tp": tp}
    why = why_not(target, tp)
    if why:
        log(f"[tp_bench] {target} TP {tp}: skipped ({why})")
        return {**head, "status": "skipped", "reason": why}
    log(f"[tp_bench] {target} TP {tp}: measuring ...")
    t0 = time.perf_counter()
    try:
        res = spawn(bench_rank, tp, {**job, "target": target}, device=device, timeout_s=240)[0]
    except (DraftsmithError, RuntimeError) as e:
        log(f"[tp_bench] {target} TP {tp}: failed: {e}")
        return {**head, "status": "failed", "error": str(e)[-2000:]}
    log(f"[tp_bench] {target} TP {tp}: done in {time.perf_counter() - t0:.0f} s")
    return {**head, "status": "ok", **res}


def cost_table(run: dict[str, Any], batch: int, comm: bool = True) -> CostTable:
    """The tune cost model's table from one run; comm False drops the all-reduce (verify's
    measured comm, and from a decode step the comm share of a 1-token verify)."""
    key = "total_ms" if comm else "compute_ms"
    verify = {v["tokens"]: v[key] for v in run["verify"] if v["batch"] == batch}
    dec = next(d["decode_ms"] for d in run["decode"] if d["batch"] == batch)
    if not comm:  # a decode step loses the share of time a 1-token verify spends communicating
        one = next(v for v in run["verify"] if v["batch"] == batch and v["tokens"] == 1)
        dec *= min(1.0, one["compute_ms"] / max(one["total_ms"], 1e-9))
    draft = {int(q): ms for q, ms in run["draft"][batch].items()}
    spec = next((s for s in run["spec"] if s["batch"] == batch), {"phases_ms": {}})
    return CostTable(verify={batch: verify}, draft_step={batch: {1: draft[1]}},
                     extend={batch: {n: ms for n, ms in draft.items() if n >= 2}},
                     overhead={batch: spec["phases_ms"].get("accept", 0.0)},
                     decode={batch: max(dec, 1e-6)})


def step_curve(costs: CostTable, acc: Acceptance, batch: int) -> dict[str, Any]:
    """Predicted tokens/s for no speculation (steps 0) and chains of 1..MAX_STEPS steps."""
    settings = [SpecSetting.baseline(), *(SpecSetting(s) for s in range(1, MAX_STEPS + 1))]
    tps = {s.steps: predict(costs, acc, s, batch).tokens_per_s for s in settings}
    best = max(tps, key=lambda s: (tps[s], -s))
    return {"tok_s": tps, "best_steps": best}


def step_sweep(runs: list[dict[str, Any]], acc: Acceptance) -> list[dict[str, Any]]:
    rows = []
    for r in (r for r in runs if r["status"] == "ok"):
        for b in sorted(r["draft"]):
            rows.append({"target": r["target"], "tp": r["tp"], "batch": b, "comm": True,
                         **step_curve(cost_table(r, b), acc, b)})
            if r["tp"] > 1:
                rows.append({"target": r["target"], "tp": r["tp"], "batch": b, "comm": False,
                             **step_curve(cost_table(r, b, comm=False), acc, b)})
    return rows


def answer(sweep_rows: list[dict[str, Any]]) -> list[str]:
    """Does the best number of steps move as communication grows? One line per target/batch."""
    lines = []
    keys = sorted({(r["target"], r["batch"]) for r in sweep_rows})
    for target, b in keys:
        rows = [r for r in sweep_rows if r["target"] == target and r["batch"] == b]
        real = {r["tp"]: r["best_steps"] for r in rows if r["comm"]}
        quiet = {r["tp"]: r["best_steps"] for r in rows if not r["comm"]}
        if len(real) < 2:
            continue
        parts = [f"TP {t}: {s}" for t, s in sorted(real.items())]
        parts += [f"TP {t} without all-reduce: {s}" for t, s in sorted(quiet.items())]
        moved = "moves" if len(set(real.values())) > 1 else "does not move"
        lines.append(f"{target}, batch {b}: best steps {', '.join(parts)} -> {moved}")
    return lines or ["only one TP size was measured: no comparison"]


# ---- output ------------------------------------------------------------------------------------

def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _ok(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["runs"] if r["status"] == "ok"]


def markdown(report: dict[str, Any]) -> str:
    out = [f"# TP benchmark ({report['device']}, {report['date']})", "",
           f"Command: `{report['command']}`", "", *(f"- {n}" for n in report["notes"]), ""]
    for r in report["runs"]:
        if r["status"] != "ok":
            out.append(f"- {r['label']} at TP {r['tp']}: {r['status']} "
                       f"({r.get('reason') or r.get('error', '')[-300:]})")
    out += ["", "## Baseline and speculative tokens/s (decode phase, fixed length)", "",
            "| target | TP | batch | decode ms/step | baseline tok/s | spec tok/s (steps 3, "
            "random drafter) | accept length |", "|---|---|---|---|---|---|---|"]
    for r in _ok(report):
        spec = {s["batch"]: s for s in r["spec"]}
        for d in r["decode"]:
            s = spec.get(d["batch"], {})
            out.append(f"| {r['label']} | {r['tp']} | {d['batch']} | {_f(d['decode_ms'], 3)} | "
                       f"{_f(d['tok_s'], 1)} | {_f(s.get('tok_s'), 1)} | "
                       f"{_f(s.get('accept_length'))} |")
        if r.get("spec_error"):
            out.append(f"| {r['label']} | {r['tp']} | - | speculative run failed: "
                       f"{r['spec_error'][-200:]} | | | |")
    out += ["", "## Verify forward: compute vs all-reduce (graphed, ms)", "",
            "| target | TP | batch | tokens | total | compute | comm | comm % |",
            "|---|---|---|---|---|---|---|---|"]
    for r in _ok(report):
        for v in r["verify"]:
            out.append(f"| {r['label']} | {r['tp']} | {v['batch']} | {v['tokens']} | "
                       f"{_f(v['total_ms'], 3)} | {_f(v['compute_ms'], 3)} | "
                       f"{_f(v['comm_ms'], 3)} | {_f(v['comm_pct'], 1)} |")
    out += ["", "## Draft step (random drafter, replicated on every rank, ms)", "",
            "| target | TP | batch | step (1 token) | extend 4 | extend 8 |",
            "|---|---|---|---|---|---|"]
    for r in _ok(report):
        for b, row in sorted(r["draft"].items()):
            row = {int(k): v for k, v in row.items()}
            out.append(f"| {r['label']} | {r['tp']} | {b} | {_f(row[1], 3)} | "
                       f"{_f(row.get(4), 3)} | {_f(row.get(8), 3)} |")
    out += _sweep_md(report) + ["", "## NCCL settings sweep (TP 2)", ""]
    out.append(nccl.markdown(report["nccl_sweep"]) if report.get("nccl_sweep")
               else report.get("nccl_sweep_note", "not run"))
    return "\n".join(out) + "\n"


def _sweep_md(report: dict[str, Any]) -> list[str]:
    steps = list(range(MAX_STEPS + 1))
    out = ["", "## Step sweep (tune cost model on the measured costs; predicted tok/s)", "",
           f"Acceptance: {report['acceptance_source']}.", "",
           "| target | TP | batch | all-reduce | " + " | ".join(f"steps {s}" for s in steps)
           + " | best |", "|" + "---|" * (len(steps) + 5)]
    for r in report["step_sweep"]:
        tps = {int(k): v for k, v in r["tok_s"].items()}
        out.append(f"| {r['target']} | {r['tp']} | {r['batch']} | "
                   f"{'yes' if r['comm'] else 'removed'} | "
                   + " | ".join(_f(tps[s], 0) for s in steps) + f" | {r['best_steps']} |")
    out += ["", "Does the best number of steps move as communication grows?", ""]
    return out + [f"- {line}" for line in report["answer"]]


def plot(path: Path, report: dict[str, Any]) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["target"], r["batch"]) for r in report["step_sweep"]})
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (target, b) in zip(axes[0], panels, strict=True):
        for r in report["step_sweep"]:
            if (r["target"], r["batch"]) == (target, b):
                pts = sorted((int(k), v) for k, v in r["tok_s"].items())
                name = f"TP {r['tp']}" + ("" if r["comm"] else " without all-reduce")
                ax.plot([p[0] for p in pts], [p[1] for p in pts],
                        "-o" if r["comm"] else ":x", label=name)
        ax.set_title(f"{target}, batch {b}", fontsize=9)
        ax.set_xlabel("chain steps (0 = no speculation)")
        ax.set_ylabel("predicted tokens/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main --------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a small random Llama on CPU (gloo)")
    p.add_argument("--acceptance", type=Path,
                   default=DEFAULT_ACCEPTANCE if DEFAULT_ACCEPTANCE.is_file() else None,
                   help="tune.json whose acceptance.chain is used for the step sweep")
    p.add_argument("--new", type=int, default=None, help="new tokens per row (128; tiny 16)")
    p.add_argument("--no-sweep", action="store_true", help="skip the NCCL sweep")
    p.add_argument("--grid", default="quick", help="NCCL grid: quick (6 settings) or full")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="NCCL settings not started by then are recorded as skipped")
    return p.parse_args(argv)


def job_for(args: argparse.Namespace) -> dict[str, Any]:
    if args.tiny:
        return {"dtype": "fp32", "batches": [1, 8], "new": args.new or 16, "ns": [1, 2, 4, 8],
                "iters": 2, "repeats": 2, "ar_iters": 3}
    return {"dtype": "bf16", "batches": [1, 8], "new": args.new or 128,
            "ns": [1, 2, 3, 4, 5, 6, 7, 8, 12, 16], "iters": 10, "repeats": 3, "ar_iters": 50}


def nccl_sweep(args: argparse.Namespace, device: str, tps: list[int], deadline: float
               ) -> dict[str, Any] | None:
    if args.no_sweep or 2 not in tps:
        return None
    target = "tiny" if args.tiny else "random-8b"
    settings = nccl.grid(args.grid)[: 2 if args.tiny else None]
    shapes = [(b, n) for b in (1, 8) for n in ((1, 4) if args.tiny else (1, 4, 8))]
    log(f"[tp_bench] NCCL sweep at TP 2 on {target}: {len(settings)} settings")
    return nccl.run_nccl_sweep(2, target, settings, shapes, device,
                               "fp32" if args.tiny else "bf16", 2 if args.tiny else 20,
                               timeout_s=150, out=args.out / "nccl", log=log,
                               deadline=deadline)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    start = time.perf_counter()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("tp_bench: no CUDA device; use --tiny for the CPU smoke run")
    device = "cpu" if args.tiny else "cuda"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    runs_plan = plan(args.tiny, gpus)
    job = job_for(args)
    runs = [run_one(t, n, job, device) for t, n in runs_plan]
    acc, acc_src = load_acceptance(args.acceptance)
    sweep_rows = step_sweep(runs, acc)
    notes = ["random-weight targets and the random drafter: timing only (outputs meaningless)",
             "speculative tok/s uses a random drafter (acceptance ~0): a machinery check, not a "
             "speedup figure; the step sweep's predictions use the acceptance profile below",
             "comm = verify with real collectives - the same forward with no-op collectives "
             "(same shapes); it includes waiting for the slower rank. At TP 1 both runs execute "
             "the same code, so their difference is the noise floor"]
    if device == "cpu":
        notes.append(nccl.GLOO_NOTE)
    if gpus == 1:
        notes.append("one GPU visible: TP 2 not run")
    report: dict[str, Any] = {
        "bench": "tp_bench", "device": _device(device, gpus), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "job": job,
        "notes": notes, "acceptance": acc.to_dict(), "acceptance_source": acc_src,
        "runs": runs, "step_sweep": sweep_rows, "answer": answer(sweep_rows)}
    report["wall_s"] = time.perf_counter() - start
    write(args.out, report)  # a sweep that outlives the device call still leaves these
    try:
        report["nccl_sweep"] = nccl_sweep(args, device, [n for _, n in runs_plan],
                                          start + args.budget_s)
    except DraftsmithError as e:
        report["nccl_sweep"], report["nccl_sweep_note"] = None, f"not run: {e}"
    report["wall_s"] = time.perf_counter() - start
    write(args.out, report)
    return report


def _device(device: str, gpus: int) -> str:
    if device == "cpu":
        return f"cpu ({os.cpu_count()} cores, gloo)"
    return f"{gpus} x {torch.cuda.get_device_name(0)}"


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_bench.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "tp_bench.md").write_text(markdown(report))
    drew = plot(out / "tp_steps.png", report)
    log(f"[tp_bench] wrote {out}/tp_bench.json, tp_bench.md" + (", tp_steps.png" if drew else "")
        + f" in {report['wall_s']:.0f} s")
    for line in report["answer"]:
        log(f"[tp_bench] {line}")


if __name__ == "__main__":
    main()
