"""`draftsmith tune-nccl`: sweep NCCL settings under tensor parallelism, and split a verify
forward's time into compute and communication.

NCCL reads its settings when a process first starts a communicator, so every setting runs in
fresh processes (`dist.spawn`) that inherit it from this process's environment. NVLink multicast
stays off in every setting (`dist.nccl_env`). Each setting times the target's graphed verify
forward at a few (batch, tokens) shapes and the all-reduce at the model's activation shapes;
a setting that NCCL rejects, crashes on or hangs on is recorded as failed and the sweep goes on.

Compute vs communication: the same graphed forward timed with the real TP group and with a twin
whose collectives do nothing (`tp_targets.quiet_twin`); communication = total - compute (it
includes the wait for the slowest rank).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftsmith.bench.allreduce import DTYPES
from draftsmith.dist import (
    UNMET,
    apply_nccl_env,
    check_spawn_device,
    nccl_env,
    nccl_record,
    restored_env,
    spawn,
)
from draftsmith.errors import DraftsmithError
from draftsmith.layers import validate
from draftsmith.models.parallel import TP
from draftsmith.options import at_least_one, check_folder
from draftsmith.tune.partial import differences
from draftsmith.tune.tp_targets import TargetSpec, check_split, quiet_twin

SWEPT = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_P2P_LEVEL")


def dtype_key(dtype: torch.dtype) -> str:
    """DTYPES' name for a torch dtype (what a sweep job carries to its ranks)."""
    return next(k for k, v in DTYPES.items() if v == dtype)
NOISE_PCT = 3.0
PARTIAL = "nccl.partial.json"  # the settings timed so far, while a sweep runs
VERIFY_SEQ = 128  # slots of the timing runtime (more for verifies wider than 64 tokens)
VERIFY_AT = 64  # verify positions start here
GLOO_NOTE = ("backend gloo (no NCCL): the settings were applied and recorded but have no "
             "effect, so these figures cannot choose one")


@dataclass(frozen=True, slots=True)
class NcclSetting:
    name: str
    proto: str | None = None
    algo: str | None = None
    p2p_level: str | None = None

    def env(self) -> dict[str, str]:
        """Validated NCCL_* variables; NCCL_NVLS_ENABLE=0 always."""
        return nccl_env(self.proto, self.algo, self.p2p_level)


DEFAULTS = NcclSetting("defaults")


def grid(kind: str = "full") -> list[NcclSetting]:
    """quick: defaults, each protocol, each algorithm. full adds protocol x algorithm and
    two P2P levels (NVL: peer-to-peer over NVLink only; LOC: never peer-to-peer)."""
    protos, algos = ("LL", "LL128", "Simple"), ("Ring", "Tree")
    out = [DEFAULTS, *(NcclSetting(p, proto=p) for p in protos),
           *(NcclSetting(a, algo=a) for a in algos)]
    if kind == "quick":
        return out
    if kind != "full":
        raise DraftsmithError(f"--grid {kind!r}: use full or quick")
    out += [NcclSetting(f"{p}+{a}", proto=p, algo=a) for p in protos for a in algos]
    return out + [NcclSetting(f"P2P {lv}", p2p_level=lv) for lv in ("NVL", "LOC")]


def env_line(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


@contextlib.contextmanager
def environment(setting: NcclSetting) -> Iterator[dict[str, str]]:
    """This process's environment holds exactly the setting's swept variables (children
    inherit it); restored afterwards."""
    env = setting.env()
    with restored_env((*SWEPT, "NCCL_NVLS_ENABLE")):
        for k in SWEPT:
            os.environ.pop(k, None)
        apply_nccl_env(env)
        yield env


# ---- timing on a rank --------------------------------------------------------------------------

def rank_max(tp: TP, values: list[float]) -> list[float]:
    """Each value's maximum over the TP group: a collective step is as slow as its slowest rank."""
    if tp.size == 1 or not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=tp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.group)
    return t.tolist()


