"""All-reduce micro-benchmark at a model's shapes: [batch * q, hidden] activations, the tensor
every row-parallel layer of a TP forward sums. Eager and CUDA-graphed (a batch of all-reduces
captured in one graph, as a graphed verify step replays them), with the NCCL settings in effect.

GPUs:  torchrun --nproc-per-node 8 -m draftsmith.bench.allreduce --hidden 4096 --layers 32
       (or `draftsmith bench-allreduce --tp 8`, which spawns the ranks itself)
CPU:   draftsmith bench-allreduce --tp 2 --device cpu   (gloo; a smoke test, eager only)

On the CPU the ranks sum host tensors through gloo: that checks the command and its record, and
says nothing about a GPU's all-reduce (no NCCL, no NVLink; the NCCL settings do not apply). Its
result says so (`smoke_test`, `note`, the table's title, a line on stderr), not refused: tests
and `tune-nccl`'s CPU runs take this path.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import typer

from draftsmith.dist import (
    ensure_nvls_off,
    launch_tp,
    nccl_env,
    nccl_record,
    nccl_settings,
    shutdown,
    torchrun_ranks,
    under_torchrun,
)
from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP
from draftsmith.options import at_least_one, given, int_list, unused

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LONG_NAMES = {str(v).removeprefix("torch."): k for k, v in DTYPES.items()}  # every other command's


def dtype_key(name: str) -> str:
    """--dtype as DTYPES' key: a short name, the long one every other command takes, or auto
    (kept as auto until the device is known: `resolve_auto`)."""
    key = LONG_NAMES.get(name, name)
    if key != "auto" and key not in DTYPES:
        raise DraftsmithError(f"--dtype {name!r}: use float32, bfloat16, float16 (or fp32, bf16, "
                              "fp16) or auto (bfloat16 on GPU, float32 on CPU)")
    return key


def resolve_auto(key: str, device: str | None, size: int) -> str:
    """auto: bf16 where the ranks run on GPUs (as `launch_tp` places them), else fp32."""
    if key != "auto":
        return key
    gpu = device != "cpu" and (torch.cuda.is_available() if under_torchrun()
                               else torch.cuda.device_count() >= size)
    return "bf16" if gpu else "fp32"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slowest(tp: TP, seconds: float) -> float:
    """The largest time over ranks: an all-reduce is done when the last rank is."""
    t = torch.tensor([seconds], dtype=torch.float64, device=tp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp.group)
    return float(t.item())


def time_eager(tp: TP, x: torch.Tensor, iters: int, warmup: int = 5) -> float:
    """Seconds per eager all-reduce of x."""
    for _ in range(warmup):
        dist.all_reduce(x, group=tp.group)
    _sync(x.device)
    dist.barrier(group=tp.group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=tp.group)
    _sync(x.device)
    return _slowest(tp, time.perf_counter() - t0) / iters


def time_graphed(tp: TP, x: torch.Tensor, iters: int, ops: int) -> float:
    """Seconds per all-reduce when `ops` of them are replayed as one CUDA graph."""
    stream = torch.cuda.Stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            dist.all_reduce(x, group=tp.group)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            dist.all_reduce(x, group=tp.group)
    graph.replay()
    _sync(x.device)
    dist.barrier(group=tp.group)
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    _sync(x.device)
    elapsed = _slowest(tp, time.perf_counter() - t0)
    del graph
    return elapsed / (iters * ops)


def measure(
    tp: TP,
    hidden: int,
    batches: list[int],
    qs: list[int],
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 100,
    graph_ops: int = 64,
    layers: int = 32,
) -> list[dict[str, Any]]:
    """One row per (batch, q): µs per all-reduce eager and graphed, bus bandwidth, and the
    all-reduce time of one forward (2 per layer + 1 for the vocab-parallel embedding).

    With one rank the eager figure is the host cost of a c10d call alone (no kernel runs)."""
    rows = []
    graphed = tp.device.type == "cuda" and tp.size > 1  # one rank: NCCL launches nothing
    for b in batches:
        for q in qs:
            x = torch.zeros(b * q, hidden, dtype=dtype, device=tp.device)  # zeros never overflow
            eager = time_eager(tp, x, iters)
            graph = time_graphed(tp, x, iters, graph_ops) if graphed else None
            rows.append(_row(tp.size, b, q, x, eager, graph, layers))
    return rows


def _row(n: int, b: int, q: int, x: torch.Tensor, eager: float, graph: float | None,
         layers: int) -> dict[str, Any]:
    size = x.numel() * x.element_size()
    best = graph if graph is not None else eager
    return {
        "batch": b, "q": q, "tokens": b * q, "bytes": size,
        "eager_us": round(eager * 1e6, 2),
        "graph_us": None if graph is None else round(graph * 1e6, 2),
        # one rank moves no bytes: no bus bandwidth to measure (0 would read as a measurement)
        "busbw_GBps": round(size / best * 2 * (n - 1) / n / 1e9, 3) if n > 1 else None,
        "per_forward_us": round(best * (2 * layers + 1) * 1e6, 1),
    }


@contextlib.contextmanager
def _group(tp: TP) -> Iterator[TP]:
    """A one-rank group when nothing else started one, so --tp 1 measures too."""
    if dist.is_initialized():
        yield tp
        return
    backend = "nccl" if tp.device.type == "cuda" else "gloo"
    if backend == "nccl":
        ensure_nvls_off()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the OS picks, no race
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            device_id=tp.device if backend == "nccl" else None)
    try:
        yield TP(0, 1, dist.group.WORLD, tp.device)
    finally:
        dist.destroy_process_group()


def _command() -> str:
    """`draftsmith bench-allreduce ...`, or the module form torchrun ran."""
    from draftsmith.options import command_line

    if "bench-allreduce" in sys.argv[1:2]:
        return command_line()
    return command_line("python -m draftsmith.bench.allreduce")


SMOKE = ("gloo on the CPU: a smoke test of the command, not a GPU's all-reduce (no NCCL; "
         "its settings do not apply)")


def bench_rank(tp: TP, opts: dict[str, Any]) -> dict[str, Any]:
    """What every rank runs; returns the full result (rows identical on every rank)."""
    with _group(tp) as g:
        rows = measure(g, opts["hidden"], opts["batches"], opts["qs"], DTYPES[opts["dtype"]],
                       opts["iters"], opts["graph_ops"], opts["layers"])
        backend = dist.get_backend(g.group)
        smoke = backend != "nccl"
        return {
            "bench": "allreduce", "world": g.size, "device": _device_name(g.device),
            "backend": backend, "smoke_test": smoke, "note": SMOKE if smoke else None,
            "dtype": opts["dtype"],
            "hidden": opts["hidden"], "layers": opts["layers"], "graph_ops": opts["graph_ops"],
            "iters": opts["iters"], "nccl": nccl_record(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": _command(), "rows": rows,
        }


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def print_result(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    smoke = res.get("smoke_test")
    setting = "gloo smoke test, not a GPU figure" if smoke else f"NCCL {res['nccl']['env']}"
    table = Table(title=f"all-reduce, {res['world']} x {res['device']}, {res['dtype']}, "
                        f"hidden {res['hidden']}, {setting}")
    cols = ["batch", "q", "tokens", "bytes", "eager_us", "graph_us", "busbw_GBps",
            "per_forward_us"]
    for c in cols:
        table.add_column(c, justify="right")
    for r in res["rows"]:
        table.add_row(*("-" if r[c] is None else str(r[c]) for c in cols))
    Console(stderr=True).print(table)  # stdout: the JSON line alone, as bench's (`| jq`)
    if smoke:
        print(f"draftsmith: warning: {res['note']}", file=sys.stderr)
    print(json.dumps(res))


def _shape_from_target(target: str) -> tuple[int, int]:
    from draftsmith.models.config import ModelConfig
    from draftsmith.targets import hf, load_target

    path = Path(target)
    cfg = ModelConfig.from_hf(hf.read_config(path)) if path.is_dir() else load_target(target).cfg
    return cfg.hidden_size, cfg.num_layers


# the variables the named flags set: one also given by --nccl was silently replaced
NAMED = {"NCCL_PROTO": "--nccl-proto", "NCCL_ALGO": "--nccl-algo",
         "NCCL_P2P_LEVEL": "--nccl-p2p-level"}


def _extra(pairs: list[str] | None, named: dict[str, str | None] | None = None) -> dict[str, str]:
    """--nccl's NAME=VALUE pairs, each refused by the flag: a name NCCL does not read (NCCL's are
    upper case), no value, a name given twice, or one that a named flag (`NAMED`) sets too."""
    out: dict[str, str] = {}
    named = named or {}
    for p in pairs or []:
        k, eq, v = (x.strip() for x in p.partition("="))
        if not eq or not re.fullmatch(r"NCCL_[A-Z0-9_]+", k) or not v:
            raise DraftsmithError(f"--nccl {p!r}: expected NCCL_NAME=VALUE (NCCL's upper-case "
                                  "name and a value)")
        if k in out or named.get(k) is not None:
            other = f"--nccl {k}={out[k]}" if k in out else f"{NAMED[k]} {named[k]}"
            raise DraftsmithError(f"--nccl {p!r}: {other} sets {k} too; give it once")
        out[k] = v
    return out


def allreduce_bench(
    hidden: int = typer.Option(4096, help="Activation width (the target's hidden size)"),
    layers: int = typer.Option(32, help="Decoder layers, for the per-forward estimate"),
    target: str = typer.Option(None, help="Take hidden size and layers from this target"),
    batch: str = typer.Option("1,8,32", "--batch", "--batch-sizes",
                              help="Batch sizes, comma-separated"),
    q: str = typer.Option("1,4,8,16", help="Tokens per row (1 = decode, >1 = verify)"),
    dtype: str = typer.Option("auto", help="bfloat16 (bf16), float16 (fp16), float32 (fp32) or "
                              "auto (bfloat16 on GPU, float32 on CPU)"),
    iters: int = typer.Option(100, help="Timed all-reduces (eager) or replays (graphed)"),
    graph_ops: int = typer.Option(64, "--graph-ops", help="All-reduces captured per graph"),
    tp: int = typer.Option(0, "--tp", help="Ranks (0 = torchrun's world or every visible GPU)"),
    device: str = typer.Option("auto", help="cuda, cpu or auto"),
    nccl_proto: str = typer.Option(None, "--nccl-proto", help="NCCL_PROTO, e.g. LL,LL128"),
    nccl_algo: str = typer.Option(None, "--nccl-algo", help="NCCL_ALGO, e.g. Ring or Tree"),
    nccl_p2p_level: str = typer.Option(None, "--nccl-p2p-level", help="NCCL_P2P_LEVEL"),
    nccl: list[str] = typer.Option(None, "--nccl", metavar="<NAME=VALUE>",
                                   help="Any NCCL_NAME=VALUE (repeatable, each name once)"),
    out: Path = typer.Option(None, "--out", "-o", help="Append the JSON line to this file"),
) -> None:
    """All-reduce µs at the model's activation shapes, eager and CUDA-graphed (NVLS stays off)."""
    key = dtype_key(dtype)
    at_least_one({"--hidden": hidden, "--layers": layers, "--iters": iters,
                  "--graph-ops": graph_ops})
    if tp < 0:
        raise DraftsmithError(f"--tp must be >= 0 (0: torchrun's world or every GPU), got {tp}")
    _check_out(out)
    rank, world, _ = torchrun_ranks()  # checked: a half or malformed launcher's env refused
    if target:  # it sets both: --hidden and --layers beside it were dropped without a word
        unused(given(allreduce_bench, hidden=hidden, layers=layers), "without --target",
               "--target sets the hidden size and layers; leave {it} out")
        hidden, layers = _shape_from_target(target)
    # a shape given twice is timed once, in the order given (as tune-nccl's)
    opts = {"hidden": hidden, "layers": layers,
            "batches": list(dict.fromkeys(int_list(batch, "--batch"))),
            "qs": list(dict.fromkeys(int_list(q, "--q"))), "iters": iters,
            "graph_ops": graph_ops}
    dev = None if device == "auto" else device
    _check_device(dev)
    size = tp or _default_size(dev, world)
    opts["dtype"] = resolve_auto(key, dev, size)
    extra = _extra(nccl, dict(zip(NAMED, (nccl_proto, nccl_algo, nccl_p2p_level), strict=True)))
    with nccl_settings(nccl_env(nccl_proto, nccl_algo, nccl_p2p_level, extra)):
        try:
            res = launch_tp(bench_rank, size, opts, device=dev)
        finally:
            if under_torchrun():
                shutdown()
    if rank == 0:
        print_result(res)
        if out:
            _append(out, res)


