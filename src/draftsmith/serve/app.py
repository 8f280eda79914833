"""The FastAPI app: OpenAI-compatible routes over one `Scheduler`.

Routes: POST /v1/chat/completions, POST /v1/completions (both also as SSE streams), GET
/v1/models, /v1/models/{id}, /health, /metrics. Every error is OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import inspect
import json
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from draftsmith.errors import DraftsmithError
from draftsmith.serve import protocol as P
from draftsmith.serve.jobs import Job
from draftsmith.switches import env_count, env_flag

if TYPE_CHECKING:
    from draftsmith.serve.engine import ServeEngine
    from draftsmith.serve.scheduler import Scheduler

MAX_BODY = 16 << 20  # a request body's limit where the config sets none (--max-body's default)
STOP_WAIT_S = 10.0  # a running batch's time to end once the server stops
# The GIL's switch interval while a server runs, in microseconds (0: Python's own, 5,000). The
# batch loop gives up the GIL at every GPU sync and must win it back from the HTTP threads; under
# load each win can wait a whole interval.
SWITCH_US = env_count("DRAFTSMITH_SERVE_SWITCH_US", "0")
# Freeze what exists when the server starts (model, tokenizer, compiled graphs) out of the
# cyclic GC: every full collection walked them all, stopping the batch loop with the rest
# (serve_host on the 2-core CPU, continuous: 1.50 s of GC a run, 0.17-0.40 s frozen;
# benchmarks/serve_cpu.md).
GC_FREEZE = env_flag("DRAFTSMITH_SERVE_GC_FREEZE", "1")
# FastAPI's own OpenTelemetry hooks (fastapi >= 0.16x) look up the global providers on every
# request: 7 % of the GIL's samples in serve_host (py-spy --gil). Off unless asked for; the
# server's own counters are at /metrics.
OTEL = env_flag("DRAFTSMITH_SERVE_OTEL", "0")


class _ProcessTuning:
    """The GC freeze and the switch interval are the whole process's: set when its first server
    starts, undone when its last one stops (servers overlap in tests and benchmarks)."""

    def __init__(self) -> None:
        self.lock, self.live, self.switch = threading.Lock(), 0, 0.005

    def enter(self) -> None:
        with self.lock:
            self.live += 1
            if self.live > 1:
                return
            self.switch = sys.getswitchinterval()
            if SWITCH_US:
                sys.setswitchinterval(SWITCH_US / 1e6)
            if GC_FREEZE:
                gc.collect()
                gc.freeze()

    def exit(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live:
                return
            if GC_FREEZE:
                gc.unfreeze()
            sys.setswitchinterval(self.switch)


_TUNING = _ProcessTuning()


def create_app(engine: ServeEngine | Any, cfg: P.ServeConfig, sched: Any = None) -> FastAPI:
    """The app over `engine`'s scheduler, or over `sched` (a frontend process's
    `frontends.RemoteScheduler`, with the engine's text side as `engine`)."""
    if sched is None:
        from draftsmith.serve.scheduler import Scheduler

        sched = Scheduler(engine, cfg.max_queue, continuous=cfg.continuous)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        _TUNING.enter()
        forced = False
        try:
            sched.start()
            try:
                yield
            except asyncio.CancelledError:  # a forced quit (ctrl-C twice): no traceback
                forced = True
        finally:
            try:
                if forced:  # the loop is closing: the worker ends at its next look
                    sched.stop(0)
                else:
                    await run_in_threadpool(sched.stop)
            finally:
                _TUNING.exit()

    extra: dict[str, Any] = {}
    if not OTEL and "telemetry" in inspect.signature(FastAPI).parameters:
        extra["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None, **extra)
    app.state.scheduler, app.state.engine, app.state.config = sched, engine, cfg
    _errors(app, sched)
    _auth(app, cfg)
    _info_routes(app, engine, cfg, sched)
    _generation_routes(app, engine, cfg, sched)
    return app


def _error(status: int, body: dict[str, Any],
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _errors(app: FastAPI, sched: Scheduler) -> None:
    @app.exception_handler(P.ApiError)
    async def api_error(_: Request, e: P.ApiError) -> JSONResponse:
        if e.status < 500:
            sched.count(rejected=1)
        return _error(e.status, e.body())

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        # a 405's Allow header (RFC 9110) kept
        return _error(e.status_code, P.error_body(str(e.detail), "invalid_request_error"),
                      getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def any_error(_: Request, e: Exception) -> JSONResponse:
        msg = f"internal error: {type(e).__name__}: {e}"
        return _error(500, P.error_body(msg, "server_error"))


def _auth(app: FastAPI, cfg: P.ServeConfig) -> None:
    if not cfg.api_key:
        return
    want = f"Bearer {cfg.api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        got = request.headers.get("authorization", "").encode()
        if request.url.path.startswith("/v1") and not hmac.compare_digest(got, want):
            body = P.error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                "invalid_request_error", code="invalid_api_key")
            return _error(401, body)
        return await call_next(request)


def _model_card(engine: ServeEngine, cfg: P.ServeConfig) -> dict[str, Any]:
    return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "draftsmith",
            "max_model_len": engine.max_len, "draftsmith": cfg.info}


def _info_routes(app: FastAPI, engine: ServeEngine, cfg: P.ServeConfig, sched: Scheduler) -> None:
    async def status() -> dict:  # a frontend's waits on the engine process: off the loop
        return await run_in_threadpool(sched.status) if sched.status_waits else sched.status()

    @app.get("/health")
    async def health() -> JSONResponse:
        st = await status()
        if st.get("stopping"):  # as SGLang's while it shuts down: a balancer routes elsewhere
            return _error(503, {"status": "stopping", "reason": P.STOPPING, "model": cfg.model_name,
                                "queued": st["queued"]})
        if not st["alive"]:
            return _error(503, {"status": "error", "reason": "the engine worker is not running"})
        return JSONResponse({"status": "ok", "model": cfg.model_name, "queued": st["queued"]})

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        st = await status()
        return JSONResponse({**st["metrics"], "model": cfg.model_name, **cfg.info})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(engine, cfg)]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if not cfg.knows(model):
            raise P.ApiError(404, f"The model '{model}' does not exist", "model",
                             "model_not_found")
        return JSONResponse(_model_card(engine, cfg))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n:,} bytes"