def timed(fn: Callable[[], object], device: torch.device, iters: int, repeats: int
          ) -> tuple[float, float]:
    """(median ms per call over repeats, spread of the repeats in % of the median)."""
    from draftsmith.tune.measure import time_ms

    runs = [time_ms(fn, device, iters) for _ in range(repeats)]
    med = statistics.median(runs)
    return med, 100.0 * (max(runs) - min(runs)) / max(med, 1e-9)


def verify_times(tp: TP, model: Any, shapes: list[tuple[int, int]], aux_ids: tuple[int, ...],
                 iters: int, repeats: int) -> list[dict[str, Any]]:
    """Graphed (on CUDA) verify forwards of n tokens for b rows, with aux capture."""
    from draftsmith.engine.runtime import Runtime

    seq = max(VERIFY_SEQ, VERIFY_AT + max(n for _, n in shapes))
    rt = Runtime(model, max(b for b, _ in shapes), seq)
    for b in sorted({b for b, _ in shapes}):
        rt.capture([b], sorted({n for bb, n in shapes if bb == b}), aux_ids=aux_ids)
    rows = []
    for b, n in shapes:
        tok = torch.zeros(b, n, dtype=torch.long, device=tp.device)
        pos = torch.arange(VERIFY_AT, VERIFY_AT + n, device=tp.device).repeat(b, 1)
        ms, spread = timed(lambda t=tok, p=pos: rt.forward(t, p, aux_ids=aux_ids), tp.device,
                           iters, repeats)
        ms, spread = rank_max(tp, [ms, spread])
        rows.append({"batch": b, "tokens": n, "ms": ms, "spread_pct": spread})
    return rows


def verify_split(tp: TP, model: Any, shapes: list[tuple[int, int]], aux_ids: tuple[int, ...],
                 iters: int, repeats: int = 3) -> list[dict[str, Any]]:
    """Per shape: total ms (real collectives), compute ms (collectives as no-ops, same shapes),
    comm ms = total - compute (not clipped: a small negative value is noise)."""
    total = verify_times(tp, model, shapes, aux_ids, iters, repeats)
    compute = verify_times(tp, quiet_twin(model), shapes, aux_ids, iters, repeats)
    return [{"batch": t["batch"], "tokens": t["tokens"], "total_ms": t["ms"],
             "compute_ms": c["ms"], "comm_ms": t["ms"] - c["ms"],
             "comm_pct": 100.0 * (t["ms"] - c["ms"]) / max(t["ms"], 1e-9)}
            for t, c in zip(total, compute, strict=True)]


def rank_identity(tp: TP) -> dict[str, Any]:
    """What proves a fresh process and the settings it saw."""
    seen = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    backend = dist.get_backend(tp.group) if dist.is_initialized() else "none"
    return {"rank": tp.rank, "pid": os.getpid(), "env": seen, "backend": backend}


def nccl_rank(tp: TP, job: dict[str, Any]) -> dict[str, Any]:
    """One setting on one rank: verify forward times and all-reduce times at the model's shape."""
    from draftsmith.bench.allreduce import measure
    from draftsmith.layers import default_aux_layers

    dtype = DTYPES[job["dtype"]]
    model = TargetSpec(job["target"]).build(tp, dtype)
    cfg = model.cfg
    shapes = [(int(b), int(n)) for b, n in job["shapes"]]
    aux = tuple(job.get("aux") or default_aux_layers(cfg.num_layers))
    with torch.no_grad():
        verify = verify_times(tp, model, shapes, aux, job["iters"], job["repeats"])
    batches, qs = sorted({b for b, _ in shapes}), sorted({n for _, n in shapes})
    ar = measure(tp, cfg.hidden_size, batches, qs, dtype, job["ar_iters"], job["graph_ops"],
                 cfg.num_layers)
    return {**rank_identity(tp), "nccl": nccl_record(), "aux": list(aux), "verify": verify,
            "allreduce": ar}


# ---- the sweep (parent process) ----------------------------------------------------------------

def _short_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return " | ".join(lines[:1] + lines[-2:]) if len(lines) > 3 else " | ".join(lines)


JOIN_TRIES = 2  # launches of a setting whose ranks could not meet (no setting acts before)


