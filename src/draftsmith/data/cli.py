"""`draftsmith data ...`: prompts, regenerate, capture, inspect, vocab, merge, make."""

from __future__ import annotations

import json
import os
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from draftsmith.errors import DraftsmithError
from draftsmith.layers import parse_ids
from draftsmith.options import (
    COMPILE,
    DEVICE,
    DEVICE_UNCHECKED,
    DTYPE,
    TARGET,
    at_least_one,
    check_compile,
    check_folder,
    check_sampling,
    check_seed,
    command_line,
    given,
    unused,
)

app = typer.Typer(no_args_is_help=True, help="Make training data with the target.")
err = Console(stderr=True)

STRICT = typer.Option(False, "--strict", help="Stop at the first malformed record")


def _too_long(value: str) -> str:
    if value not in ("truncate", "skip"):
        raise DraftsmithError(f"--too-long {value!r}: use truncate or skip")
    return value


TOO_LONG = typer.Option("truncate", "--too-long", callback=_too_long,
                        help="Input longer than --max-len allows: truncate or skip")
LIMIT = typer.Option(0, help="Keep the first N conversations (0: all)")


def say(msg: str) -> None:
    # unwrapped: off a terminal rich wraps at 80 columns, splitting a `file:line` a log is
    # searched for (a path deep enough in a test's tmp folder did)
    err.print(msg, highlight=False, markup=False, soft_wrap=True)


def device_dtype(device: str, dtype: str) -> tuple[str, Any]:
    from draftsmith.cli import device_dtype as resolve  # lazily: draftsmith.cli loads this module

    return resolve(device, dtype)


def typed(ctx: typer.Context, name: str, value: Any) -> Any:
    """`value` where the user typed option `name` on the command line, else None: one that an
    environment variable set (OPENAI_API_KEY) is no mistake where it does nothing."""
    source = ctx.get_parameter_source(name)  # typer's own click (vendored since 0.2x) or click's
    return value if getattr(source, "name", None) == "COMMANDLINE" else None


def no_server_flags(ctx: typer.Context, command: Callable[..., Any], model: str | None,
                    concurrency: int, retries: int, api_key: str | None,
                    timeout: float) -> None:
    """Refuse the server's flags given without --base-url (regenerate's and make's); a key
    OPENAI_API_KEY set is no mistake."""
    unused(given(command, model=model, concurrency=concurrency, retries=retries,
                 timeout=timeout, api_key=typed(ctx, "api_key", api_key)), "to a server",
           "give {it} with --base-url")


TIMEOUT_OPTION = typer.Option(600.0, "--timeout", help="Seconds a server's answer may take "
                              "before it is retried (server backend)")


def not_an_input(out: Path, sources: list[str]) -> None:
    """Refuse an output path that is one of the inputs: writing it would lose the input."""
    for src in sources:
        if out.exists() and Path(src).exists() and os.path.samefile(out, src):
            raise DraftsmithError(f"--out {out} is the input {src}: give another --out")


def read_sources(sources: list[str], strict: bool, limit: int = 0) -> list:
    from draftsmith.data.prompts import load_prompts, repeat_key

    if limit < 0:
        raise DraftsmithError(f"--limit must be >= 0 (0: all), got {limit}")
    convs, seen = [], set()
    for src in sources:
        ps = load_prompts(src, strict)
        for p in ps.problems[:20]:
            say(f"warning: skipped {p}")
        if len(ps.problems) > 20:
            say(f"warning: ... {len(ps.problems) - 20} more malformed records skipped")
        new = [c for c in ps.conversations if repeat_key(c) not in seen]
        seen.update(repeat_key(c) for c in new)
        dup = ps.duplicates + len(ps.conversations) - len(new)
        say(f"{src}: {len(new)} conversations, {len(ps.problems)} malformed skipped, "
            f"{dup} duplicates dropped")
        convs += new
    if not convs:
        raise DraftsmithError(f"no conversations in {', '.join(sources)}")
    return convs[:limit] if limit else convs