def _append(out: Path, res: dict[str, Any]) -> None:
    """The JSON line onto --out; a failure one error (the line was printed already)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(res) + "\n")
    except OSError as e:
        raise DraftsmithError(f"--out {out}: cannot append the JSON line ({e.strerror or e}); "
                              "the result is the JSON line printed above") from None


def _check_out(out: Path | None) -> None:
    """Before any rank starts: an --out the JSON line can be appended to once measured."""
    if out is None:
        return
    if out.is_dir():
        raise DraftsmithError(f"--out {out}: is a folder; give a file to append the JSON line to")
    for p in out.parents:
        if p.exists():
            if not p.is_dir():
                raise DraftsmithError(f"--out {out}: lies under the file {p}")
            return


def _check_device(device: str | None) -> None:
    """--device refused by name before any rank starts: a rank's own refusal ('local rank 0
    needs cuda:0') named neither the flag nor the CPU run that works without a GPU."""
    if device in (None, "cpu"):
        return
    if not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise DraftsmithError(f"--device {device}: use cuda, cuda:N, cpu or auto")
    if not torch.cuda.is_available():
        raise DraftsmithError(f"--device {device}: no CUDA device is visible here; give "
                              "--device cpu (a gloo smoke test) or run on a GPU machine")


def _default_size(device: str | None, world: int) -> int:
    if under_torchrun():
        return world
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def main() -> None:
    try:
        typer.run(allreduce_bench)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
