"""`serve --frontends N`: the HTTP side in N processes of its own, the engine in this one.

In one process the event loop (uvicorn, Starlette and FastAPI per request, the OpenAI bodies,
the chat template) held the GIL in 80 % of py-spy's samples of the null server and the batch
loop in 14 % (`benchmarks/serve_cpu.md`); on the H200 that process sat at one full core and
delivered 9,000-11,000 tok/s compiled at 32 rows, where the engine alone decodes ~26,000
(`benchmarks/serve_h200.md`). vLLM and SGLang keep their HTTP servers out of the engine loop's
process, and so does this: each frontend process runs the same FastAPI app on the one listening
socket (the kernel hands each connection to one of them), parses and tokenizes requests there,
and talks to this process's scheduler over a pipe of its own. The engine process keeps the batch
loop, detokenization and stop strings (they decide when a row frees its slot).

Messages (pickled over `multiprocessing.connection` socket pairs; a frontend's first message is
its settings). Frontend to engine: ("ready",), ("submit", jid, GenRequest), ("cancel", jid),
("count", {name: n}), ("status", qid). Engine to frontend: a list of (jid, event) in the order
the scheduler emitted them, where a None jid carries ("status", qid, status).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from draftsmith.errors import DraftsmithError
from draftsmith.serve.jobs import Job
from draftsmith.serve.protocol import ApiError, ServeConfig

if TYPE_CHECKING:  # the frontend processes import this module without torch
    from draftsmith.serve.scheduler import Scheduler

STATUS_WAIT_S = 5.0  # a frontend's wait for the engine's /health and /metrics answer
START_WAIT_S = 300.0  # for every frontend process to import, load its tokenizer and listen
GONE = "the engine process is gone"


class Interrupted(Exception):
    """SIGINT or SIGTERM came while the frontends started."""


# ---- the engine process's end ------------------------------------------------------------------


class _Outbox:
    """Messages to one frontend, sent by a thread of their own: the batch loop only appends, and
    whatever piled up while a send ran goes in the next one. `first` (the frontend's settings)
    goes before all of them, so no start waits for a frontend to read it; it comes pickled, once
    for every frontend (the tokenizer is the bulk of it)."""

    def __init__(self, conn: Connection, first: bytes | None = None) -> None:
        self.conn, self.cv, self.first = conn, threading.Condition(), first
        self.items: list[tuple] = []
        self.closed = False

    def put(self, item: tuple) -> None:
        with self.cv:
            if not self.closed:
                self.items.append(item)
                self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()

    def run(self) -> None:
        try:
            if self.first is not None:
                self.conn.send_bytes(self.first)
            while True:
                with self.cv:
                    self.cv.wait_for(lambda: self.items or self.closed)
                    if not self.items:
                        return
                    items, self.items = self.items, []
                self.conn.send(items)
        except (OSError, ValueError):  # the frontend is gone; its reader cleans up
            pass
        except Exception:  # noqa: BLE001 (an event that does not pickle: a bug, shown)
            traceback.print_exc()
        finally:
            self.close()
            self.conn.close()  # the frontend sees EOF and fails its waiting requests


class EngineLink:
    """The scheduler's side of the frontends' pipes: a reader and a sender thread for each."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._jobs: dict[tuple[int, int], Job] = {}
        self._outs: dict[int, _Outbox] = {}
        self._lock = threading.Lock()
        self._ready = threading.Condition()
        self.ready: set[int] = set()
        self.gone: set[int] = set()
        self.submitted: collections.Counter[int] = collections.Counter()  # requests by frontend
        self._threads: list[threading.Thread] = []

    def attach(self, fid: int, conn: Connection, first: bytes | None = None) -> None:
        out = self._outs[fid] = _Outbox(conn, first)
        for name, fn in (("out", out.run), ("in", partial(self._read, fid, conn))):
            t = threading.Thread(target=fn, name=f"draftsmith-{name}-{fid}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait_ready(self, fids: set[int], timeout: float,
                   stop: threading.Event | None = None) -> bool:
        """Every frontend in `fids` is ready or gone; False on timeout or once `stop` is set."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while not fids <= self.ready | self.gone:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._ready.wait(min(left, 0.2))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop sending; wait for the threads (the frontends are gone: their reads end), so none
        is still in native code (a tokenizer's pickle) when the interpreter exits."""
        for out in self._outs.values():
            out.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _read(self, fid: int, conn: Connection) -> None:
        try:
            while True:
                msg = conn.recv()
                try:
                    self._handle(fid, msg)
                except Exception as e:  # noqa: BLE001 (one bad message fails its request only)
                    traceback.print_exc()
                    if msg[0] == "submit":
                        self._emit(fid, msg[1], ("error", 500,
                                                 f"internal error: {type(e).__name__}: {e}"))
        except (EOFError, OSError):
            pass
        finally:
            with self._lock:  # their clients went with the frontend
                gone = [self._jobs.pop(k) for k in list(self._jobs) if k[0] == fid]
            for job in gone:
                job.cancelled = True
            self._outs[fid].close()
            with self._ready:
                self.gone.add(fid)
                self._ready.notify_all()

    def _handle(self, fid: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            self._submit(fid, msg[1], msg[2])
        elif kind == "cancel":  # the frontend forgot it: a queued job is dropped unannounced
            with self._lock:
                job = self._jobs.pop((fid, msg[1]), None)
            if job is not None:
                job.cancelled = True
        elif kind == "count":
            self.sched.count(**msg[1])
        elif kind == "status":
            self._outs[fid].put((None, ("status", msg[1], self.status())))
        elif kind == "ready":
            with self._ready:
                self.ready.add(fid)
                self._ready.notify_all()

    def status(self) -> dict[str, Any]:
        """The scheduler's, plus the requests each frontend took (how the kernel spread them)."""
        st = self.sched.status()
        with self._lock:
            took = [self.submitted[f] for f in sorted(self._outs)]
        return {**st, "metrics": {**st["metrics"], "frontend_requests": took}}

    def _submit(self, fid: int, jid: int, req: Any) -> None:
        job = Job(req, partial(self._emit, fid, jid))
        with self._lock:
            self._jobs[(fid, jid)] = job
            self.submitted[fid] += 1
        try:
            self.sched.submit(job)
        except ApiError as e:
            self._emit(fid, jid, ("error", e.status, e.message, e.param, e.code, e.kind))

    def _emit(self, fid: int, jid: int, event: tuple) -> None:
        if event[0] in ("done", "error"):
            with self._lock:
                self._jobs.pop((fid, jid), None)
        self._outs[fid].put((jid, event))


class Frontends:
    """The engine's scheduler in this process and `n` frontend processes on one socket."""

    def __init__(self, engine: Any, cfg: ServeConfig, n: int, host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning",
                 sock: socket.socket | None = None) -> None:
        if n < 1:
            raise DraftsmithError(f"--frontends {n}: use 1 or more (0 serves in one process)")
        self.engine, self.n, self.host, self.port, self.log_level = engine, n, host, port, log_level
        from draftsmith.serve.scheduler import Scheduler

        self.cfg = dataclasses.replace(cfg, info={**cfg.info, "frontends": n})
        self.sched = Scheduler(engine, cfg.max_queue, continuous=cfg.continuous)
        self.link = EngineLink(self.sched)
        self.procs: list[Any] = []
        self.sock: socket.socket | None = sock  # given: already listening (serve's CLI binds it)
        self._tuned = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = START_WAIT_S,
              stop: threading.Event | None = None) -> Frontends:
        """Listen, start the scheduler and the frontends; returns when all of them are ready
        (raises `Interrupted` if `stop` is set first)."""
        from draftsmith.serve.app import _TUNING

        if self.sock is None:
            self.sock = listen(self.host, self.port)
        self.port = self.sock.getsockname()[1]
        _TUNING.enter()
        self._tuned = True
        self.sched.start()
        first = ForkingPickler.dumps(  # what `conn.send` would pickle, for each frontend
            (self.engine.text_side, self.cfg, self.log_level))
        try:
            for fid in range(self.n):
                conn, proc = _spawn(self.sock)
                self.procs.append(proc)
                self.link.attach(fid, conn, first)
            up = self.link.wait_ready(set(range(self.n)), timeout, stop)
        except BaseException:
            self.stop()
            raise
        if stop is not None and stop.is_set():
            self.stop()
            raise Interrupted
        if not up or self.link.gone:
            self.stop()
            raise DraftsmithError(f"{self.n} frontend process(es) did not all start in "
                                  f"{timeout:.0f} s (see their messages above)")
        return self

    def stop(self) -> None:
        from draftsmith.serve.app import _TUNING, _stop_serving

        # queued jobs answered (503) now and the running ones given their time while the
        # frontends drain: they wait for their connections, which once waited for the whole queue
        stopper = threading.Thread(target=_stop_serving, args=(self.sched, ""), daemon=True)
        if self.sched.alive:
            stopper.start()
        for p in self.procs:
            p.terminate()  # uvicorn's own graceful shutdown on SIGTERM
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = []
        if stopper.is_alive():
            stopper.join()
        self.link.close()
        if self.sched.alive:
            self.sched.stop()
        if self._tuned:
            self._tuned = False
            _TUNING.exit()
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> Frontends:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Start, and serve until SIGINT or SIGTERM, or until no frontend is left (the signals'
        handlers come first: the first frontend up answers while the others start)."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            self.start(stop=stop)
        except Interrupted:
            return
        try:
            while not stop.wait(0.5):
                if died := [p for p in self.procs if p.poll() is not None]:
                    for p in died:
                        print(f"draftsmith serve: frontend process {p.pid} exited "
                              f"({p.returncode})", file=sys.stderr)
                        self.procs.remove(p)
                    if not self.procs:
                        raise DraftsmithError("every frontend process exited")
        finally:
            self.stop()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening (for port 0, on the free port the system gave):
    bound once, so the port the server announces is the one it serves on. A port out of range,
    an unknown host or a taken port is refused by name."""
    if not 0 <= port <= 65535:
        raise DraftsmithError(f"--port {port}: use 0-65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DraftsmithError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise DraftsmithError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# ---- a frontend process's end ------------------------------------------------------------------


class RemoteScheduler:
    """A frontend's stand-in for the engine's `Scheduler`: the app's calls go over the pipe and
    the jobs' events come back through it. The 503s it answers itself once the engine process is
    gone (`GONE`: a refused submit, the jobs the lost link ends) are this frontend's own count,
    /metrics' `engine_gone` (the engine's counters lived in that process; each frontend shows
    its own, 0 in the engine's), also said on stderr as the frontend stops. A frontend never
    sends a forced quit's 503 (`app._cut_off`): the engine process ends it (SIGTERM, then
    SIGKILL after 15 s), so nothing is counted then.
    Its /health reads the engine's `stopping`, a 503 while a stop drains the engine's batch."""

    def __init__(self, conn: Connection, on_lost: Any = None) -> None:
        self.conn, self.on_lost = conn, on_lost
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._jobs: dict[int, Job] = {}
        self._jid: dict[int, int] = {}  # id(job) -> its jid, while it runs
        self._replies: dict[int, list] = {}
        self.lost = False
        self._gone_lock = threading.Lock()
        self.gone = 0  # requests answered 503 GONE here: /metrics' `engine_gone`

    def start(self) -> None:
        threading.Thread(target=self._read, name="draftsmith-link", daemon=True).start()
        self._send(("ready",))

    def stop(self) -> None:
        self.conn.close()

    def submit(self, job: Job) -> None:
        jid = next(self._ids)
        self._jobs[jid], self._jid[id(job)] = job, jid
        if not self._try_send(("submit", jid, job.req)):
            if self._forget(jid):  # else the lost link's sweep took (and counted) it
                self._count_gone(1)
            raise ApiError(503, GONE, code="unavailable")

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        jid = self._jid.get(id(job))
        if jid is not None and self._forget(jid):
            self._try_send(("cancel", jid))

    def count(self, **kv: int) -> None:
        self._try_send(("count", kv))

    status_waits = True  # on the engine process's answer: the app calls it off its event loop

    def status(self) -> dict[str, Any]:
        qid, done = next(self._ids), threading.Event()
        self._replies[qid] = [done, None]
        if not self.lost and self._try_send(("status", qid)):
            done.wait(STATUS_WAIT_S)
        got = self._replies.pop(qid)[1] or {"alive": False, "queued": 0, "metrics": {}}
        m = got["metrics"]
        if self.gone or "engine_gone" in m:
            got = {**got, "metrics": {**m, "engine_gone": m.get("engine_gone", 0) + self.gone}}
        return got

    def _count_gone(self, n: int) -> None:
        with self._gone_lock:
            self.gone += n

    def _forget(self, jid: int) -> bool:
        job = self._jobs.pop(jid, None)
        if job is not None:
            self._jid.pop(id(job), None)
        return job is not None

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _try_send(self, msg: tuple) -> bool:
        try:
            self._send(msg)
        except (OSError, ValueError):
            return False
        return True

    def _read(self) -> None:
        try:
            while True:
                for jid, event in self.conn.recv():
                    self._deliver(jid, event)
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 (a bug: shown, and the link closed, not left hanging)
            traceback.print_exc()
        self.lost = True
        self.conn.close()
        failed = [job for jid, job in list(self._jobs.items()) if self._forget(jid)]
        self._count_gone(len(failed))  # each once: a submit failing now forgets its own
        for job in failed:
            job.emit(("error", 503, GONE, None, "unavailable"))  # as a refused submit
        for done, _ in list(self._replies.values()):
            done.set()
        if self.on_lost is not None:
            self.on_lost()
        if failed:
            print(f"draftsmith serve: frontend {os.getpid()}: {GONE}: {len(failed)} waiting "
                  "request(s) answered 503", file=sys.stderr)

    def _deliver(self, jid: int | None, event: tuple) -> None:
        if jid is None:  # ("status", qid, status)
            if (slot := self._replies.get(event[1])) is not None:
                slot[1] = event[2]
                slot[0].set()
            return
        job = self._jobs.get(jid)
        if job is None:  # cancelled here already
            return
        if event[0] in ("done", "error"):
            self._forget(jid)
        job.emit(event)


def _spawn(sock: socket.socket) -> tuple[Connection, subprocess.Popen]:
    """A frontend process (`python -m draftsmith.serve.frontends`: a fresh interpreter that
    imports neither torch nor the caller's main module, as multiprocessing's spawn would),
    given the listening socket and its end of a socket pair (its settings come as the pair's
    first message)."""
    mine, theirs = socket.socketpair()
    with theirs:
        fds = (sock.fileno(), theirs.fileno())
        proc = subprocess.Popen([sys.executable, "-m", "draftsmith.serve.frontends",
                                 *map(str, fds)], pass_fds=fds)
    return Connection(mine.detach()), proc


def _frontend(sock: socket.socket, conn: Connection) -> None:
    """A frontend process: the app over a `RemoteScheduler`, serving on the shared socket until
    SIGTERM or until the engine process is gone."""
    import uvicorn

    from draftsmith.serve.app import create_app

    texts, cfg, log_level = conn.recv()

    box: dict[str, Any] = {}

    def lost() -> None:
        if "server" in box:
            box["server"].should_exit = True

    sched = RemoteScheduler(conn, on_lost=lost)
    app = create_app(texts, cfg, sched)
    box["server"] = server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    server.run(sockets=[sock])


if __name__ == "__main__":
    # the engine process stops its frontends (SIGTERM); a Ctrl-C to the whole process group
    # during their start would only print their import's traceback (uvicorn, serving, handles
    # both signals itself)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _frontend(socket.socket(fileno=int(sys.argv[1])), Connection(int(sys.argv[2])))