@app.command()
def prompts(
    sources: list[str] = typer.Argument(None, help="JSONL/JSON/Parquet files, text files (one "
                                        "prompt a line), datasets folders, or 'humaneval'"),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL of conversations"),
    self_made: int = typer.Option(0, "--self-made", help="Have the target write N prompts"),
    strict: bool = STRICT,
    limit: int = LIMIT,
    overwrite: bool = typer.Option(False, help="Replace an --out that holds other data (self-made "
                                   "prompts: start over instead of resuming)"),
    target: str = TARGET,
    device: str = DEVICE_UNCHECKED,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(32, "--batch-size", help="Self-made prompts: rows decoded a "
                                   "round, whatever N (a smaller one is quicker for a small N "
                                   "on CPU, but makes other prompts)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n",
                                       help="Most tokens a self-made prompt may take (longer "
                                       "ones are dropped); each round decodes --batch-size "
                                       "rows of up to this many"),
    min_chars: int = typer.Option(12, "--min-chars", help="Self-made prompts whose own text "
                                  "(past any opening) is shorter are dropped"),
    max_chars: int = typer.Option(2000, "--max-chars", help="Longer self-made prompts dropped"),
    temperature: float = typer.Option(1.0, help="Sampling the self-made prompts"),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling the self-made prompts"),
    system: str = typer.Option(None, help="System message for self-made prompts"),
    openings: str = typer.Option(None, "--openings", help="Self-made prompts start with these: "
                                 "'builtin' (code, reasoning, writing), 'mixed' (half builtin, "
                                 "half free) or a file, one a line"),
    seed: int = typer.Option(0, help="Seeds the self-made prompts"),
) -> None:
    """Collect prompts from files, HumanEval, or the target itself (--self-made N).
    An --out already there is refused unless it holds the same conversations (a rerun) or
    --overwrite is given; self-made prompts resume in it. Self-made prompts are decoded in
    rounds of --batch-size rows of up to --max-new-tokens tokens, whatever N; the progress
    moves a round at a time, and tells a round's time so far as it decodes."""
    from draftsmith.data.atomic import check_file_path
    from draftsmith.data.prompts import write_jsonl

    check_file_path(out)
    not_an_input(out, sources or [])
    if self_made < 0:
        raise DraftsmithError(f"--self-made must be >= 0 (0: prompts from files), got {self_made}")
    if self_made and sources:  # they were dropped without a word
        raise DraftsmithError(f"--self-made {self_made} makes prompts with the target alone: "
                              f"give {', '.join(sources)} in a run of its own")
    if not self_made:
        unused(given(prompts, target=target, device=device, dtype=dtype, batch_size=batch_size,
                     max_new_tokens=max_new_tokens, min_chars=min_chars, max_chars=max_chars,
                     temperature=temperature, top_p=top_p, system=system, openings=openings,
                     seed=seed), "to self-made prompts", "give {it} with --self-made N")
        if not sources:
            raise DraftsmithError("give prompt sources (files, folders, 'humaneval') or "
                                  "--self-made N")
        n = write_jsonl(out, read_sources(sources, strict, limit), overwrite)
        say(f"{out}: {n} conversations")
        return
    from draftsmith.data.selfmade import MagpieConfig, openings_from, self_made_prompts
    from draftsmith.targets import load_target

    unused(given(prompts, strict=strict, limit=limit), "to prompt files",
           "leave {it} out with --self-made N")
    at_least_one({"--batch-size": batch_size, "--max-new-tokens": max_new_tokens})
    check_sampling(temperature, top_p)
    check_seed(seed)
    if temperature == 0:
        unused(given(prompts, top_p=top_p, seed=seed), "to sampling (--temperature > 0)",
               "at temperature 0 decoding is greedy; leave {it} out")
    dev, dt = device_dtype(device, dtype)
    cfg = MagpieConfig(self_made, batch_size, max_new_tokens, min_chars, max_chars,
                       temperature, top_p, seed, system, openings=openings_from(openings))
    t = load_target(target)
    stats = self_made_prompts(t, out, cfg, device=dev, dtype=dt, log=say, overwrite=overwrite)
    say(f"{out}: " + ", ".join(f"{k} {v}" for k, v in stats.items()))


