"""`draftsmith serve`: the typer command (registered by `draftsmith.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from draftsmith.errors import DraftsmithError
from draftsmith.options import (
    COMPILE,
    DEVICE,
    DTYPE,
    TARGET,
    at_least_one,
    check_chain_tokens,
    given,
    unused,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# serve --frontends by default: on the H200's 16-core host four HTTP processes gave the compiled
# 32-row server 1.26-1.54x the tok/s of one process (benchmarks/serve_h200.md); on a host of a
# few cores they would take the cores the batch loop and the clients need
AUTO_FRONTENDS, AUTO_FRONTENDS_CPUS = 4, 8
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def auto_frontends(device: str, cpus: int | None = None) -> int:
    """--frontends when not given: AUTO_FRONTENDS on a GPU host of AUTO_FRONTENDS_CPUS cores or
    more, else 0 (HTTP in the engine's process)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return AUTO_FRONTENDS if device != "cpu" and cpus >= AUTO_FRONTENDS_CPUS else 0


def serve(
    target: str = TARGET,
    drafter: Path = typer.Option(None, "--drafter", help="A draftsmith drafter folder: "
                                 "speculative decoding (baseline decoding without it)"),
    steps: int = typer.Option(3, "--steps", help="Draft steps per cycle"),
    topk: int = typer.Option(1, "--topk", help="1 = chain; > 1 = EAGLE-2 tree"),
    num_draft_tokens: int = typer.Option(None, "--num-draft-tokens",
                                         help="Tokens verified per cycle (tree; chain: steps+1)"),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="TCP port to listen on"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    max_batch: int = typer.Option(8, "--max-batch", help="Rows in one engine batch"),
    max_tokens_limit: int = typer.Option(1024, "--max-tokens-limit",
                                         help="Largest max_tokens a request may ask for"),
    max_prompt_tokens: int = typer.Option(2048, "--max-prompt-tokens",
                                          help="Longest prompt (after the chat template)"),
    max_queue: int = typer.Option(256, "--max-queue", help="Queued requests before 429"),
    max_body: int = typer.Option(16, "--max-body", help="Largest request body in MiB (a "
                                 "larger one is refused with 413 before it is read whole)"),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model id clients use (default: the target's)"),
    api_key: str = typer.Option(None, "--api-key", envvar="DRAFTSMITH_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on /v1"),
    warmup: bool = typer.Option(None, "--warmup/--no-warmup",
                                help="Run every batch size once before serving (default: on GPU)"),
    warm_sampling: str = typer.Option(
        "temperature", "--warm-sampling",
        help="Kinds of sampled decoding the warm-up captures besides greedy, comma-separated: "
             "temperature (any temperature, no top-k/top-p/top-n-sigma), filtered (top-k, top-p "
             "or top_n_sigma), or "
             "none; a kind not warmed captures its graphs on its first request (none are warmed "
             "under DRAFTSMITH_SAMPLED_DRAFTS=drawn, where each setting has its own)"),
    continuous: bool = typer.Option(True, "--continuous/--static-batches",
                                    help="A row whose answer ended takes the next queued "
                                         "request the batch holds (static: a batch runs until "
                                         "its last row ends)"),
    fixed_rows: bool = typer.Option(
        False, "--fixed-rows",
        help="Open every batch (seeded ones too) at --max-batch rows: decode then never "
             "changes row count with the load (the row count picks the kernels; in bf16 that "
             "can flip near-ties), at the cost of a lone request decoding in a full batch"),
    frontends: int = typer.Option(
        None, "--frontends",
        help="HTTP processes in front of the engine's (parsing, tokenizing, the OpenAI "
             "bodies); 0: HTTP in the engine's own process, sharing its GIL with the batch "
             f"loop (default: {AUTO_FRONTENDS} on a GPU host of {AUTO_FRONTENDS_CPUS}+ cores, "
             "else 0)"),
    compile: bool = COMPILE,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's: critical, error, "
                                  "warning, info, debug or trace"),
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API (speculative with --drafter)."""
    try:
        from draftsmith.serve.app import run_server
    except ModuleNotFoundError as e:
        raise DraftsmithError(
            f"draftsmith serve needs {e.name}: pip install 'draftsmith[serve]' "
            "(fastapi, uvicorn)") from None
    from draftsmith.bench.run import check_topk
    from draftsmith.cli import device_dtype
    from draftsmith.models.eagle3 import check_drafter
    from draftsmith.options import check_compile
    from draftsmith.serve.engine import EngineConfig, load_engine

    at_least_one({"--max-batch": max_batch, "--max-tokens-limit": max_tokens_limit,
                  "--max-prompt-tokens": max_prompt_tokens, "--max-queue": max_queue,
                  "--max-body": max_body, "--steps": steps, "--topk": topk})
    if (log_level := log_level.lower()) not in LOG_LEVELS:
        raise DraftsmithError(f"--log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    if frontends is not None and frontends < 0:
        raise DraftsmithError(f"--frontends must be >= 0 (0: HTTP in the engine's process), got "
                              f"{frontends}")
    dev, dt = device_dtype(device, dtype)
    spec = given(serve, steps=steps, topk=topk, num_draft_tokens=num_draft_tokens)
    if drafter is None and spec:
        raise DraftsmithError(f"{', '.join(spec)} without --drafter: settings of speculative "
                              "decoding; give --drafter with them (without one the server "
                              "decodes plainly)")
    check_drafting(steps, topk, num_draft_tokens)
    kinds = warm_kinds(warm_sampling)
    if not (warm := warmup if warmup is not None else dev != "cpu"):
        unused(given(serve, warm_sampling=warm_sampling), "with a warm-up",
               "give --warmup with it, or leave it out" if warmup is None else "leave it out")
    check_compile(compile, dev)
    check_bindable(host, port)  # before the model loads, not after
    if drafter is not None:  # a mistyped or damaged folder, before the target's minutes
        check_topk([(steps, topk, num_draft_tokens)], check_drafter(drafter).draft_vocab_size)
    ecfg = EngineConfig(max_batch, max_prompt_tokens, max_tokens_limit, steps, topk,
                        num_draft_tokens, compile, fixed_rows)
    engine = load_engine(target, drafter, dev, dt, ecfg, log=_say)
    if warm:
        _say(warm_line(max_batch, fixed_rows, engine.warmed_kinds(kinds), ecfg.compile))
        engine.warmup(kinds=kinds)
    cfg = server_config(engine, target, served_model_name, api_key, max_queue, drafter,
                        continuous, max_body << 20)
    if host not in LOOPBACK and not api_key:
        _say(f"warning: serving on {host} without --api-key: anyone who can reach it can use it")
    mode = speculative_mode(drafter, steps, topk, num_draft_tokens) if drafter else "baseline"
    if frontends is None:
        frontends = auto_frontends(dev)
    http = f", {counted(frontends, 'HTTP process', 'HTTP processes')}" if frontends else ""
    from draftsmith.serve.frontends import listen

    sock = listen(host, port)  # still free after the load; bound once, so port 0's is announced
    port = sock.getsockname()[1]
    where = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    dtype = str(dt).removeprefix("torch.")  # as --dtype and data make's record name it
    _say(f"serving '{cfg.model_name}' on http://{where}:{port}/v1 ({mode}, {dev}, {dtype}{http})")
    run_server(engine, cfg, host, port, log_level, frontends, sock=sock)


def counted(n: int, one: str, many: str) -> str:
    """`n` and its noun, singular for exactly one."""
    return f"{n} {one if n == 1 else many}"


def warm_line(max_batch: int, fixed_rows: bool, kinds: tuple[str, ...], compile: bool) -> str:
    """The warm-up's startup line: the batch sizes `ServeEngine.warmup` opens, listed, and the
    kinds of sampling it warms (`ServeEngine.warmed_kinds`)."""
    from draftsmith.serve.engine import opened_rows

    sizes = opened_rows(max_batch, fixed_rows)
    listed = ", ".join(map(str, sizes[:-1])) + (" and " if len(sizes) > 1 else "")
    rows = counted(sizes[-1], "row", "rows")
    batches = "a batch" if len(sizes) * len(kinds) == 1 else "batches"
    return (f"warming up {batches} of {listed}{rows} ({', '.join(kinds)} sampling) and "
            "prompt passes" + (", compiling" if compile else ""))


def speculative_mode(drafter: Path, steps: int, topk: int, tokens: int | None) -> str:
    """The startup line's drafting: a tree's size too (a chain's is steps + 1)."""
    size = f", {tokens} draft tokens" if topk > 1 else ""
    return f"speculative ({drafter}, steps {steps}, topk {topk}{size})"


def check_drafting(steps: int, topk: int, tokens: int | None) -> None:
    """--steps, --topk and --num-draft-tokens make one drafting, refused by flag before the
    model loads (the engine's own check came after it, naming its fields)."""
    from draftsmith.engine.tree import most_tokens
    from draftsmith.tune.cost_model import DEEPEST

    if steps > DEEPEST:  # tune's --max-steps limit (cost_model.DEEPEST)
        raise DraftsmithError(f"--steps must be at most {DEEPEST}, got {steps}")
    if topk == 1:
        check_chain_tokens([steps], [] if tokens is None else [tokens])
        return
    most = most_tokens(topk, steps)
    if tokens is None:
        raise DraftsmithError(f"--topk > 1 (a tree) needs --num-draft-tokens: a tree of --topk "
                              f"{topk} and --steps {steps} verifies 2 to {most} tokens")
    if not 2 <= tokens <= most:
        raise DraftsmithError(f"--num-draft-tokens {tokens}: a tree of --topk {topk} and --steps "
                              f"{steps} verifies 2 to {most} tokens")


def check_bindable(host: str, port: int) -> None:
    """The address can be bound now (before the model loads): a port out of range or taken is
    refused by name."""
    from draftsmith.serve.frontends import listen

    listen(host, port).close()


def server_config(engine, target: str, name: str | None, api_key: str | None,
                  max_queue: int, drafter: Path | None = None, continuous: bool = True,
                  max_body: int | None = None):
    from draftsmith.serve.protocol import ServeConfig

    t, c = engine.target, engine.cfg
    model_name = name or _default_name(t, target)
    aliases = tuple(a for a in {target, t.source, "default" if t.kind == "default" else ""} if a)
    spec = engine.speculative
    info = {"speculative": spec, "drafter": str(drafter) if drafter else None,
            "steps": c.steps if spec else None, "topk": c.topk if spec else None,
            "num_draft_tokens": (c.num_draft_tokens or c.steps + 1) if spec else None,
            "max_batch": c.max_batch,
            "max_tokens_limit": c.max_tokens, "max_prompt_tokens": c.max_prompt_tokens,
            "target_fingerprint": t.fingerprint, "continuous": continuous,
            "compiled": c.compile, "fixed_rows": c.fixed_rows, "max_body": max_body}
    return ServeConfig(model_name, aliases, c.max_tokens, c.max_prompt_tokens, c.max_batch,
                       max_queue, api_key, t.fingerprint, info, continuous, max_body)


def _default_name(t, target: str) -> str:
    if t.kind == "default":
        return t.source.split(" ")[0]
    p = Path(target)
    return p.stem if p.suffix == ".gguf" else p.resolve().name


def _say(msg: str) -> None:
    print(f"draftsmith serve: {msg}", file=sys.stderr)


def warm_kinds(value: str) -> tuple[str, ...]:
    """--warm-sampling: the kinds of sampling to warm besides greedy."""
    from draftsmith.serve.engine import KIND_SETTINGS

    kinds = tuple(k.strip() for k in value.split(",") if k.strip() not in ("", "none"))
    if bad := [k for k in kinds if k not in KIND_SETTINGS or k == "greedy"]:
        raise DraftsmithError(f"--warm-sampling {value!r}: unknown kind(s) {bad}; use "
                              "temperature, filtered or none")
    return kinds
