"""torch.distributed for tensor parallelism: start from torchrun's environment or spawn local
processes, and NCCL settings that are explicit, validated and recorded.

NVLink multicast (NVLS) stays off: every process group started here runs with
NCCL_NVLS_ENABLE=0, and asking for NVLS in any form is a DraftsmithError.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import queue
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftsmith.errors import DraftsmithError
from draftsmith.models.parallel import TP

PROTOS = ("LL", "LL128", "Simple")
ALGOS = ("Ring", "Tree", "CollnetDirect", "CollnetChain", "PAT")
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5")
NVLS_ALGOS = ("NVLS", "NVLSTree")  # only ever excluded: NCCL_ALGO=^NVLS,NVLSTree
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0"}


class PortTaken(DraftsmithError):
    """MASTER_PORT is another process's: a launcher that picked the port itself picks again."""


# ---- NCCL settings -----------------------------------------------------------------------------

def nccl_env(
    proto: str | None = None,
    algo: str | None = None,
    p2p_level: str | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """NCCL_* variables for a run, validated; NCCL_NVLS_ENABLE is always "0"."""
    env = {str(k): str(v) for k, v in (extra or {}).items()}
    for key in env:
        if not key.startswith("NCCL_"):
            raise DraftsmithError(f"extra NCCL setting {key!r}: names must start with NCCL_")
    proto, algo, p2p_level = (env.get("NCCL_PROTO") if proto is None else proto,
                              env.get("NCCL_ALGO") if algo is None else algo,
                              env.get("NCCL_P2P_LEVEL") if p2p_level is None else p2p_level)
    if proto:
        env["NCCL_PROTO"] = _check_list("NCCL_PROTO", proto, PROTOS)
    if algo:
        env["NCCL_ALGO"] = _check_algo(algo)
    if p2p_level:
        env["NCCL_P2P_LEVEL"] = _check_list("NCCL_P2P_LEVEL", p2p_level, P2P_LEVELS, single=True)
    check_no_nvls(env)
    return {**env, **NVLS_OFF}


def check_no_nvls(env: dict[str, str]) -> None:
    """Refuse any setting that would turn NVLink multicast on."""
    if env.get("NCCL_NVLS_ENABLE", "0").strip() not in ("0", ""):
        raise DraftsmithError(
            f"NCCL_NVLS_ENABLE={env['NCCL_NVLS_ENABLE']}: draftsmith keeps NVLink multicast off "
            "(NCCL_NVLS_ENABLE=0) on shared GPU machines"
        )
    if "NCCL_ALGO" in env:
        _check_algo(env["NCCL_ALGO"], strict=False)


def _check_list(name: str, value: str, allowed: tuple[str, ...], single: bool = False) -> str:
    """value in NCCL's own spelling: NCCL_P2P_LEVEL is matched case- and space-sensitively, so
    ' nvl' would pass here and be ignored there. Lists as NCCL parses NCCL_PROTO and NCCL_ALGO:
    'LL,Simple', '^LL128' or per collective 'LL;allreduce:^LL'."""
    if single:
        return _spelled(name, value, [value.strip()], allowed)[0]
    items = []
    for item in value.split(";"):
        coll, _, spec = item.rpartition(":")
        spec = spec.strip()
        excluded = spec.startswith("^")
        names = [v.strip() for v in spec.removeprefix("^").split(",")]
        spec = "^" * excluded + ",".join(_spelled(name, value, names, allowed, excluded))
        items.append(f"{coll.strip()}:{spec}" if coll.strip() else spec)
    return ";".join(items)


def _spelled(name: str, value: str, names: list[str], allowed: tuple[str, ...],
             excluded: bool = False) -> list[str]:
    nvls = NVLS_ALGOS if excluded and name == "NCCL_ALGO" else ()
    lower = {a.lower(): a for a in (*allowed, *nvls)}
    if bad := [v for v in names if v.lower() not in lower]:
        raise DraftsmithError(f"{name}={value!r}: unknown value {bad}; use {', '.join(allowed)}")
    return [lower[v.lower()] for v in names]


def _check_algo(value: str, strict: bool = True) -> str:
    """NCCL_ALGO in NCCL's spelling (`_check_list`), NVLS refused; strict=False (settings found
    in the environment): only NVLS refused."""
    for item in value.split(";"):
        spec = item.rpartition(":")[2].strip()
        names = [v.strip() for v in spec.removeprefix("^").split(",")]
        if not spec.startswith("^") and any(v.lower().startswith("nvls") for v in names):
            raise DraftsmithError(
                f"NCCL_ALGO={value!r} asks for NVLS: draftsmith keeps NVLink multicast off"
            )
    return _check_list("NCCL_ALGO", value, ALGOS) if strict else value


def apply_nccl_env(env: dict[str, str]) -> None:
    """Put settings into os.environ; NCCL reads them when a communicator starts."""
    check_no_nvls(env)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        raise DraftsmithError("NCCL settings must be applied before the process group starts")
    os.environ.update(env)
    os.environ.update(NVLS_OFF)


@contextlib.contextmanager
def restored_env(keys: Iterable[str]) -> Iterator[None]:
    """The environment variables `keys` put back as they were on leaving (unset where unset)."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def nccl_settings(env: dict[str, str]) -> Iterator[None]:
    """`apply_nccl_env(env)` for the ranks started inside, the environment put back after: a
    caller in Python (a notebook, a test) kept NCCL_PROTO and the like for later runs."""
    with restored_env([*env, *NVLS_OFF]):
        apply_nccl_env(env)
        yield


def ensure_nvls_off() -> None:
    """Check the NCCL settings already in the environment and pin NCCL_NVLS_ENABLE=0. NCCL also
    reads nccl.conf files for what the environment leaves unset: an NCCL_ALGO=NVLS there counts."""
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    for path in [] if "NCCL_ALGO" in env else _conf_files():
        algo = _read_conf(path).get("NCCL_ALGO") if path.is_file() else None
        if algo is not None:
            try:
                _check_algo(algo, strict=False)
            except DraftsmithError as e:
                raise DraftsmithError(f"{path}: {e}") from None
            break
    apply_nccl_env(env)


def nccl_record() -> dict[str, Any]:
    """Every NCCL setting in effect (environment and nccl.conf files) and the NCCL version."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    record: dict[str, Any] = {"env": env, "nccl_version": _nccl_version()}
    files = {str(p): _read_conf(p) for p in _conf_files() if p.is_file()}
    if files:
        record["conf_files"] = files
    return record


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _conf_files() -> list[Path]:
    """As NCCL reads them, first file first (a setting there wins): NCCL_CONF_FILE or
    ~/.nccl.conf, then /etc/nccl.conf."""
    conf = os.environ.get("NCCL_CONF_FILE")
    return [Path(conf) if conf else Path.home() / ".nccl.conf", Path("/etc/nccl.conf")]


def _read_conf(path: Path) -> dict[str, str]:
    """An nccl.conf's settings; {} for one this process cannot read, which NCCL skips too."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    pairs = (ln.split("=", 1) for ln in text.splitlines() if "=" in ln)
    return {k.strip(): v.strip() for k, v in pairs if not k.strip().startswith("#")}


# ---- process groups ----------------------------------------------------------------------------

def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int | None = None) -> int:
    """ASCII digits only: int() alone took RANK=1_0 as 10 and other scripts' digits as ranks."""
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    if raw is None or not re.fullmatch(r"\s*[-+]?[0-9]+\s*", raw):
        raise DraftsmithError(f"environment variable {name}={raw!r} is not an integer")
    return int(raw)


def pick_device(local_rank: int, device: str | None, rank: int | None = None) -> torch.device:
    """cuda:<local rank> when CUDA is there (or asked for), else cpu. rank: that of a process
    group, whose explicit cuda:N must be its local rank's (as training's)."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:[0-9]+)?", device):  # 'cuda:x' ran on cuda:0 without a word
        raise DraftsmithError(f"device {device!r}: tensor parallelism runs on cpu, cuda or "
                              "cuda:N")
    if rank is not None and device != "cuda" and _cuda_index(device) != local_rank:
        raise DraftsmithError(f"--device {device}: rank {rank} runs on cuda:{local_rank} (its "
                              "local rank); give --device cuda")
    if torch.cuda.device_count() <= local_rank:
        raise DraftsmithError(
            f"local rank {local_rank} needs cuda:{local_rank}, but "
            f"{torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return torch.device("cuda", local_rank)


def _cuda_index(device: str | None) -> int:
    """N of an explicit cuda:N (a lone process runs where it was told), else 0."""
    head, _, index = (device or "").partition(":")
    return int(index) if head == "cuda" and index.isdigit() else 0


def init_tp(tp_size: int | None = None, device: str | None = None) -> TP:
    """Join (or start) the process group torchrun described and return this rank's TP.

    Ranks are grouped in consecutive blocks of tp_size (tp_size=None: the whole world);
    NCCL on CUDA, gloo on CPU. Without torchrun, tp_size must be 1.
    """
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int)
                                or tp_size < 1):
        raise DraftsmithError(f"tensor-parallel size {tp_size!r}: must be an integer >= 1")
    if not under_torchrun():
        torchrun_ranks()  # RANK or WORLD_SIZE alone: a launcher set up wrongly, refused
        if tp_size not in (None, 1):
            raise DraftsmithError(
                f"tensor-parallel size {tp_size} needs {tp_size} processes: run under "
                f"`torchrun --nproc-per-node {tp_size}` or through draftsmith.dist.launch_tp"
            )
        return TP(device=pick_device(_cuda_index(device), device))
    rank, world, local = ranks()
    size = world if tp_size is None else tp_size
    if size < 1 or world % size:
        raise DraftsmithError(f"tensor-parallel size {size} does not divide world size {world}")
    dev = pick_device(local, device, rank)
    start_group(rank, world, dev)
    return TP(rank % size, size, _tp_group(rank, world, size), dev)


def ranks() -> tuple[int, int, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK, checked: a rank outside the world waits forever for a
    process group that never forms."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK", rank)
    if world < 1:
        raise DraftsmithError(f"environment variable WORLD_SIZE={world}: must be >= 1")
    if not 0 <= rank < world:
        raise DraftsmithError(f"environment variable RANK={rank}: with WORLD_SIZE={world} a "
                              f"rank is 0 to {world - 1}")
    if local < 0:
        raise DraftsmithError(f"environment variable LOCAL_RANK={local}: must be >= 0")
    if local >= world:
        raise DraftsmithError(f"environment variable LOCAL_RANK={local}: with WORLD_SIZE={world} "
                              f"a local rank is 0 to {world - 1}")
    return rank, world, local


def torchrun_ranks() -> tuple[int, int, int]:
    """(rank, world, local rank): torchrun's, checked (`ranks`), or a lone
    process's. One of RANK and WORLD_SIZE without the other is a launcher set up wrongly: a
    lone process would train as a rank, or every rank as the only one."""
    given = [k for k in ("RANK", "WORLD_SIZE") if k in os.environ]
    if not given:
        return 0, 1, 0
    if len(given) == 1:
        other = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise DraftsmithError(f"environment variable {given[0]} is set but {other} is not: "
                              "run under torchrun, or set both")
    return ranks()


def start_group(rank: int, world: int, dev: torch.device) -> None:
    """Join the group at MASTER_ADDR:MASTER_PORT, or keep the one this process already runs
    where it is this rank of this world on this backend (else its collectives hang or fail)."""
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
        if have[:2] != (rank, world) or backend not in have[2]:
            raise DraftsmithError(
                f"this process already runs a process group as rank {have[0]} of {have[1]} "
                f"({have[2]}); rank {rank} of {world} on {dev.type} needs {backend}: end it first "
                "(draftsmith.dist.shutdown)")
        return
    where = rendezvous()
    join_s = join_timeout()
    if dev.type == "cuda":
        ensure_nvls_off()
        torch.cuda.set_device(dev)
    try:
        _join(backend, rank, world, dev, join_s)
    except dist.DistError as e:  # e.g. MASTER_PORT taken by another process
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        taken = "EADDRINUSE" in first or "address already in use" in first.lower()
        raise (PortTaken if taken else DraftsmithError)(
            _unmet_line(rank, world, where, join_s, first)
        ) from None


def _join(backend: str, rank: int, world: int, dev: torch.device, join_s: float) -> None:
    """init_process_group, its rendezvous bounded by join_s: torch's own bound is the
    collective timeout (30 minutes on gloo) for a rank 0 that never answers. Collectives keep
    torch's default; the store gets it back once every rank is in."""
    collective = _collective_timeout(backend)
    join = datetime.timedelta(seconds=join_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=join))
    store.set_timeout(join)  # also bounds gloo's mesh and NCCL's id exchange inside init
    device_id = {"device_id": dev} if dev.type == "cuda" else {}
    # device_id starts the communicator now, not inside a CUDA-graph capture.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=collective, **device_id)
    store.set_timeout(collective)