def _too_large(limit: int) -> P.ApiError:
    return P.ApiError(413, f"the request body is over {_size(limit)} (the server's --max-body); "
                      "send a smaller one", None, "body_too_large")


async def _body(request: Request, cfg: P.ServeConfig) -> bytearray:
    """The raw body, refused (413) past the limit before it is all read."""
    limit = cfg.max_body or MAX_BODY
    size = request.headers.get("content-length", "0")
    if not size.isdigit() or int(size) > limit:
        raise _too_large(limit)
    raw = bytearray()
    async for part in request.stream():  # a chunked body has no content-length to check
        raw += part
        if len(raw) > limit:
            raise _too_large(limit)
    return raw


def _json(raw: bytes | bytearray) -> Any:
    """The decoded body; called off the event loop (16 MiB of JSON takes ~0.2 s)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise P.ApiError(400, "the request body is not valid JSON: it nests arrays or objects "
                         "too deeply", None, "invalid_json") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer of over 4,300 digits
        raise P.ApiError(400, f"the request body is not valid JSON: {e}", None,
                         "invalid_json") from None


def _parsed(parse: Any, raw: bytearray, cfg: P.ServeConfig, engine: Any) -> P.GenRequest:
    return parse(_json(raw), cfg, engine)


def _generation_routes(app: FastAPI, engine: ServeEngine, cfg: P.ServeConfig,
                       sched: Scheduler) -> None:
    async def serve(request: Request, req: P.GenRequest):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        job = Job(req, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        sched.submit(job)
        request.scope[_JOB] = job  # queued: a forced quit counts it through its end (`quiet`)
        # a client that leaves while queued or waiting for a whole answer frees its rows
        # (a stream's own disconnect watch takes over once it starts)
        gone = asyncio.ensure_future(_until_gone(request))
        try:
            # the first event: ("accepted",) once queued (a stream answers 200 then, as vLLM's
            # does, while a refusal before it keeps its own status), else a refusal
            first = await _next(q, gone)
            if first[0] == "error":
                raise P.ApiError(*first[1:])
            if req.stream:
                first = _unstarted(q, first)
                return StreamingResponse(_sse(req, job, q, first, cfg.fingerprint, sched,
                                              request.scope),
                                         media_type="text/event-stream")
            return JSONResponse(await _collect(req, q, first, cfg.fingerprint, gone))
        except (asyncio.CancelledError, _Gone):
            left = gone.done() and not gone.cancelled()  # the client left (not a forced quit)
            _drop(sched, job, request.scope, left)
            if left:
                return Response(status_code=499)
            raise
        finally:
            gone.cancel()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await _body(request, cfg)
        return await serve(request, await run_in_threadpool(_parsed, P.parse_chat, raw, cfg,
                                                            engine))

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await _body(request, cfg)
        return await serve(request, await run_in_threadpool(_parsed, P.parse_completion, raw,
                                                            cfg, engine))


def _unstarted(q: asyncio.Queue, first: tuple) -> tuple:
    """A stream's first event among those already come (before its 200 goes out): one that
    refuses it (the server stopped while it was queued) is its HTTP status, not an event."""
    while first[0] == "accepted" and not q.empty():
        first = q.get_nowait()
    if first[0] == "error":
        raise P.ApiError(*first[1:])
    return first


class _Gone(Exception):
    """The client closed its connection."""


async def _until_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(q: asyncio.Queue, gone: asyncio.Future) -> tuple:
    """The job's next event, or _Gone once its client has left."""
    get = asyncio.ensure_future(q.get())
    try:
        await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        return get.result()
    raise _Gone