@app.command()
def regenerate(
    ctx: typer.Context,
    source: str = typer.Argument(..., help="Prompts (any format `data prompts` reads)"),
    out: Path = typer.Option(..., "--out", "-o", help="Output JSONL (appended; reruns resume)"),
    base_url: str = typer.Option(None, "--base-url", help="OpenAI-compatible server, e.g. "
                                 "http://host:30000/v1 (default: the built-in engine)"),
    model: str = typer.Option(None, "--model", help="Model name on the server"),
    concurrency: int = typer.Option(16, help="Requests in flight (server backend)"),
    retries: int = typer.Option(5, help="Retries per request with exponential backoff"),
    timeout: float = TIMEOUT_OPTION,
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                help="The server's key (server backend)"),
    target: str = TARGET,
    device: str = DEVICE_UNCHECKED,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(16, "--batch-size", help="Rows decoded together (engine)"),
    max_len: int = typer.Option(2048, "--max-len", help="Prompt + answer tokens"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n",
                                       help="Most tokens an answer may take"),
    temperature: float = typer.Option(0.8, help="0 = greedy"),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling"),
    top_k: int = typer.Option(0, "--top-k", help="The k likeliest only (0: off)"),
    too_long: str = TOO_LONG,
    seed: int = typer.Option(0, help="Seeds the sampling"),
    strict: bool = STRICT,
    limit: int = LIMIT,
    compile: bool = COMPILE,
    refill: bool = typer.Option(True, "--refill/--no-refill", help="Engine: a row whose answer "
                                "ended takes the next prompt (off: static batches)"),
) -> None:
    """Answer every prompt with the target, turn by turn (engine or OpenAI-compatible server)."""
    from draftsmith.data.atomic import check_file_path
    from draftsmith.data.regenerate import (
        RegenConfig,
        check_server_options,
        failed_words,
        regenerate_file,
        retryable,
    )

    if base_url:
        unused(given(regenerate, device=device, dtype=dtype, batch_size=batch_size,
                     compile=compile, refill=refill), "to the built-in engine",
               "leave {it} out with --base-url")
        check_server_options(concurrency, retries, timeout)
    else:
        no_server_flags(ctx, regenerate, model, concurrency, retries, api_key, timeout)
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:  # greedy: they would be recorded as the answers' sampling
        unused(given(regenerate, top_p=top_p, top_k=top_k, seed=seed),
               "to sampling (--temperature > 0)",
               "at temperature 0 decoding is greedy; leave {it} out")
    # a server's answers are written a chunk at a time: a chunk of --concurrency conversations
    # keeps that many requests in flight (one of --batch-size capped them at 16)
    cfg = RegenConfig(max_new_tokens, max_len, too_long, concurrency if base_url else batch_size,
                      temperature, top_p, top_k, seed, refill)
    check_file_path(out)
    not_an_input(out, [source])
    dev, dt = device_dtype(device, dtype) if not base_url else ("cpu", None)
    check_compile(compile, dev)  # before the prompts are read and counted
    convs = read_sources([source], strict, limit)
    stats = regenerate_file(convs, out, cfg, target, dev, dt, base_url, model, concurrency,
                            retries, api_key, log=say, compile=compile, timeout=timeout)
    if retryable(stats):  # exit 0 here let a script capture an answers file with holes
        raise DraftsmithError(failed_words(stats, out, base_url))