def run_setting(setting: NcclSetting, tp_size: int, job: dict[str, Any], device: str,
                rank_fn: Callable[..., dict], timeout_s: float) -> dict[str, Any]:
    """A setting's ranks, launched once more where they failed to meet (a rendezvous or gloo
    mesh cut by another process on the host: not the setting's doing), so such a failure is
    recorded only where it repeats."""
    launches = 0
    while True:
        out, launches = _run_once(setting, tp_size, job, device, rank_fn, timeout_s), launches + 1
        if out["status"] == "ok" or UNMET not in out.get("error", "") or launches == JOIN_TRIES:
            break
    if launches > 1:
        out["launches"] = launches
    return out


def _run_once(setting: NcclSetting, tp_size: int, job: dict[str, Any], device: str,
              rank_fn: Callable[..., dict], timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"setting": setting.name, "status": "failed"}
    try:
        with environment(setting) as env:
            out["env"] = env
            ranks = spawn(rank_fn, tp_size, job, device=device, timeout_s=timeout_s)
    except (DraftsmithError, RuntimeError, OSError) as e:
        out["error"] = _short_error(e)
        return out
    first = ranks[0]
    out.update(status="ok", backend=first.get("backend"),
               ranks=[{k: r.get(k) for k in ("rank", "pid", "env")} for r in ranks],
               **{k: v for k, v in first.items() if k not in ("rank", "pid", "env", "backend")})
    return out