def _collective_timeout(backend: str) -> datetime.timedelta:
    """torch's default for the backend, as init_process_group(timeout=None) picks it."""
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if backend == "nccl" and isinstance(nccl, datetime.timedelta):
        return nccl
    return constants.default_pg_timeout


JOIN_TIMEOUT_S = 300.0  # a slow multi-node start still meets; a rank alone fails in minutes
JOIN_TIMEOUT_ENV = "DRAFTSMITH_DIST_TIMEOUT"


def join_timeout() -> float:
    """Seconds a rank waits for the others at MASTER_ADDR:MASTER_PORT (DRAFTSMITH_DIST_TIMEOUT)."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    if not raw:
        return JOIN_TIMEOUT_S
    try:
        secs = float(raw)
    except ValueError:
        secs = math.nan
    if not (math.isfinite(secs) and secs > 0):
        raise DraftsmithError(f"environment variable {JOIN_TIMEOUT_ENV}={raw!r}: give seconds > 0 "
                              f"(default {JOIN_TIMEOUT_S:g})")
    return secs


def _unmet_line(rank: int, world: int, where: str, join_s: float, first: str) -> str:
    head = f"rank {rank} of {world} {UNMET} at {where}"
    if not re.search(r"time[sd]? ?out", first, re.IGNORECASE):
        return f"{head}: {first}"
    return (f"{head} (MASTER_ADDR:MASTER_PORT) within {join_s:g} s: {first.rstrip('.')}; "
            "start every rank with the same MASTER_ADDR and MASTER_PORT (rank 0 listens there), "
            f"or wait longer with {JOIN_TIMEOUT_ENV}=<seconds>")


UNMET = "could not join the process group"  # a rank's words where the ranks did not meet


def rendezvous() -> str:
    """MASTER_ADDR:MASTER_PORT, where rank 0 listens and every rank meets (torchrun sets both)."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    unset = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k, "").strip()]
    if unset:
        raise DraftsmithError(f"environment variable {' and '.join(unset)} not set: run under "
                              "torchrun, or set MASTER_ADDR and MASTER_PORT beside RANK and "
                              "WORLD_SIZE")
    port = _env_int("MASTER_PORT")
    if not 0 < port < 65536:
        raise DraftsmithError(f"environment variable MASTER_PORT={port}: a port is 1 to 65535")
    return f"{addr}:{port}"