@app.command()
def capture(
    source: str = typer.Argument(..., help="Conversations JSONL (usually from `regenerate`)"),
    out: Path = typer.Option(..., "--out", "-o", help="Dataset folder"),
    target: str = TARGET,
    device: str = DEVICE,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(8, "--batch-size", help="Conversations a forward"),
    max_len: int = typer.Option(2048, "--max-len", help="Tokens kept per conversation"),
    aux_layers: str = typer.Option(None, "--aux-layers", help="Canonical ids (output of layer "
                                   "j, 0-based, -1 = embeddings), e.g. 1,14,26"),
    shard_size: int = typer.Option(256, "--shard-size", help="Samples per shard"),
    too_long: str = TOO_LONG,
    overwrite: bool = typer.Option(False, help="Delete this folder's shards first"),
    grow: bool = typer.Option(False, help="A folder captured from other conversations (answers "
                              "added since): keep its shards whose samples stay, capture the "
                              "rest"),
    strict: bool = STRICT,
) -> None:
    """Teacher-forced capture of aux and final hidden states into shards (resumable)."""
    from draftsmith.data.capture import CaptureConfig, dist_env
    from draftsmith.data.capture import capture as run
    from draftsmith.targets import load_target

    check_folder(out, "--out")
    if grow and dist_env()[1] > 1:
        raise DraftsmithError("--grow keeps the shards of a single-process capture: run it "
                              "without torchrun, or start over with --overwrite")
    at_least_one({"--batch-size": batch_size, "--max-len": max_len, "--shard-size": shard_size})
    dev, dt = device_dtype(device, dtype)
    cfg = CaptureConfig(parse_ids(aux_layers), batch_size, max_len, too_long, shard_size,
                        dt, dev)
    convs = read_sources([source], strict)
    m = run(load_target(target), convs, out, cfg, command=command_line(), log=say,
            overwrite=overwrite, grow=grow)
    whole = m.get("complete") and (m.get("rank") is None or m.get("world_size", 1) == 1)
    say(f"{out}: {m['totals']['samples']} samples, {m['totals']['tokens']} tokens, "
        f"{m['totals']['shards']} shards" + ("" if whole else " (this rank)"))


@app.command()
def merge(folder: Path = typer.Argument(..., help="Capture folder holding rank-R/")) -> None:
    """Merge the per-rank manifests of a multi-process capture into one."""
    from draftsmith.data.capture import merge_held

    m = merge_held(folder)
    say(f"{folder}: merged {m['totals']['shards']} shards, {m['totals']['samples']} samples")


@app.command()
def inspect(
    folder: Path = typer.Argument(..., help="Dataset folder"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table"),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the sha256 checks"),
) -> None:
    """Counts, token statistics, the layer convention, and a check of every shard."""
    from draftsmith.data.shards import Dataset, verify

    ds = Dataset(folder)
    if not no_verify:  # first: a damaged shard is named by what is wrong with it
        verify(folder)
    info = describe(ds)
    if not no_verify:
        info["verified"] = f"all {len(ds.shards)} shards match the manifest (sha256, shapes)"
    if as_json:
        print(json.dumps(info, indent=1))
        return
    table = Table(title=str(folder), show_header=False)
    for k, v in info.items():
        table.add_row(k, v if isinstance(v, str) else json.dumps(v))
    Console().print(table)


def describe(ds: Any) -> dict[str, Any]:
    from draftsmith.data.shards import is_complete, totals
    from draftsmith.layers import CANONICAL_WORDS, WORDS, Convention, to_convention

    # an external tool's manifest, which train reads, may leave out what draftsmith records
    m, t = ds.manifest, totals(ds.manifest["shards"])
    lens = ds.lengths()
    who = m.get("target") if isinstance(m.get("target"), dict) else {}
    ids, layers = m["aux_layer_ids"], who.get("num_layers")
    return {
        "complete": is_complete(m),
        "target": f"{who.get('source', '?')} (fingerprint {who.get('fingerprint', '?')})",
        "samples": t["samples"], "shards": t["shards"], "bytes": t["bytes"],
        "tokens": t["tokens"],
        "loss tokens": f"{t['loss_tokens']} ({t['loss_tokens'] / max(t['tokens'], 1):.1%})",
        "sample length": (f"min {min(lens)}, median {statistics.median(lens):g}, "
                          f"mean {statistics.fmean(lens):.1f}, max {max(lens)}") if lens else "-",
        "aux layer ids": f"{ids}: {m.get('aux_convention', CANONICAL_WORDS)}",
        "same layers for vLLM/speculators": (f"{to_convention(ids, 'vllm', layers)} "
                                             f"({WORDS[Convention.VLLM]})" if layers else "?"),
        "stored": f"aux [T, {len(ids)}, {m['hidden_size']}] and final hidden (after the final "
                  f"norm) [T, {m['hidden_size']}], {m.get('dtype', 'bfloat16')}",
        "skipped inputs": _skipped(m.get("input", {}).get("skipped")),
        "truncated inputs": (f"{m.get('input', {}).get('truncated', 0)} cut to --max-len "
                             f"{m.get('max_len', '?')} tokens"),
        "answer turns": _answers(m.get("input", {}).get("answers")),
        "commands": m.get("commands", []),
    }


