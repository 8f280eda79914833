"""`draftsmith serve` under concurrent load: continuous batching against static batches, and
speculative against baseline decoding when a drafter is given.

Usage: python benchmarks/serve_bench.py [--target default] [--device cpu] [--requests 24]
       [--max-batch 8] [--rounds 2] [--lengths 16,96,32,64,24,80,48,8]
       [--drafter DIR [--steps 3 --topk 1 --num-draft-tokens N]] [--compile] [--fixed-rows]
       [--temperatures 0] [--frontends 0[,4]] [--out DIR]
Starts the real server (uvicorn, in this process) on the baseline engine (and, with --drafter,
on a speculative engine too), with `--static-batches` behaviour and continuous, in turn for
`--rounds` rounds (the order alternating). A separate process (so the clients never hold this
one's GIL) sends the same requests at once through the real `openai` client (AsyncOpenAI):
chat suite prompts, max_tokens cycling through --lengths so answers end apart, temperature
cycling through --temperatures (default greedy; several: a mix of settings that a server must
batch together or drain between). Reports
wall time, completion tokens/s, per-request latency (mean, p50, p90), batches, joined rows and
the share of the wall time the server's batch loop ran. Greedy alone: every run must return the same
texts (checked; `text_diffs` lists the requests that differ). Compiled in bf16, a request whose
batch opened with fewer rows decodes with other kernels (the one-row pin, linears as reductions
up to 2 rows, the small attention up to 16) and may part at a near-tie (`serve_invariance.py`,
`serve_h200.md`: measured for 1 against 32 rows): reported, not an error. With `--fixed-rows`
every batch has one row count, so a difference is an error again.
Writes serve_bench.json and serve_bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from draftsmith.bench.suites import suite_messages  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, load_engine  # noqa: E402

LENGTHS = (16, 96, 32, 64, 24, 80, 48, 8)


@dataclass
class Served:
    """A running server: its URL and model id, the frontend processes' pids (their CPU time
    counts as the server's) and how to stop it."""

    url: str
    model: str
    stop: Callable[[], None]
    pids: tuple[int, ...] = ()

    def cpu_s(self) -> float:
        """CPU seconds of this process and the live frontends (Linux /proc)."""
        tick, total = os.sysconf("SC_CLK_TCK"), time.process_time()
        for pid in self.pids:
            with contextlib.suppress(OSError):
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / tick  # utime, stime
        return total


def serve(engine, target: str, continuous: bool, frontends: int = 0) -> Served:
    """The real server on a free port: in this process, or with `frontends` HTTP processes
    (`serve --frontends`)."""
    import uvicorn

    from draftsmith.serve.app import create_app

    cfg = server_config(engine, target, None, None, 4096, continuous=continuous)
    if frontends:
        from draftsmith.serve.frontends import Frontends

        fe = Frontends(engine, cfg, frontends).start()
        return Served(fe.url, cfg.model_name, fe.stop, tuple(p.pid for p in fe.procs))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, cfg), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        time.sleep(0.5)

    return Served(f"http://127.0.0.1:{port}", cfg.model_name, stop)


def load(url: str, model: str, jobs: list[tuple[str, int, float]]) -> dict:
    """Send every job at once (in a client process); each request's text, tokens and latency,
    and the process's own CPU time and wall clock span."""
    import httpx
    import openai

    async def run() -> list[tuple[str, int, float]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                    timeout=1800,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=len(jobs))))

        async def one(job: tuple[str, int, float]) -> tuple[str, int, float]:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": job[0]}],
                max_tokens=job[1], temperature=job[2])
            return (r.choices[0].message.content, r.usage.completion_tokens,
                    time.perf_counter() - t0)

        return await asyncio.gather(*(one(j) for j in jobs))

    cpu0, t0 = time.process_time(), time.time()
    got = asyncio.run(run())
    return {"got": got, "start": t0, "end": time.time(), "cpu_s": time.process_time() - cpu0}