async def _collect(req: P.GenRequest, q: asyncio.Queue, ev: tuple, fingerprint: str,
                   gone: asyncio.Future) -> dict[str, Any]:
    choices = [P.Choice() for _ in range(req.rows)]
    while ev[0] != "done":
        if ev[0] == "error":
            raise P.ApiError(*ev[1:])
        if ev[0] == "finish":
            choices[ev[1]] = ev[2]
        ev = await _next(q, gone)
    return P.response(req, choices, fingerprint)


# characters str.splitlines() ends a line at (httpx's iter_lines, httpx-sse) that JSON leaves raw
_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _sse_line(obj: dict[str, Any]) -> str:
    line = json.dumps(obj, ensure_ascii=False)
    if "\u2028" in line or "\u2029" in line or "\x85" in line:
        line = line.translate(_BREAKS)
    return f"data: {line}\n\n"


async def _sse(req: P.GenRequest, job: Job, q: asyncio.Queue, ev: tuple,
               fingerprint: str, sched: Any, scope: dict) -> AsyncIterator[str]:
    """OpenAI's chunk stream; deltas come as the engine produces them (per step or cycle). The
    200 goes out at once; a chat choice's role chunk with its first output, as vLLM and SGLang
    send it: benchmark clients (vLLM's benchmark_serving) time the first token from the first
    chunk holding choices, so a role chunk sent while queued read as a first token at once."""
    done = False
    fresh = [True] * req.rows  # each choice's first chunk (return_token_ids: its prompt's ids)
    try:
        while True:
            kind = ev[0]
            if kind in ("delta", "finish") and req.kind == "chat" and fresh[ev[1]]:
                yield _sse_line(P.chunk(req, ev[1], None, role=True, fingerprint=fingerprint,
                                        first=True))
                fresh[ev[1]] = False
            if kind in ("delta", "finish"):
                first, fresh[ev[1]] = fresh[ev[1]], False
            if kind == "delta":  # with return_token_ids: (.., text, ids)
                yield _sse_line(P.chunk(req, ev[1], ev[2], fingerprint=fingerprint,
                                        ids=ev[3] if len(ev) > 3 else None, first=first))
            elif kind == "finish":
                yield _sse_line(P.chunk(req, ev[1], None, ev[2].finish_reason,
                                        fingerprint=fingerprint, ids=ev[2].ids, first=first))
            elif kind == "done":
                if req.include_usage:
                    yield _sse_line(P.usage_chunk(req, ev[1], fingerprint))
                break
            elif kind == "accepted":
                pass
            else:
                yield _sse_line(P.ApiError(*ev[1:]).body())
                break
            ev = await q.get()
        done = True
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            _drop(sched, job, scope, False)


_CUT = "draftsmith.cut_off"  # a request's scope key: the forced quit's hook (`_server`'s wrapper)
_JOB = "draftsmith.job"  # a request's scope key: its job, once queued


