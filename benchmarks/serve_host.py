"""The server's own host path: `draftsmith serve` over an engine whose steps cost nothing.

Usage: python benchmarks/serve_host.py [--requests 512] [--max-batch 32] [--rounds 2]
       [--lengths 32,192,64,128,48,160,96,16] [--clients 4] [--frontends 0[,4]] [--out DIR]
The real server (uvicorn, FastAPI, the scheduler, chat-template tokenization, detokenization,
the OpenAI response bodies) and the real `openai` client in its own process, as in
`serve_bench.py`, but the engine's rows emit the next token of a fixed answer per step with no
model. Its tok/s is the most the server can deliver on this host whatever the GPU; on the H200
the compiled engine alone decodes ~26,000 tok/s at 32 rows (`speculative_default.md`, run 26)
while the server delivered 7,000-10,000 (`serve_h200.md`). `--clients`: client processes (one
Python client tops out near one core). Also times the cyclic GC during the runs
(`DRAFTSMITH_SERVE_GC_FREEZE=0|1` for the A/B). Writes serve_host.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from serve_bench import LENGTHS, Clients, chat_jobs, frontend_ratios, pooled, rounds, serve, servers

from draftsmith.serve.engine import EngineConfig, LiveRows, ServeEngine

TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs back home to rest. ")


class NullRows(LiveRows):
    """Rows whose steps cost nothing: each step appends the next token of a fixed answer."""

    def __init__(self, eng: NullEngine, rows: int) -> None:
        super().__init__(eng, rows)
        m = eng.cfg.max_tokens
        self.state = SimpleNamespace(out=eng.answer[:m].repeat(rows, 1),
                                     count=torch.zeros(rows, dtype=torch.long),
                                     done=torch.ones(rows, dtype=torch.bool))

    def add(self, slots: list[int], prompts: list[list[int]], params=None) -> None:
        idx = self._idx(slots)
        self.state.count[idx] = 1
        self.state.done[idx] = False

    def step(self, n: int) -> None:
        st, cap = self.state, self.eng.cfg.max_tokens
        st.count.add_((~st.done).long() * n).clamp_(max=cap)
        st.done |= st.count >= cap


class NullEngine(ServeEngine):
    """The server's engine interface with the real tokenizer and no model."""

    def __init__(self, target, cfg: EngineConfig) -> None:  # no runtime, no model
        self.target, self.cfg, self.drafter = target, cfg, None
        self.eos = list(target.eos_ids)
        self.vocab_size = target.cfg.vocab_size
        if hasattr(ServeEngine, "_text_tools"):
            self._text_tools(target)
        else:  # an older draftsmith's server (SRC=... in h200.sh servehost): one shared lock
            self._tok_lock = threading.Lock()
        self.rt = SimpleNamespace(device=torch.device("cpu"))
        ids = target.tokenizer(TEXT * 64)["input_ids"]
        self.answer = torch.tensor(ids[: cfg.max_tokens])

    def open(self, rows: int, params) -> NullRows:
        return NullRows(self, rows)

    def warmup(self, batch_sizes: list[int] | None = None) -> None:
        pass


class GcClock:
    """Time the cyclic garbage collector spends, by generation, from `start` on."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def start(self) -> None:
        gc.callbacks.append(self)


class GcClients(Clients):
    """Clients whose runs also report the GC time spent while they ran."""

    def __init__(self, n: int, clock: GcClock) -> None:
        super().__init__(n)
        self.clock = clock

    def load(self, srv, jobs: list[tuple[str, int]]) -> dict:
        tracked = len(gc.get_objects())  # what a full collection walks (frozen ones excluded)
        n0, s0 = list(self.clock.count), sum(self.clock.seconds)
        r = super().load(srv, jobs)
        r["gc_tracked_objects"] = tracked
        r["gc_s"] = sum(self.clock.seconds) - s0
        r["gc_collections"] = [a - b for a, b in zip(self.clock.count, n0, strict=True)]
        return r


def main() -> None:
    from draftsmith.targets import load_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--clients", type=int, default=4,
                    help="client processes sharing the requests")
    ap.add_argument("--frontends", default="0",
                    help="HTTP processes (serve --frontends), several comma-separated: each in "
                         "turn")
    ap.add_argument("--out", default="serve-host-out")
    a = ap.parse_args()
    frontends = [int(x) for x in a.frontends.split(",")]
    # the null rows' few tensor ops would otherwise wake torch's whole CPU thread pool, whose
    # spinning showed as 4-9 cores of server CPU on the H200's 16-core host
    torch.set_num_threads(1)
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = EngineConfig(max_batch=a.max_batch, max_prompt_tokens=256, max_tokens=max(lengths))
    engines = servers({"null": NullEngine(load_target(a.target), cfg)}, frontends)
    jobs = chat_jobs(a.requests, lengths)
    clock = GcClock()
    clock.start()
    with GcClients(a.clients, clock) as clients:
        for engine, k in engines.values():
            srv = serve(engine, a.target, True, k)
            clients.warm(srv, jobs)
            srv.stop()
        runs = rounds(engines, a.target, jobs, a.rounds, clients)
    pools = {f"{e} {m}": pooled([r for k, r in runs.items() if k.startswith(f"{e} {m} ")])
             for e in engines for m in ("static", "continuous")}
    ratios = frontend_ratios(pools, frontends)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)), "requests": a.requests,
        "max_batch": a.max_batch, "clients": a.clients, "lengths": lengths,
        "frontends": frontends, "pooled": pools, "ratios": ratios,
        "gc_freeze": os.environ.get("DRAFTSMITH_SERVE_GC_FREEZE", "1"),
        "runs": {k: {x: y for x, y in v.items() if x != "texts"} for k, v in runs.items()}}
    for m, v in pools.items():
        print(f"{m}: {v['tok_s']:.0f} tok/s, mean latency {v['latency_mean_s']:.2f} s")
    for m, v in ratios.items():
        print(f"{m}: tok/s {v['tok_s']:.2f}x, mean latency {v['latency_mean']:.2f}x")
    for k, r in runs.items():
        print(f"{k}: GC {r['gc_s']:.3f} s while the clients ran ({r['gc_collections']} "
              f"collections by generation; {r['gc_tracked_objects']} objects tracked)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_host.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