class Clients:
    """`n` client processes that send a run's requests together, dealt round-robin: one Python
    client tops out near one core (on the 2-core CPU machine its `openai` client took 0.7-0.9
    of a core at ~5,000 tok/s), which would cap what the server is seen to deliver."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()

    def warm(self, srv: Served, jobs: list[tuple[str, int, float]], first: int = 1) -> None:
        """Start every process and import the client there, sending the `first` jobs (untimed:
        one a setting, so a setting's first-use costs fall here)."""
        for f in [self.pool.submit(load, srv.url, srv.model, jobs[:first])
                  for _ in range(self.n)]:
            f.result()

    def load(self, srv: Served, jobs: list[tuple[str, int, float]]) -> dict:
        import httpx

        parts = [jobs[k :: self.n] for k in range(self.n)]
        before = httpx.get(srv.url + "/metrics").json()
        cpu0 = srv.cpu_s()
        outs = [f.result() for f in [self.pool.submit(load, srv.url, srv.model, p)
                                     for p in parts]]
        server_cpu = srv.cpu_s() - cpu0
        after = httpx.get(srv.url + "/metrics").json()
        got: list = [None] * len(jobs)
        for k, o in enumerate(outs):
            got[k :: self.n] = o["got"]
        wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        lat = sorted(g[2] for g in got)
        tokens = sum(g[1] for g in got)
        busy = after["engine_busy_s"] - before["engine_busy_s"]
        return {"wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
                "latency_mean_s": statistics.fmean(lat), "latency_p50_s": lat[len(lat) // 2],
                "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
                "batches": after["batches"] - before["batches"],
                "joined_rows": after["joined_rows"] - before["joined_rows"],
                "loop_busy_s": busy, "loop_share": busy / wall, "clients": self.n,
                "server_cpu_s": server_cpu, "client_cpu_s": sum(o["cpu_s"] for o in outs),
                "texts": [g[0] for g in got], "latencies_s": [g[2] for g in got]}


def servers(engines: dict, frontends: list[int]) -> dict[str, tuple[Any, int]]:
    """Each engine with each count of frontend processes, by name ("baseline", or "baseline
    f4" where several counts are compared)."""
    return {name if len(frontends) == 1 else f"{name} f{k}": (engine, k)
            for name, engine in engines.items() for k in frontends}


def rounds(engines: dict[str, tuple[Any, int]], target: str, jobs: list, n: int,
           clients: Clients) -> dict:
    """Each server (`servers`) in both modes, `n` rounds, the order of the modes alternating."""
    runs: dict[str, dict] = {}
    for i in range(n):
        modes = [("static", False), ("continuous", True)]
        for name, (engine, frontends) in engines.items():
            for mode, continuous in modes if i % 2 == 0 else modes[::-1]:
                srv = serve(engine, target, continuous, frontends)
                r = runs[f"{name} {mode} {i + 1}"] = clients.load(srv, jobs)
                srv.stop()
                print(f"{name} {mode} (round {i + 1}): {r['wall_s']:.2f} s, {r['tok_s']:.1f} "
                      f"tok/s, latency mean {r['latency_mean_s']:.2f} s, p90 "
                      f"{r['latency_p90_s']:.2f} s, batches {r['batches']}, joined rows "
                      f"{r['joined_rows']}, loop busy {100 * r['loop_share']:.0f} %, CPU "
                      f"server {r['server_cpu_s'] / r['wall_s']:.2f} / client "
                      f"{r['client_cpu_s'] / r['wall_s']:.2f} cores", flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="max_tokens of the requests, in turn")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="serve --compile (GPU)")
    ap.add_argument("--fixed-rows", action="store_true", help="serve --fixed-rows")
    ap.add_argument("--clients", type=int, default=4,
                    help="client processes sharing the requests")
    ap.add_argument("--temperatures", default="0",
                    help="the requests' temperatures, in turn (several: mixed settings)")
    ap.add_argument("--frontends", default="0",
                    help="HTTP processes (serve --frontends), several comma-separated: each "
                         "engine is served with each in turn")
    ap.add_argument("--out", default="serve-bench-out")
    a = ap.parse_args()
    frontends = [int(x) for x in a.frontends.split(",")]
    lengths = [int(x) for x in a.lengths.split(",")]
    temps = [float(x) for x in a.temperatures.split(",")]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    cfg = EngineConfig(max_batch=a.max_batch, max_prompt_tokens=256, max_tokens=max(lengths),
                       steps=a.steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens,
                       compile=a.compile, fixed_rows=a.fixed_rows)
    engines = {"baseline": load_engine(a.target, None, a.device, dtype, cfg)}
    if a.drafter:
        engines["speculative"] = load_engine(a.target, a.drafter, a.device, dtype, cfg)
    warm = {}
    for name, engine in engines.items():
        t0 = time.perf_counter()
        if a.device == "cuda":
            engine.warmup()
        warm[name] = time.perf_counter() - t0
        print(f"{name}: warm-up {warm[name]:.1f} s", flush=True)
    jobs = chat_jobs(a.requests, lengths, temps)
    engines = servers(engines, frontends)
    with Clients(a.clients) as clients:
        for engine, k in engines.values():  # untimed: first-call costs, the clients' start
            for continuous in (True, False):
                srv = serve(engine, a.target, continuous, k)
                clients.warm(srv, jobs, len(temps))
                srv.stop()
        runs = rounds(engines, a.target, jobs, a.rounds, clients)
    diffs = text_diffs(runs, jobs) if temps == [0.0] else []
    same = not diffs
    pools = {f"{e} {m}": pooled([r for k, r in runs.items() if k.startswith(f"{e} {m} ")])
             for e in engines for m in ("static", "continuous")}
    ratios = {f"{e}: continuous / static": ratio(pools[f"{e} continuous"], pools[f"{e} static"])
              for e in engines}
    if a.drafter and len(frontends) == 1:
        for m in ("static", "continuous"):
            ratios[f"{m}: speculative / baseline"] = ratio(pools[f"speculative {m}"],
                                                           pools[f"baseline {m}"])
    ratios.update(frontend_ratios(pools, frontends))
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "target": a.target,
        "drafter": a.drafter, "steps": a.steps, "topk": a.topk,
        "num_draft_tokens": a.num_draft_tokens, "compile": a.compile,
        "fixed_rows": a.fixed_rows, "requests": a.requests, "clients": a.clients,
        "max_batch": a.max_batch, "temperatures": temps, "frontends": frontends,
        "lengths": lengths, "same_texts": same if temps == [0.0] else None, "rounds": a.rounds,
        "pooled": pools,
        "ratios": ratios, "warmup_s": warm, "text_diffs": diffs,
        "runs": {k: {x: y for x, y in v.items() if x != "texts"} for k, v in runs.items()}}
    print("| run | wall s | tok/s | latency mean s | p50 | p90 | batches | joined rows "
          "| loop busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {v['wall_s']:.2f} | {v['tok_s']:.1f} | {v['latency_mean_s']:.2f} | "
              f"{v['latency_p50_s']:.2f} | {v['latency_p90_s']:.2f} | {v['batches']} | "
              f"{v['joined_rows']} | {100 * v['loop_share']:.0f} % |")
    print("pooled over the rounds (tokens over summed wall time; mean latency):")
    for k, v in ratios.items():
        print(f"{k}: tok/s {v['tok_s']:.2f}x, mean latency {v['latency_mean']:.2f}x")
    print(f"same texts in every run: {same}" if temps == [0.0] else
          f"temperatures {temps}: sampled texts, not compared")
    for d in diffs:
        print(f"request {d['request']} (max_tokens {d['max_tokens']}): {d['runs_apart']} "
              f"apart from the first run, from character {d['first_diff_char']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(runs, out / "serve_bench.png")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, separators=(",", ":")))
    if not same and (a.fixed_rows or not (a.compile and dtype == torch.bfloat16)):
        raise SystemExit("greedy texts differ between the runs")


def chat_jobs(n: int, lengths: list[int],
              temps: list[float] = (0.0,)) -> list[tuple[str, int, float]]:
    """`n` requests: chat-suite prompts in turn, max_tokens cycling through `lengths`,
    temperature through `temps`."""
    msgs = [m[-1]["content"] for m in suite_messages("chat", n)]
    m = len(msgs)
    return [(msgs[i % m], lengths[i % m % len(lengths)], temps[i % len(temps)]) for i in range(n)]


def text_diffs(runs: dict, jobs: list[tuple[str, int]]) -> list[dict]:
    """Each request whose text is not the same in every run: which runs differ from the first,
    where they first part, and both texts around it (greedy: they should never differ)."""
    names = list(runs)
    first = runs[names[0]]["texts"]
    out = []
    for i, ref in enumerate(first):
        apart = [n for n in names[1:] if runs[n]["texts"][i] != ref]
        if apart:
            other = runs[apart[0]]["texts"][i]
            at = next((k for k, (x, y) in enumerate(zip(ref, other, strict=False)) if x != y),
                      min(len(ref), len(other)))
            out.append({"request": i, "max_tokens": jobs[i][1], "runs_apart": apart,
                        "first_diff_char": at, "first": ref[max(0, at - 40): at + 40],
                        "other": other[max(0, at - 40): at + 40]})
    return out


def frontend_ratios(pools: dict[str, dict], frontends: list[int]) -> dict[str, dict]:
    """Each count of frontend processes against the first count, by engine and mode."""
    out = {}
    base = frontends[0]
    for key in pools:
        name, _, mode = key.rpartition(" ")
        head, _, k = name.rpartition(" f")
        if len(frontends) > 1 and k.isdigit() and int(k) != base:
            out[f"{head} {mode}: f{k} / f{base}"] = ratio(pools[key],
                                                         pools[f"{head} f{base} {mode}"])
    return out


def ratio(a: dict, b: dict) -> dict:
    return {"tok_s": a["tok_s"] / b["tok_s"],
            "latency_mean": a["latency_mean_s"] / b["latency_mean_s"]}


def pooled(rs: list[dict]) -> dict:
    return {"tok_s": sum(r["completion_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
            "latency_mean_s": statistics.fmean(x for r in rs for x in r["latencies_s"])}


def plot(runs: dict, path: Path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, r in runs.items():
        lat = sorted(r["latencies_s"])
        ax[0].step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=mode)
    ax[0].set(xlabel="request latency, s", ylabel="share of requests done", title="latency")
    ax[0].legend(fontsize=7)
    modes = list(runs)
    ax[1].bar(modes, [runs[m]["tok_s"] for m in modes])
    ax[1].set(ylabel="completion tokens/s", title="throughput")
    ax[1].tick_params(axis="x", labelrotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