def _drop(sched: Any, job: Job, scope: dict, left: bool) -> None:
    """Stop `job`, whose request ends unanswered: its client left (counted cancelled), or the
    task was cancelled, which under a forced quit `_server`'s wrapper answers 503 and counts as
    stopped (its hook takes the job)."""
    cut = scope.get(_CUT)
    if left or cut is None or not cut(job):
        sched.cancel(job)


def run_server(engine: ServeEngine, cfg: P.ServeConfig, host: str, port: int,
               log_level: str = "info", frontends: int = 0, sock: Any = None) -> None:
    """Serve until interrupted: HTTP in this process, or in `frontends` processes of its own; on
    `sock` where given (bound and listening: the port announced is the one served on)."""
    if frontends:
        from draftsmith.serve.frontends import Frontends

        Frontends(engine, cfg, frontends, host, port, log_level, sock=sock).serve_forever()
        return
    where = {} if sock is not None else {"host": host, "port": port}
    server = _server(create_app(engine, cfg), log_level=log_level, **where)
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: ctrl-C ends it quietly
        server.run(sockets=None if sock is None else [sock])
    if not server.started:
        raise DraftsmithError("the server did not start (see uvicorn's log above)")


def _server(app: FastAPI, **config: Any) -> Any:
    """uvicorn's server over `app`, whose first SIGINT or SIGTERM also stops the scheduler:
    queued requests get a 503 at once and the running batch `Scheduler.stop`'s timeout, so the
    connections uvicorn waits for end (it once waited for the whole queue, until a second ctrl-C
    cut everything off with a traceback for each request). A second ctrl-C forces the quit,
    quietly."""
    import uvicorn

    sched = app.state.scheduler

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            stopping, forced = self.should_exit, self.force_exit
            super().handle_exit(sig, frame)
            if not stopping:
                threading.Thread(target=_stop_serving, args=(sched,), name="draftsmith-stop",
                                 daemon=True).start()
            elif self.force_exit and not forced:
                print("draftsmith serve: forced quit: requests still running are cut off",
                      file=sys.stderr)

    async def quiet(scope: Any, receive: Any, send: Any) -> None:
        """`app`, answering the requests a forced quit cancels (uvicorn printed a traceback
        for each) with a 503, or a stream with its error event."""
        head: list[dict] = []

        def cut(job: Job) -> bool:
            """A job whose request a forced quit cancels: stopped, counted (`Scheduler.cut_off`)."""
            if not server.force_exit:
                return False
            sched.cut_off(job)
            return True

        if scope["type"] == "http":
            scope[_CUT] = cut

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                head.append(message)
            await send(message)

        try:
            await app(scope, receive, sending if scope["type"] == "http" else send)
        except asyncio.CancelledError:
            if not server.force_exit or scope["type"] != "http":
                raise
            if (job := scope.get(_JOB)) is not None:
                # counted once (`Job.end`): a job that completed before its reply went out
                # stays completed
                sched.cut_off(job)
            elif not head:  # cut off before its job was queued: a stop's 503 all the same
                sched.count(stopped=1)
            await _cut_off(head, send)

    server = Server(uvicorn.Config(quiet, **config))
    return server


async def _cut_off(head: list[dict], send: Any) -> None:
    """A forced quit's answer to a cancelled request: a 503, or a started stream's error event
    and [DONE]. `quiet` counts it in /metrics' `stopped` (its job's `Scheduler.cut_off`, so the
    worker does not count it cancelled too); only a one-process server sends it."""
    error = P.error_body("the server was stopped (forced quit)", "server_error", None,
                         "unavailable")
    if not head:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})
        return
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
              for k, v in head[0].get("headers", []))
    end = (_sse_line(error) + "data: [DONE]\n\n").encode() if sse else b""
    await send({"type": "http.response.body", "body": end, "more_body": False})


def _stop_serving(sched: Any, hint: str = " (ctrl-C again cuts them off)") -> None:
    """The scheduler stopped as a signal stops the server, saying what that does."""
    if queued := sched.queued():
        print(f"draftsmith serve: stopping: {queued} queued request(s) answered 503, running "
              f"ones given {STOP_WAIT_S:.0f} s{hint}", file=sys.stderr)
    sched.stop(STOP_WAIT_S)