def _tp_group(rank: int, world: int, size: int) -> Any:
    if size == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, size):  # every rank must create every group, in order
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- launching ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TRIES = 3  # launches on fresh ports when the one picked was taken before rank 0 bound it
TERM_S = 5.0  # how long a terminated rank may take to end before it is killed


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    device: str | None = "cpu",
    timeout_s: float | None = None,
) -> list[Any]:
    """Run fn(tp, *args) in nprocs fresh local processes (one TP group); results by rank.

    fn must be importable (a module-level function); args and results travel pickled. A
    DraftsmithError in any rank is raised here as one; other failures as RuntimeError.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise DraftsmithError(f"cannot spawn {nprocs!r} processes: give an integer >= 1")
    if timeout_s is not None and not timeout_s > 0:
        raise DraftsmithError(f"timeout_s={timeout_s!r}: give seconds > 0, or None for no limit")
    check_spawn_device(device, nprocs)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:  # a lambda, a local function, an open file among the args
        raise DraftsmithError(f"spawned ranks get fn and args pickled: {e} (give a module-level "
                              "function and picklable args)") from None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _launch(payload, nprocs, device, deadline, timeout_s)
        except PortTaken:  # free_port's port went to another process before rank 0 bound it
            if attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


def _launch(payload: bytes, nprocs: int, device: str | None, deadline: float | None,
            timeout_s: float | None) -> list[Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: queue.Queue = ctx.Queue()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs)}
    procs: list = []
    try:  # a Ctrl-C while ranks start ends those already started too
        for r in range(nprocs):
            procs.append(ctx.Process(target=_worker, args=(r, env, device, payload, results),
                                     daemon=True))
            procs[-1].start()
        return _collect(procs, results, deadline, timeout_s)
    finally:
        _end([p for p in procs if p.pid is not None])


def _end(procs: list) -> None:
    """Every rank ended: terminated, then killed where it outlives TERM_S (a SIGTERM handler, a
    rank stuck in a driver call), so a failed launch never waits on a rank that will not end."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(TERM_S)
        if p.is_alive():
            p.kill()
            p.join()


