"""`data make`: self-made prompts -> regenerated answers -> captured shards -> draft vocab.

Every stage resumes on its own (appended JSONL, manifest of finished shards), so rerunning the
same command skips what is finished, and a larger --n adds to what is there. Stage times go to
`make.json` beside the data.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from draftsmith.data.atomic import make_folder, write_json
from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_json
from draftsmith.options import at_least_one, check_folder, check_sampling, check_seed

if TYPE_CHECKING:
    from draftsmith.data.regenerate import RegenConfig
    from draftsmith.data.selfmade import MagpieConfig

# What only a training run writes into its --out (models.eagle3.CONFIG_FILE, train.report.LOG,
# train.checkpoint.CHECKPOINTS): here, so data make refuses such a folder without importing
# the trainer, data's downstream stage.
RUN_MARKERS = frozenset({"draftsmith.json", "train_log.jsonl", "checkpoints"})


@dataclass(frozen=True, slots=True)
class Server:
    """An OpenAI-compatible server of the target that answers the prompts (`--base-url`):
    the answers, the long decode, scale out there; the prompts and the capture stay here."""

    base_url: str
    model: str | None = None
    concurrency: int = 16
    retries: int = 5
    api_key: str | None = None
    timeout: float = 600.0  # seconds an answer may take (`regenerate.TIMEOUT`)


def make_dataset(
    out: str | Path,
    n: int,
    target: Any = "default",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 32,
    max_len: int = 2048,
    max_new_tokens: int = 512,
    aux_layers: list[int] | None = None,
    vocab_size: int = 32000,
    seed: int = 0,
    prompt_tokens: int = 128,
    command: str = "draftsmith.data.pipeline.make_dataset()",
    log: Callable[[str], None] = print,
    progress: bool = True,
    compile: bool = False,
    temperature: float = 0.8,
    server: Server | None = None,
) -> dict[str, Any]:
    from draftsmith.data.capture import CaptureConfig, aux_ids, capture
    from draftsmith.data.prompts import read_prompts
    from draftsmith.data.regenerate import (
        EngineBackend,
        RegenConfig,
        check_base_url,
        check_server_options,
        failed_words,
        regenerate,
        retryable,
        within_positions,
    )
    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
    from draftsmith.data.vocab import counted_from
    from draftsmith.options import check_compile
    from draftsmith.targets import load_target

    out = Path(out)
    at_least_one({"--n": n, "--batch-size": batch_size, "--max-len": max_len,
                  "--max-new-tokens": max_new_tokens, "--prompt-tokens": prompt_tokens,
                  "--vocab-size": vocab_size})
    check_sampling(temperature, 0.95)  # NaN passed RegenConfig's check
    check_seed(seed)
    check_folder(out)
    check_not_a_model(out)
    check_compile(compile, device)
    if server is not None:  # before the target loads
        check_server_options(server.concurrency, server.retries, server.timeout)
        check_base_url(server.base_url)
    t = target if hasattr(target, "build") else load_target(target)
    ids = aux_ids(aux_layers, t.cfg.num_layers)
    # every setting is checked before the first stage starts
    magpie = MagpieConfig(n, batch_size, prompt_tokens, seed=seed)
    regen = within_positions(RegenConfig(max_new_tokens, max_len, batch_size=batch_size,
                                         temperature=temperature, seed=seed),
                             t.cfg.max_position_embeddings, log,
                             t.cfg.sliding_window)
    # regen.max_len: --max-len within the target's positions, as the answers are
    cap = CaptureConfig(ids, max(1, batch_size // 4), regen.max_len, dtype=dtype, device=device)
    _same_backend(out / "answers.jsonl", server)
    # a server down, a wrong key or no model to name is told before the prompts stage runs
    # (and before OUT is made)
    client = _server_client(t, regen, server, log) if server is not None else None
    redo = (f"delete {out / 'dataset'} to capture it again (prompts.jsonl and answers.jsonl are "
            "kept), or give `data make` another folder")
    try:  # the client closed however the stages before capture end
        # the prompts' settings first: greedy answers differ by no seed, the prompts do
        _same_prompts(out / "prompts.jsonl", t, magpie, dtype, compile)
        _same_answers(out / "answers.jsonl", t, client.cfg if client else regen, client)
        _same_capture(out / "dataset", t, cap, redo)
        record_path = make_folder(out) / "make.json"
        record = _read_record(record_path)
        model = t.build(dtype, device)
        record.setdefault("commands", [])
        if command not in record["commands"]:
            record["commands"].append(command)
        # the stages this run ran: an earlier run's, kept, read as results of this --n
        record.update(target=t.source, fingerprint=t.fingerprint, device=device,
                      dtype=str(dtype).removeprefix("torch."), n=n, stages={})
        record.pop("server", None)
        if client is not None:  # the model asked, also where the server named it
            record["server"] = {"base_url": client.base_url, "model": client.model_name}

        def stage(name: str, fn: Callable[[], Any],
                  say: Callable[[Any], str] | None = None) -> Any:
            log(f"== {name}")
            t0 = time.perf_counter()
            result = fn()
            record.setdefault("stages", {})[name] = {
                "seconds": round(time.perf_counter() - t0, 2), "result": result}
            write_json(record_path, record)
            if say is not None:  # make.json's result in words: reused, or what it added
                log(say(result))
            return result

        prompts, answers, data = out / "prompts.jsonl", out / "answers.jsonl", out / "dataset"
        made = stage("prompts", lambda: self_made_prompts(t, prompts, magpie, model,
                                                          progress=progress, log=log,
                                                          compile=compile),
                     partial(_said_prompts, before=_rows(prompts)))
        if not made["kept"]:
            raise DraftsmithError(_no_prompts(made, magpie))
        backend = client or EngineBackend(t, model, regen, compile)
        # the first n prompts: files an earlier, larger --n left hold more
        said = stage("regenerate", lambda: regenerate(read_prompts(prompts)[:n], answers,
                                                      backend, t.tokenizer,
                                                      client.cfg if client else regen, progress,
                                                      log), _said_answers)
    finally:
        if client is not None:
            client.close()
    if retryable(said):  # capturing now would train on a set with holes a rerun may fill
        raise DraftsmithError(failed_words(said, answers, server and server.base_url,
                                           " and nothing was captured"))
    if not said["done_before"] + said["answered"]:
        raise DraftsmithError(_no_answers(said, regen, regen.max_len < max_len))
    # grow: a rerun with another --n changes the answers captured; the shards they leave as they
    # are stay
    before = _shards(data)
    m = stage("capture", lambda: capture(t, _answers(prompts, answers, n), data, cap, command,
                                         log, progress, model=model, grow=True,
                                         redo=redo)["totals"],
              lambda m: _said_capture(m, before, _shards(data)))
    stage("vocab", lambda: _vocab(data, vocab_size, t.cfg.vocab_size, log, command,
                                  counted_from(data)))
    log(f"{data}: {m['samples']} samples, {m['tokens']} tokens, {m['bytes'] / 2**20:.1f} MiB")
    return record


def _server_client(t: Any, regen: RegenConfig, server: Server,
                   log: Callable[[str], None]) -> Any:
    """The server's client, its `cfg` the config the answers are asked with (a chunk:
    --concurrency requests in flight, as `data regenerate --base-url` asks them); the server
    asked for its models first: one it cannot be reached at, or that refuses the key, stops
    the run here."""
    from draftsmith.data.regenerate import OpenAIBackend, server_model

    asked = dataclasses.replace(regen, batch_size=server.concurrency)
    client = OpenAIBackend(server.base_url, server.model or "", asked, server.concurrency,
                           server.retries, api_key=server.api_key, timeout=server.timeout,
                           tokenizer=t.tokenizer)
    try:
        if not server.model:
            client.model_name = server_model(client.client, server.base_url)
        else:
            _check_model(client.client, server.base_url, server.model, log)
    except BaseException:
        client.close()
        raise
    return client


def _check_model(client: Any, base_url: str, model: str, log: Callable[[str], None]) -> None:
    """The server reached and the key taken before any stage; --model checked against the
    models it lists (a warning only: a server may take aliases it does not list)."""
    from draftsmith.data.regenerate import list_models, unlisted

    if said := unlisted(base_url, list_models(client, base_url, needed=False), model):
        log(f"warning: {said}")


def _same_backend(answers: Path, server: Server | None) -> None:
    """A folder's answers all come from the engine or all from a server: a rerun switching
    between them would mix two answerers' sampling in one dataset, which make.json records
    as one of them."""
    try:
        with answers.open("rb") as f:
            first = json.loads(f.readline())
        was = first["meta"]["answers"][0]["backend"]
    except (OSError, ValueError, LookupError, TypeError):  # none yet; regenerate judges the rest
        return
    now = "openai" if server is not None else "engine"
    if was in ("openai", "engine") and was != now:
        there = "a server's (--base-url)" if was == "openai" else "the built-in engine's"
        fix = "give --base-url as before" if was == "openai" else "leave --base-url out"
        raise DraftsmithError(f"data make: {answers} holds {there} answers, this run asks "
                              f"{'a server' if server else 'the built-in engine'}: {fix}, or "
                              "give `data make` another folder")


def _same_prompts(prompts: Path, t: Any, cfg: MagpieConfig, dtype: torch.dtype,
                  compile: bool) -> None:
    """The self-made prompts' settings checked before any stage, as the prompts stage checks
    them (`selfmade._same_settings`, the record `self_made_prompts` writes): a --seed or
    --prompt-tokens of other prompts is named, not read as a change of the answers. Only what
    made the prompts there (full: not the batching or numerics of rounds still to make, which
    the stage checks, and capture's precheck names a --dtype by its dataset)."""
    from draftsmith.data.prompts import appended_records
    from draftsmith.data.selfmade import _conversation, _same_settings, made_by_record

    if not prompts.is_file():
        return
    records = appended_records(prompts)[0]
    have = [_conversation(prompts, line, r) for line, r in records]
    _same_settings(prompts, have, made_by_record(t, cfg, dtype, compile), cfg.openings, full=True)


def _same_answers(answers: Path, t: Any, cfg: RegenConfig, client: Any) -> None:
    """The answers' target and sampling checked before any stage, as regenerate checks them:
    a grown --n would make its prompts before regenerate refused. The engine's batching and
    numerics are left to regenerate, which takes other ones for a file it adds nothing to."""
    from draftsmith.data.prompts import appended_records
    from draftsmith.data.regenerate import EngineBackend, _same_answerer, answered_by, answerer

    if not answers.is_file():
        return
    # the engine's: answerer's base, less what needs its runtime (batching, numerics)
    info = (answerer(client, cfg) if client is not None else
            answered_by(EngineBackend.name, t.source, cfg, t))
    _same_answerer(answers, appended_records(answers)[0], info)


def _same_capture(data: Path, t: Any, cap: Any, redo: str) -> None:
    """The dataset's capture settings (`capture.IDENTITY` but its input and ranks) checked
    before any stage, as capture checks them: a grown --n would make prompts and answers before
    capture refused."""
    from draftsmith.data import capture as C
    from draftsmith.data.shards import MANIFEST, check_identity, read_manifest

    if not (data / MANIFEST).is_file():
        return
    cap = C.within_positions(cap, t.cfg.max_position_embeddings, lambda s: None)
    ids = C.aux_ids(cap.aux_layer_ids, t.cfg.num_layers)
    head = C.header(t, [], cap, ids, C.Plan([], []), 0, 1)
    keys = tuple(k for k in C.IDENTITY if k not in (*C.DIGESTS, "world_size", "rank"))
    check_identity(data, read_manifest(data), head, keys, redo)


def check_not_a_model(out: Path) -> None:
    """Refuse a folder holding a drafter, a training run or a model's config.json (an export, a
    target): `data make` would write its files beside them without a word. An earlier `data
    make` run's folder holds none of these, so it resumes."""
    if not out.is_dir():
        return
    held = sorted(RUN_MARKERS & {p.name for p in out.iterdir()})
    what = f"a drafter or training run ({', '.join(held)})" if held else None
    if what is None and (out / "config.json").exists():
        what = _model_kind(out)
    if what is not None:
        raise DraftsmithError(f"data make: {out} holds {what}, not a `data make` folder; give "
                              "it a new or empty folder (or an earlier `data make` run's)")


def _model_kind(out: Path) -> str:
    """What a folder with a config.json holds, as export and import read it."""
    from draftsmith.export import detect_format

    try:
        return f"an exported drafter ({detect_format(out)} layout, config.json)"
    except DraftsmithError:
        return "a model (config.json)"


def _no_prompts(made: dict[str, int], cfg: MagpieConfig) -> str:
    """Why the prompts stage kept none, by its counts, and what to change."""
    return (f"data make: the target's self-made prompts were all dropped ({made['duplicates']} "
            f"duplicates, {made['length_filtered']} under {cfg.min_chars} or over "
            f"{cfg.max_chars} characters, {made['unfinished']} unfinished within "
            f"--prompt-tokens {cfg.max_new_tokens}, {made['bare_openings']} bare openings, "
            f"{made.get('template_tokens', 0)} holding the chat template's tokens): "
            "raise --prompt-tokens, or try another --seed or --target")


def _no_answers(said: dict[str, int], cfg: RegenConfig, cut: bool) -> str:
    """Why the regenerate stage answered none, by its counts, and what to change (`cut`:
    --max-len was cut to the target's positions, so only --max-new-tokens can make room)."""
    limit = (f"--max-len {cfg.max_len} (cut to the target's max_position_embeddings)" if cut
             else f"--max-len {cfg.max_len}")
    fix = "lower --max-new-tokens" if cut else "raise --max-len or lower --max-new-tokens"
    return (f"data make: the target answered no prompt ({said['skipped_too_long']} longer than "
            f"{limit} - --max-new-tokens {cfg.max_new_tokens}, {said['template_refused']} "
            f"refused by the chat template, {said['failed']} failed): {fix}")


def _answers(prompts: Path, answers: Path, n: int) -> list[Any]:
    """The answered conversations of the first `n` prompts, in the answers' order."""
    from draftsmith.data.prompts import read_prompts

    asked = {c.id for c in read_prompts(prompts)[:n]}
    return [c for c in read_prompts(answers) if c.meta.get("prompt_id") in asked]


def _rows(path: Path) -> int:
    """Prompts a file holds before the stage: a torn last line (a killed run's) is no prompt."""
    from draftsmith.data.prompts import read_jsonl_tail_safe
    try:
        return len(read_jsonl_tail_safe(path)) if path.is_file() else 0
    except (DraftsmithError, OSError, ValueError):  # the stage itself says what is wrong
        return 0


def _shards(data: Path) -> dict[str, Any]:
    """A finished dataset's samples and shard hashes before the capture stage (none: 0, no
    hashes): a rerun whose shards are the same ones reused them, not the same count alone."""
    from draftsmith.data.shards import MANIFEST
    try:
        manifest = read_json(data / MANIFEST, "manifest")
        if manifest.get("complete"):
            return {"samples": int(manifest["totals"]["samples"]),
                    "sha256": [s["sha256"] for s in manifest["shards"]]}
    except (DraftsmithError, OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {"samples": 0, "sha256": None}


def _said_prompts(made: dict[str, int], before: int) -> str:
    kept, new = made["kept"], made["kept"] - before
    if new <= 0:
        return f"prompts: reused ({kept} kept)"
    return f"prompts: {new} made, {kept} kept" + (f" ({before} reused)" if before else "")


def _said_answers(said: dict[str, int]) -> str:
    if not said["answered"]:
        return f"regenerate: reused ({said['done_before']} answers)"
    again = f", {said['redone']} of them again in their grown chunk" if said["redone"] else ""
    kept = f" ({said['done_before']} reused)" if said["done_before"] else ""
    return f"regenerate: {said['answered']} answered{again}{kept}"


def _said_capture(m: dict[str, int], before: dict[str, Any], after: dict[str, Any]) -> str:
    if before["sha256"] is not None and before["sha256"] == after["sha256"]:
        return f"capture: reused ({before['samples']} samples)"
    grew = m["samples"] - before["samples"]
    more = (f" ({abs(grew)} {'more' if grew > 0 else 'fewer'} than before)"
            if before["samples"] and grew else "")
    return f"capture: {m['samples']} samples written{more}"


def _read_record(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    record = read_json(path, "")
    kinds = {"commands": list, "stages": dict}
    if not isinstance(record, dict) or not all(isinstance(record.get(k, t()), t)
                                               for k, t in kinds.items()):
        raise DraftsmithError(f"{path}: not the record `data make` writes; give another folder")
    return record


def _vocab(data: Path, size: int, target_vocab: int, log: Callable[[str], None],
           command: str = "data make", made_from: dict[str, Any] | None = None) -> dict:
    """`made_from`: what vocab.json says it counted (`vocab.counted_from`: the length too)."""
    from draftsmith.data.vocab import build_vocab, count_dataset, replacing, save_vocab

    with warnings.catch_warnings(record=True) as caught:  # one line as `data vocab` says it,
        warnings.simplefilter("always")                  # not Python's warning with its source
        # the size asked: one past the target's vocabulary is said, as `data vocab` says it
        v = build_vocab(count_dataset(data, target_vocab), size, target_vocab)
    for w in caught:
        log(f"warning: {w.message}")
    path = data / "vocab.safetensors"
    kept = path.is_file()
    if (was := replacing(path, v)) is not None:  # a drafter may have trained on the old one
        kept = False
        log(f"vocab: {path} replaced: {was} -> "
            f"{v.used.numel()} draft tokens, counted on this run's data (a drafter trained with "
            "--vocab on the old one used another vocabulary)")
    fix = (f"the dataset is kept: make {data} writable (or free space), then rerun the same "
           f"`{command}` command (its finished stages are reused)")
    save_vocab(v, data, {"made_from": made_from or {"dataset": str(data)}, "command": command},
               fix)
    n = v.used.numel()
    said = (f"{n} token{'s cover' if n != 1 else ' covers'} {v.coverage:.2%} of assistant "
            "tokens")
    log(f"vocab: reused ({said})" if kept else f"vocab: {said}")  # as the stages before say it
    return v.summary()