def _answers(answers: Any) -> str:
    """How a manifest's answer turns were tokenized, in words ("not recorded" before it was)."""
    from draftsmith.data.capture import answer_words

    ok = isinstance(answers, dict) and all(type(v) is int for v in answers.values())
    return answer_words(answers) if ok else "not recorded"


def _skipped(skipped: Any) -> str:
    """A manifest's skipped inputs by reason, in words ("none" where it skipped none)."""
    from draftsmith.data.capture import skipped_words

    return skipped_words(skipped) if isinstance(skipped, dict) else "not recorded"


@app.command()
def vocab(
    source: Path = typer.Argument(..., help="Dataset folder, or conversations JSONL"),
    size: int = typer.Option(32000, "--size", "--vocab-size", help="Draft vocabulary size"),
    out: Path = typer.Option(None, "--out", "-o", help="Folder (default: the dataset folder, or "
                             "the JSONL's folder)"),
    target: str = typer.Option("default", "--target", help="With a conversations JSONL: the "
                               "target that tokenizes it (a dataset folder names its own)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a vocab.safetensors "
                                   "already in the output folder"),
) -> None:
    """Top-N loss-masked tokens -> draft vocabulary (d2t/t2d) and the coverage it reaches."""
    from draftsmith.data import vocab as V

    if size < 1:
        raise DraftsmithError(f"--size must be >= 1, got {size}")
    dest = out or (source if source.is_dir() else source.parent)
    if (dest / "vocab.safetensors").exists() and not overwrite:  # a drafter may train on it
        who = V.made_by(dest)
        raise DraftsmithError(f"{dest / 'vocab.safetensors'} exists ({who + '; ' if who else ''}"
                              "a drafter may have been trained on it with --vocab); pass "
                              "--overwrite to replace it, or --out another folder")
    if out is not None:
        check_folder(out, "--out")
    if source.is_dir():
        from draftsmith.data.shards import is_complete, read_manifest

        unused(given(vocab, target=target), "to a conversations JSONL",
               "a dataset folder's manifest names its target; leave {it} out")
        m = read_manifest(source)
        vsize = _dataset_vocab(source, m)
        if not is_complete(m):  # a capture killed or still running: part of its data
            say(f"warning: {source} is a capture not yet complete ({len(m['shards'])} of "
                f"{(m.get('expected') or {}).get('shards', '?')} shards): the vocabulary counts "
                "those alone; rerun the capture's command to finish it, then this one")
        counts = V.count_dataset(source)
        made_from = V.counted_from(source, m)
    else:
        from draftsmith.data.prompts import encode_conversations
        from draftsmith.targets import load_target

        convs = read_sources([str(source)], False)  # a bad file said before the target loads
        t = load_target(target)
        vsize = t.cfg.vocab_size
        counts = V.count_ids(encode_conversations(t.tokenizer, convs, source), vsize)
        made_from = {"conversations": str(source), "target": t.fingerprint}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = V.build_vocab(counts, size, vsize)
    for w in caught:
        say(f"warning: {w.message}")
    path = V.save_vocab(v, dest, {"made_from": made_from, "command": command_line()})
    say(f"{path}: draft vocab {v.used.numel()} of {vsize}, coverage {v.coverage:.2%} of "
        f"{v.counted} assistant tokens ({v.distinct} distinct)")
    for n, c in V.coverage_table(counts, [1024, 4096, 8192, 16384, 32000, 65536]):
        if n < vsize:
            say(f"  top {n}: {c:.2%}")


