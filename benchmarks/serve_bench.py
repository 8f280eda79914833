"""`draftsmith serve` under concurrent load: continuous batching against static batches.

Usage: python benchmarks/serve_bench.py [--target default] [--device cpu] [--requests 24]
       [--max-batch 8] [--rounds 2] [--drafter DIR [--steps 3 --topk 1 --num-draft-tokens N]]
       [--out DIR]
Starts the real server (uvicorn, in this process) on one engine, with `--static-batches`
behaviour and continuous, in turn for `--rounds` rounds (the order alternating), sends the same
requests at once through the
real `openai` client (greedy, chat suite prompts, max_tokens cycling through LENGTHS so answers
end apart), and reports wall time, completion tokens/s, per-request latency (mean, p50, p90),
batches and joined rows. Greedy: both modes must return the same texts (checked). Writes
serve_bench.json and serve_bench.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from draftsmith.bench.suites import suite_messages  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, load_engine  # noqa: E402

LENGTHS = (16, 96, 32, 64, 24, 80, 48, 8)


def serve(engine, target: str, continuous: bool):
    import uvicorn

    from draftsmith.serve.app import create_app

    cfg = server_config(engine, target, None, None, 256, continuous=continuous)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, cfg), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}", cfg.model_name


def load(url: str, model: str, jobs: list[tuple[str, int]]) -> dict:
    import httpx
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    before = httpx.get(url + "/metrics").json()

    def one(job: tuple[str, int]) -> tuple[str, int, float]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": job[0]}], max_tokens=job[1],
            temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    after = httpx.get(url + "/metrics").json()
    lat = sorted(g[2] for g in got)
    tokens = sum(g[1] for g in got)
    return {"wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
            "latency_mean_s": statistics.fmean(lat), "latency_p50_s": lat[len(lat) // 2],
            "latency_p90_s": lat[int(0.9 * (len(lat) - 1))],
            "batches": after["batches"] - before["batches"],
            "joined_rows": after["joined_rows"] - before["joined_rows"],
            "texts": [g[0] for g in got], "latencies_s": [g[2] for g in got]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--out", default="serve-bench-out")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    cfg = EngineConfig(max_batch=a.max_batch, max_prompt_tokens=256, max_tokens=max(LENGTHS),
                       steps=a.steps, topk=a.topk, num_draft_tokens=a.num_draft_tokens)
    engine = load_engine(a.target, a.drafter, a.device, dtype, cfg)
    if a.device == "cuda":
        engine.warmup()
    msgs = suite_messages("chat", a.requests)
    jobs = [(m[-1]["content"], LENGTHS[i % len(LENGTHS)]) for i, m in enumerate(msgs)]
    jobs = (jobs * (a.requests // len(jobs) + 1))[: a.requests]
    load(*serve(engine, a.target, True)[1:], jobs[:2])  # untimed: first-call costs
    runs: dict[str, dict] = {}
    for i in range(a.rounds):
        modes = [("static", False), ("continuous", True)]
        for mode, continuous in modes if i % 2 == 0 else modes[::-1]:
            server, url, model = serve(engine, a.target, continuous)
            r = runs[f"{mode} {i + 1}"] = load(url, model, jobs)
            server.should_exit = True
            time.sleep(0.5)
            print(f"{mode} (round {i + 1}): {r['wall_s']:.1f} s, {r['tok_s']:.1f} tok/s, latency "
                  f"mean {r['latency_mean_s']:.2f} s, p90 {r['latency_p90_s']:.2f} s, batches "
                  f"{r['batches']}, joined rows {r['joined_rows']}", flush=True)
    same = len({tuple(r["texts"]) for r in runs.values()}) == 1
    s, c = (pooled([r for k, r in runs.items() if k.startswith(m)])
            for m in ("static", "continuous"))
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "target": a.target,
        "drafter": a.drafter, "steps": a.steps, "topk": a.topk,
        "num_draft_tokens": a.num_draft_tokens, "requests": a.requests, "max_batch": a.max_batch,
        "lengths": LENGTHS, "same_texts": same, "rounds": a.rounds,
        "continuous_over_static": {"tok_s": c["tok_s"] / s["tok_s"],
                                   "latency_mean": c["latency_mean_s"] / s["latency_mean_s"]},
        "runs": {k: {x: y for x, y in v.items() if x != "texts"} for k, v in runs.items()}}
    print("| mode | wall s | tok/s | latency mean s | p50 | p90 | batches | joined rows |")
    print("|---|---|---|---|---|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {v['wall_s']:.1f} | {v['tok_s']:.1f} | {v['latency_mean_s']:.2f} | "
              f"{v['latency_p50_s']:.2f} | {v['latency_p90_s']:.2f} | {v['batches']} | "
              f"{v['joined_rows']} |")
    print("continuous / static over all rounds (tokens over summed wall time; mean latency):")
    print(f"continuous / static: tok/s {report['continuous_over_static']['tok_s']:.2f}x, mean "
          f"latency {report['continuous_over_static']['latency_mean']:.2f}x; same texts: {same}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(runs, out / "serve_bench.png")
    print(json.dumps(report, separators=(",", ":")))
    if not same:
        raise SystemExit("greedy texts differ between the modes")


def pooled(rs: list[dict]) -> dict:
    return {"tok_s": sum(r["completion_tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
            "latency_mean_s": statistics.fmean(x for r in rs for x in r["latencies_s"])}


def plot(runs: dict, path: Path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for mode, r in runs.items():
        lat = sorted(r["latencies_s"])
        ax[0].step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=mode)
    ax[0].set(xlabel="request latency, s", ylabel="share of requests done", title="latency")
    ax[0].legend()
    modes = list(runs)
    ax[1].bar(modes, [runs[m]["tok_s"] for m in modes])
    ax[1].set(ylabel="completion tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
