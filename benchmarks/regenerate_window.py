"""`data regenerate --base-url`: chunked answering (bcf8059's regenerate.py, the commit before
the window: each chunk of --concurrency conversations waited for its slowest) against the
rolling window (this tree's: the next conversation begun as soon as one ends), same prompts,
same server, one run.

Usage: python benchmarks/regenerate_window.py [--n 256] [--concurrency 16 64] [--median 0.05]
       [--sigma 1.0] [--seed 0] [--base bcf8059] [--md FILE]
The server is a local fake OpenAI-compatible one (uvicorn) whose answer to each request takes
a lognormal time (median --median s, --sigma), drawn from --seed and the request's messages, so
both ways meet the same latencies; every fourth conversation has two user turns. Each way's
output file must hold the same bytes (checked). Prints (and with --md writes) a markdown report.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import math
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from draftsmith.data import regenerate as window
from draftsmith.data.prompts import Conversation


def latency(seed: int, messages: Any, median: float, sigma: float) -> float:
    key = hashlib.sha256(json.dumps([seed, messages]).encode()).digest()
    return random.Random(key).lognormvariate(math.log(median), sigma)


def app(seed: int, median: float, sigma: float) -> FastAPI:
    fake = FastAPI()

    @fake.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        msgs = (await request.json())["messages"]
        await asyncio.sleep(latency(seed, msgs, median, sigma))
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": f"re: {msgs[-1]['content']}"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}

    return fake


def serve(fake: FastAPI) -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(fake, host="127.0.0.1", port=port, log_level="warning",
                                        backlog=1024))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}/v1", srv


def head_module(rev: str) -> ModuleType:
    """regenerate.py as of `rev`, imported beside this tree's."""
    src = subprocess.run(["git", "show", f"{rev}:src/draftsmith/data/regenerate.py"],
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "regenerate_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("regenerate_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["regenerate_base"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def convs(n: int) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i}"}]
                         + ([{"role": "assistant", "content": "old"},
                             {"role": "user", "content": f"and {i}?"}] if i % 4 == 0 else []))
            for i in range(n)]


def timed(mod: ModuleType, url: str, n: int, conc: int, out: Path, tok: Any) -> float:
    cfg = mod.RegenConfig(max_new_tokens=8, max_len=256, batch_size=conc, temperature=0.0)
    backend = mod.OpenAIBackend(url, "m", cfg, conc, retries=0, timeout=120)
    try:
        t0 = time.perf_counter()
        stats = mod.regenerate(convs(n), out, backend, tok, cfg, False, lambda s: None)
        wall = time.perf_counter() - t0
    finally:
        backend.close()
    assert stats["answered"] == n, stats
    return wall


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--median", type=float, default=0.05)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default="bcf8059",
                    help="the git revision of the chunked code (the commit before the window)")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    base, tok = head_module(args.base), window.load_tokenizer("default")
    url, srv = serve(app(args.seed, args.median, args.sigma))
    rows, tmp = [], Path(tempfile.mkdtemp())
    try:
        for conc in args.concurrency:
            walls = {}
            for name, mod in (("chunked", base), ("window", window)):
                walls[name] = timed(mod, url, args.n, conc, tmp / f"{name}{conc}.jsonl", tok)
            same = (tmp / f"chunked{conc}.jsonl").read_bytes() == \
                (tmp / f"window{conc}.jsonl").read_bytes()
            rows.append((conc, walls, same))
    finally:
        srv.should_exit = True
    lines = [
        "# regenerate against a server: chunked vs rolling window", "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- machine: {cpu()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- {args.n} conversations (every fourth of two turns); fake server latency per request "
        f"lognormal, median {args.median} s, sigma {args.sigma}, seed {args.seed}; chunked = "
        f"`git show {args.base}:src/draftsmith/data/regenerate.py`", "",
        "| concurrency | chunked s | chunked conv/s | window s | window conv/s | speedup "
        "| same file |", "|---|---|---|---|---|---|---|"]
    for conc, w, same in rows:
        lines.append(f"| {conc} | {w['chunked']:.2f} | {args.n / w['chunked']:.1f} | "
                     f"{w['window']:.2f} | {args.n / w['window']:.1f} | "
                     f"{w['chunked'] / w['window']:.2f}x | {'yes' if same else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