def _dataset_vocab(folder: Path, m: dict[str, Any]) -> int:
    """The target vocabulary a dataset's draft vocabulary maps into (t2d spans it), from its
    manifest; one rank's part of a capture refused, as train refuses it: it holds every
    world-th shard, so the vocabulary counted part of the data without a word."""
    from draftsmith.data.shards import rank_part

    part = rank_part(m)
    if part is not None:
        top = folder.resolve().parent
        raise DraftsmithError(f"{folder}: {part}, not the whole of it; once every rank is done "
                              f"run `draftsmith data merge {top}`, then `data vocab {top}`")
    size = m.get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DraftsmithError(f"{folder}: its manifest.json names no vocab_size (the target's "
                              "vocabulary, which t2d spans); add \"vocab_size\": N to it")
    return size


@app.command()
def make(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="Folder for prompts.jsonl, answers.jsonl, dataset/"),
    n: int = typer.Option(2000, "--n", help="Self-made conversations"),
    target: str = TARGET,
    device: str = DEVICE,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(32, "--batch-size", help="Rows decoded together: a prompts "
                                   "round, whatever --n; the answers (capture: a quarter of "
                                   "them)"),
    max_len: int = typer.Option(2048, "--max-len", help="Prompt + answer tokens"),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Most tokens an answer may "
                                       "take (the answers' limit; prompts: --prompt-tokens)"),
    aux_layers: str = typer.Option(None, "--aux-layers", help="Canonical ids (output of layer "
                                   "j, 0-based, -1 = embeddings), e.g. 1,14,26 (default: "
                                   "the target's)"),
    vocab_size: int = typer.Option(32000, "--vocab-size", help="Draft vocabulary size"),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Max tokens per self-made "
                                      "prompt (longer ones are dropped); each prompts round "
                                      "decodes --batch-size rows of up to this many"),
    seed: int = typer.Option(0, help="Seeds the prompts and answers"),
    temperature: float = typer.Option(0.8, "--temperature", help="The answers' sampling "
                                      "temperature (top-p 0.95); 0 = greedy answers"),
    compile: bool = COMPILE,
    base_url: str = typer.Option(None, "--base-url", help="Answers from this OpenAI-compatible "
                                 "server of the target, e.g. http://host:30000/v1 (prompts and "
                                 "capture stay on --device)"),
    model: str = typer.Option(None, "--model", help="Model name on the server"),
    concurrency: int = typer.Option(16, help="Requests in flight (--base-url)"),
    retries: int = typer.Option(5, help="Retries per request with exponential backoff "
                                "(--base-url)"),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a server's answer may "
                                  "take before it is retried (--base-url)"),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                help="The server's key (--base-url)"),
) -> None:
    """Self-made prompts -> regenerate -> capture -> vocab in one command (reruns resume; a
    larger --n adds to the run). The dataset to train on is OUT/dataset.

    Prompts: each round decodes --batch-size rows of up to --prompt-tokens tokens, whatever
    --n (a small --n still takes a whole round: on CPU a smaller --batch-size is quicker, but
    makes other prompts); the progress tells a round's time so far as it decodes. Answers:
    --max-new-tokens tokens at most, from the built-in engine or, with --base-url, a server of
    the target (SGLang, vLLM, `draftsmith serve`), --concurrency requests at a time."""
    from draftsmith.data.pipeline import Server, make_dataset

    server = None
    if base_url:
        server = Server(base_url, model, concurrency, retries, api_key, timeout)
    else:
        no_server_flags(ctx, make, model, concurrency, retries, api_key, timeout)
    dev, dt = device_dtype(device, dtype)
    make_dataset(out, n, target, dev, dt, batch_size, max_len, max_new_tokens,
                 parse_ids(aux_layers), vocab_size, seed, prompt_tokens, command_line(), say,
                 compile=compile, temperature=temperature, server=server)