def _worker(rank: int, env: dict[str, str], device: str | None, payload: bytes, out) -> None:
    import multiprocessing as mp

    _exit_with(mp.parent_process().sentinel)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    n = int(env["WORLD_SIZE"])
    try:
        fn, args = pickle.loads(payload)
        tp = init_tp(n, device)
        if tp.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        result = fn(tp, *args)
        try:
            body = pickle.dumps(result)
        except Exception as e:
            raise DraftsmithError(f"{getattr(fn, '__qualname__', fn)} returned a "
                                  f"{type(result).__name__} that cannot travel back pickled: "
                                  f"{e}") from None
        out.put((rank, "ok", body))
    except PortTaken as e:
        out.put((rank, "port", str(e)))
    except DraftsmithError as e:
        out.put((rank, "draftsmith", str(e)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        # the message is in the pipe before the group's teardown, which may crash or hang, and
        # which ends the other ranks' collectives with errors that must not arrive first
        out.close()
        out.join_thread()
        shutdown()


def _exit_with(parent: int) -> None:
    """End this rank when the launcher dies (SIGKILL, an OOM kill: no finally runs there), rather
    than leave it waiting in a collective, holding its GPU, until the group's timeout."""
    from multiprocessing.connection import wait

    def watch() -> None:
        wait([parent])
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="draftsmith-parent-watch").start()


QUIET_S = 30.0  # how long a rank's result may trail its exit (the queue's feeder flushes)


GRACE_S = 1.0  # how long a rank's failure waits for the rank whose end may have caused it


def _collect(procs: list, results: queue.Queue, deadline: float | None,
             timeout_s: float | None) -> list[Any]:
    done: dict[int, Any] = {}
    quiet: dict[int, float] = {}  # rank -> when it was first seen ended with no result
    while len(done) < len(procs):
        if deadline is not None and time.monotonic() > deadline:
            left = sorted(set(range(len(procs))) - set(done))
            raise RuntimeError(f"spawned ranks {left} did not finish within {timeout_s} s")
        _check_quiet(procs, done, quiet)
        msg = _next_message(procs, results, done)
        if msg is None:
            continue
        rank, kind, body = msg
        if kind == "port":
            raise PortTaken(f"rank {rank}: {body}")
        if kind == "draftsmith":
            raise DraftsmithError(f"rank {rank}: {body}")
        if kind == "error":
            raise _first_cause(procs, results, done, rank, body)
        done[rank] = pickle.loads(body)
    return [done[r] for r in range(len(procs))]


def _first_cause(procs: list, results: queue.Queue, done: dict[int, Any], rank: int,
                 body: str) -> Exception:
    """A rank's failure in a collective often only echoes another rank's end (gloo: "Connection
    closed by peer"): a rank that died, or refused its input, within GRACE_S is named instead."""
    end = time.monotonic() + GRACE_S
    while True:
        dead = [i for i, p in enumerate(procs)
                if i != rank and i not in done and p.exitcode not in (None, 0)]
        if dead:
            last = body.strip().splitlines()[-1] if body.strip() else "?"
            return RuntimeError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}); "
                                f"rank {rank} then failed: {last}")
        left = end - time.monotonic()
        if left <= 0:
            return RuntimeError(f"rank {rank} failed:\n{body}")
        try:
            other, kind, text = results.get(timeout=min(0.1, left))
        except queue.Empty:
            continue
        if kind == "draftsmith":
            return DraftsmithError(f"rank {other}: {text}")