def sweep(settings: list[NcclSetting], tp_size: int, job: dict[str, Any], device: str,
          rank_fn: Callable[..., dict] = nccl_rank, timeout_s: float = 300.0,
          log: Callable[[str], None] = print, deadline: float | None = None,
          done: dict[str, dict[str, Any]] | None = None,
          keep: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every setting in its own fresh processes; failures are recorded and the sweep goes on.
    Settings not started by `deadline` (time.perf_counter) are recorded as skipped. `done`: the
    results a stopped run of this sweep timed, by setting, taken as they are; `keep` is handed
    the results so far after each setting."""
    results: list[dict[str, Any]] = []
    for i, s in enumerate(settings, 1):
        if (old := (done or {}).get(s.name)) is not None and old.get("env") == s.env():
            log(f"[nccl {i}/{len(settings)}] {s.name}: timed before the sweep stopped")
            results.append(old)
            continue
        if deadline is not None and time.perf_counter() > deadline:
            results.append({"setting": s.name, "status": "skipped", "env": s.env(),
                            "error": "time budget spent"})
            continue
        log(f"[nccl {i}/{len(settings)}] {s.name}: {env_line(s.env())}")
        res = run_setting(s, tp_size, job, device, rank_fn, timeout_s)
        if res["status"] != "ok":
            log(f"  failed: {res['error'][:300]}")
        results.append(res)
        if keep is not None:
            keep(results)
    return results


def resumed(path: Path, run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The settings a stopped run of this very sweep timed (`PARTIAL`), by name: those that
    ran (a failure may have been the stop itself, so it runs again). Another sweep's file is
    refused, naming what differs, and left as it is."""
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
        theirs, results = old["run"], old["results"]
        if not isinstance(theirs, dict):
            raise TypeError(f"its run is {type(theirs).__name__}, not an object")
        ok = {r["setting"]: r for r in results if r["status"] == "ok"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DraftsmithError(f"{path}: not a stopped NCCL sweep's timings ({e}); delete it or "
                              "give another --out") from None
    if differ := differences(theirs, json.loads(json.dumps(run, default=str))):
        raise DraftsmithError(f"{path} holds what another NCCL sweep timed before it stopped ("
                              + "; ".join(differ) + "): rerun that sweep to resume it, or "
                              "delete the file or give another --out")
    return ok


# ---- recommendation ----------------------------------------------------------------------------

def _times(res: dict[str, Any]) -> dict[tuple[int, int], tuple[float, float]]:
    return {(v["batch"], v["tokens"]): (v["ms"], v.get("spread_pct", 0.0)) for v in res["verify"]}


def _choice(name: str, env: dict[str, str], gain: float | None, margin: float, best: str
            ) -> dict[str, Any]:
    return {"choice": name, "env_line": env_line(env), "best": best,
            "gain_pct": gain, "margin_pct": margin}


def _pick(ok: list[dict], base: dict | None, key: Callable[[dict], tuple[float, float] | None],
          noise_pct: float) -> dict[str, Any]:
    """The fastest setting by key (ms, spread), unless it beats defaults by no more than noise."""
    scored = [(r, v) for r in ok if (v := key(r)) is not None]
    best, (best_ms, best_spread) = min(scored, key=lambda rv: rv[1][0])
    base_v = key(base) if base is not None else None
    if base_v is None:
        return _choice(best["setting"], best["env"], None, noise_pct, best["setting"])
    gain = 100.0 * (base_v[0] - best_ms) / base_v[0]
    margin = max(noise_pct, base_v[1] + best_spread)
    won = best is not base and gain > margin
    pick = best if won else base
    return _choice(pick["setting"], pick["env"], gain, margin, best["setting"])


def _overall(shapes: list[tuple[int, int]], base: dict | None
             ) -> Callable[[dict], tuple[float, float] | None]:
    """A setting's geometric-mean time relative to defaults over `shapes` (defaults = 1), which
    defaults must all have timed; None for a setting that missed one."""
    ref = _times(base) if base is not None else None

    def key(r: dict) -> tuple[float, float] | None:
        t = _times(r)
        if any(s not in t for s in shapes):
            return None
        scale = [ref[s][0] if ref else 1.0 for s in shapes]
        ratio = math.exp(statistics.fmean(math.log(t[s][0] / d) for s, d in
                                          zip(shapes, scale, strict=True)))
        return ratio, statistics.fmean(t[s][1] for s in shapes)

    return key


def recommend(results: list[dict[str, Any]], noise_pct: float = NOISE_PCT) -> dict[str, Any]:
    """Per shape and overall: the fastest setting, or defaults when nothing beats them by more
    than max(noise_pct, the two settings' run-to-run spreads)."""
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return {"per_shape": [], "overall": None, "note": _none_timed(results)}
    base = next((r for r in ok if r["setting"] == DEFAULTS.name), None)
    shapes = list(dict.fromkeys(s for r in ok for s in _times(r)))  # any setting's, in order
    per_shape = []
    for s in shapes:
        pick = _pick(ok, base, lambda r, s=s: _times(r).get(s), noise_pct)
        per_shape.append({"batch": s[0], "tokens": s[1], **pick})
    # overall: over the shapes the reference (defaults, else the first to succeed) timed
    ref = list(_times(base if base is not None else ok[0]))
    out: dict[str, Any] = {"per_shape": per_shape,
                           "overall": _pick(ok, base, _overall(ref, base), noise_pct)
                           if ref else None}
    notes = [] if base is not None else [
        f"the defaults {_unmet(results)}: the fastest setting is shown without a comparison"]
    if skipped := _skipped(results):
        notes.append(f"{skipped}, not compared")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def _unmet(results: list[dict[str, Any]]) -> str:
    """What became of the defaults, which have no timings."""
    status = next((r["status"] for r in results if r["setting"] == DEFAULTS.name), None)
    return {None: "were not swept", "skipped": "were skipped"}.get(status, "failed")


def _skipped(results: list[dict[str, Any]]) -> str:
    """How many settings were skipped and why ("" for none)."""
    skipped = [r for r in results if r["status"] == "skipped"]
    why = "; ".join(dict.fromkeys(str(r.get("error") or "no reason recorded") for r in skipped))
    return f"{len(skipped)} of {len(results)} settings skipped ({why})" if skipped else ""


def _none_timed(results: list[dict[str, Any]]) -> str:
    """Why no setting has timings: failed, skipped (and why), or none swept."""
    failed = sum(r["status"] not in ("ok", "skipped") for r in results)
    if not results:
        return "no setting was swept"
    if not failed:
        return f"no setting was timed: {_skipped(results)}"
    if failed == len(results):
        return "every setting failed"
    return f"no setting was timed: {failed} failed, {_skipped(results)}"


# ---- report ------------------------------------------------------------------------------------

def _shape_name(b: int, n: int) -> str:
    return f"b{b} n{n}"


def markdown(report: dict[str, Any]) -> str:
    res = report["results"]
    shapes = report["shapes"]
    head = "| setting | status | " + " | ".join(
        f"verify {_shape_name(b, n)} ms" for b, n in shapes) + " | all-reduce us (b, q) |"
    lines = [f"NCCL sweep: TP {report['tp']}, {report['target_label']}, {report['device']}, "
             f"backend {report['backend']}", "", head,
             "|" + "---|" * (len(shapes) + 3)]
    for r in res:
        t = _times(r) if r["status"] == "ok" else {}
        cells = [f"{t[(b, n)][0]:.3f}" if (b, n) in t else "-" for b, n in shapes]
        ar = ", ".join(f"{a['batch']}x{a['q']}: {a['graph_us'] or a['eager_us']}"
                       for a in r.get("allreduce", []))
        status = status_text(r, 80)
        lines.append(f"| {r['setting']} | {status} | " + " | ".join(cells) + f" | {ar} |")
    lines += ["", *recommendation_lines(report)]
    return "\n".join(lines) + "\n"


def status_text(r: dict[str, Any], width: int = 60) -> str:
    """A setting's status with the reason it failed or was skipped, on one line of at most
    about `width` characters (nccl.json keeps the whole error)."""
    why = " ".join(str(r.get("error") or "").split())
    if r["status"] == "ok" or not why:
        return str(r["status"])
    return f"{r['status']}: {why if len(why) <= width else why[: width - 3] + '...'}"


def recommendation_lines(report: dict[str, Any]) -> list[str]:
    rec = report["recommendation"]
    lines = [f"Note: {n}" for n in report.get("notes", [])]
    if rec.get("note"):
        lines.append(f"Note: {rec['note']}")
    for p in rec["per_shape"]:
        lines.append(f"- {_shape_name(p['batch'], p['tokens'])}: {_verdict(p)}")
    if rec["overall"]:
        lines += [f"- overall (geometric mean over shapes): {_verdict(rec['overall'])}",
                  f"- environment to use: `{rec['overall']['env_line']}`"]
    return lines


def _verdict(p: dict[str, Any]) -> str:
    gain = p["gain_pct"]
    if gain is None:
        return f"{p['choice']} (no defaults to compare)"
    if p["best"] == DEFAULTS.name:
        return "defaults (the fastest setting)"
    if p["choice"] == DEFAULTS.name:
        return (f"defaults (fastest: {p['best']}, {gain:+.1f} % vs defaults, within noise "
                f"{p['margin_pct']:.1f} %)")
    return f"{p['choice']}: {gain:+.1f} % faster than defaults (noise {p['margin_pct']:.1f} %)"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    shapes = report["shapes"]
    # paths, settings and errors as text: rich markup dropped a checkpoint's `[v2]` and raised on
    # a `[/x]`, after nccl.json was written
    table = Table(title=Text(f"NCCL sweep, TP {report['tp']}, {report['target_label']}, "
                             f"{report['device']} (verify ms, graphed)"))
    for c in ("setting", "status", *(_shape_name(b, n) for b, n in shapes)):
        table.add_column(c, justify="left" if c == "status" else "right")
    for r in report["results"]:
        t = _times(r) if r["status"] == "ok" else {}
        table.add_row(Text(str(r["setting"])), Text(status_text(r)),
                      *(f"{t[s][0]:.3f}" if s in t else "-" for s in map(tuple, shapes)))
    console = Console()
    console.print(table)
    for line in recommendation_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # pasted whole


def job_for(target: str, shapes: list[tuple[int, int]], dtype: str, iters: int,
            repeats: int = 3, ar_iters: int = 50, graph_ops: int = 32,
            aux: list[int] | None = None) -> dict[str, Any]:
    """What each rank of a setting runs; `aux`, the layers the verify captures (a drafter's;
    None: EAGLE-3's usual three)."""
    if dtype not in DTYPES:
        raise DraftsmithError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return {"target": target, "shapes": [list(s) for s in shapes], "dtype": dtype,
            "iters": iters, "repeats": repeats, "ar_iters": ar_iters, "graph_ops": graph_ops,
            "aux": None if aux is None else [int(i) for i in aux]}


def run_nccl_sweep(tp_size: int, target: str, settings: list[NcclSetting],
                   shapes: list[tuple[int, int]], device: str, dtype: str, iters: int,
                   noise_pct: float = NOISE_PCT, timeout_s: float = 300.0,
                   out: Path | None = None, log: Callable[[str], None] = print,
                   rank_fn: Callable[..., dict] = nccl_rank, deadline: float | None = None,
                   aux: list[int] | None = None, replace_other: bool = False) -> dict[str, Any]:
    """The whole sweep; writes nccl.json and nccl.md into out when given. `aux`: the aux
    layers the verifies capture (`tune --nccl-sweep`: its drafter's). `replace_other`: a
    stopped sweep's file of other shapes or target in `out` is dropped, not refused (tune's
    out/nccl, which tune owns: an earlier tune's sweep)."""
    at_least_one({"--tp": tp_size, "--iters": iters})
    if not (timeout_s > 0 and 0 <= noise_pct < math.inf):
        raise DraftsmithError(f"--timeout must be > 0 and --noise-pct >= 0, got {timeout_s} and "
                              f"{noise_pct}")
    shapes = list(dict.fromkeys((int(b), int(n)) for b, n in shapes))  # each timed once
    if out is not None:  # before the sweep, not after it
        check_folder(out, "--out")
    check_spawn_device(device, tp_size)  # else every setting fails on it, each recorded so
    spec = TargetSpec(target)
    cfg = spec.config()
    why = check_split(cfg, tp_size)
    if why:
        raise DraftsmithError(f"target {spec.label} cannot run at TP {tp_size}: {why}")
    if aux is not None:
        validate(list(aux), cfg.num_layers)
    job = job_for(target, shapes, dtype, iters, aux=aux)
    done, keep, partial = {}, None, None
    if out is not None:  # what is timed so far, kept as it goes: a stopped sweep resumes
        from draftsmith.data.atomic import atomic_write, make_folder

        gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
        run = {"tp": tp_size, "target": target, "device": device, "gpu": gpu, "job": job}
        partial = make_folder(out) / PARTIAL
        try:
            done = resumed(partial, run)
        except DraftsmithError:
            if not replace_other:
                raise
            log(f"dropping {partial}: an earlier tune's stopped sweep, of other verify shapes")
            partial.unlink()
            done = {}
        if done:
            log(f"resuming from {partial}: the {len(done)} settings it timed are not timed again")

        def keep(results: list[dict[str, Any]]) -> None:
            atomic_write(partial, json.dumps({"status": "partial: the sweep stopped before "
                                              "nccl.json", "run": run, "results": results},
                                             indent=1, default=str).encode(),
                         "the timings it held before are kept")

    results = sweep(settings, tp_size, job, device, rank_fn, timeout_s, log, deadline, done, keep)
    backends = {r.get("backend") for r in results if r["status"] == "ok"}
    backend = (backends.pop() if len(backends) == 1 else ",".join(sorted(map(str, backends)))
               ) or "none (no setting ran)"
    notes = [GLOO_NOTE] if backend == "gloo" else []
    if tp_size == 1:
        notes.append("TP 1 runs no collective: NCCL settings cannot matter here")
    report = {"bench": "tune-nccl", "tp": tp_size, "target": target, "target_label": spec.label,
              "device": device, "backend": backend, "shapes": [list(s) for s in shapes],
              "noise_pct": noise_pct, "notes": notes, "job": job, "results": results,
              "recommendation": recommend(results, noise_pct)}
    if out is not None:
        from draftsmith.bench.cli import say_replaced
        from draftsmith.data.atomic import atomic_write, make_folder

        make_folder(out)
        say_replaced(out / "nccl.json", log)  # a sweep rerun into its folder: said, not refused
        kept = "the sweep there before is unchanged"
        atomic_write(out / "nccl.json", json.dumps(report, indent=1, default=str).encode(), kept)
        atomic_write(out / "nccl.md", markdown(report).encode(), kept)
    if partial is not None:
        partial.unlink(missing_ok=True)  # nccl.json holds it all
    return report