def _check_quiet(procs: list, done: dict[int, Any], quiet: dict[int, float]) -> None:
    """A rank that exited cleanly without a result (killed by a signal its handler swallowed, or
    `os._exit(0)`) would leave the launch waiting forever: its result gets QUIET_S to arrive."""
    now = time.monotonic()
    for i, p in enumerate(procs):
        if i not in done and p.exitcode == 0 and now - quiet.setdefault(i, now) > QUIET_S:
            raise RuntimeError(f"rank {i} exited (code 0) without a result")


def _next_message(procs: list, results: queue.Queue, done: dict[int, Any]) -> tuple | None:
    try:
        return results.get(timeout=1.0)
    except queue.Empty:
        pass
    dead = [i for i, p in enumerate(procs) if i not in done and p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})")
    return None


def launch_tp(fn: Callable[..., Any], tp_size: int, *args: Any, device: str | None = None) -> Any:
    """fn(tp, *args) over tp_size ranks: in this process under torchrun (every rank returns its
    own result), directly for tp_size 1, else spawned locally (rank 0's result comes back).

    device None: CUDA when this host has tp_size GPUs, else CPU (gloo).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise DraftsmithError(f"--tp must be >= 1, got {tp_size!r}")
    if under_torchrun() or tp_size == 1:
        return fn(init_tp(tp_size, device), *args)
    if device is None:
        device = "cuda" if torch.cuda.device_count() >= tp_size else "cpu"
    return spawn(fn, tp_size, *args, device=device)[0]


def check_spawn_device(device: str | None, nprocs: int) -> None:
    """Refused before any rank starts: spawned rank r runs on cuda:r, so a cuda:N (which the
    ranks would ignore) or fewer GPUs than ranks failed only after every rank had started."""
    if device not in (None, "auto", "cpu") and not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise DraftsmithError(f"device {device!r}: tensor parallelism runs on cpu or cuda")
    if not (device or "").startswith("cuda"):
        return
    if device != "cuda":
        raise DraftsmithError(f"--device {device} with --tp {nprocs}: spawned rank r runs on "
                              "cuda:r; give --device cuda")
    if (n := torch.cuda.device_count()) < nprocs:
        raise DraftsmithError(f"--tp {nprocs} on cuda needs {nprocs} CUDA devices, one a "
                              f"rank; {n} visible")
