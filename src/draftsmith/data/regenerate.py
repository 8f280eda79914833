"""Regenerate: the target answers every prompt, turn by turn, so the drafter learns the target's
own distribution. Backends: the built-in engine (batched) or any OpenAI-compatible server.

Each finished conversation is appended to the output JSONL with `meta.prompt_id` and one
`meta.answers` entry per assistant turn (backend, model, sampling, tokens, finish reason; the
engine's also the `ids` it decoded, which capture trains on in place of the text's tokens, and
which the engine asks a later turn after, `prompt_ids`: a server takes the text alone);
a rerun skips prompt ids already there. A first prompt longer than the limit is truncated or
skipped; a later turn that no longer fits ends the conversation there; a conversation the chat
template refuses (roles it does not take) is skipped. Each is counted. The engine answers a
chunk at a time; a server --concurrency conversations at a time, the next begun as one ends
(`_Window`), written in input order a chunk at a time all the same. A ctrl-C stops at once:
the chunks written are kept, a server's requests in flight abandoned, and a rerun resumes.
A chunk none of whose requests reached the server (connection errors, timeouts) stops the run
with one error where later chunks remain, rather than asking each of them in vain.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import queue
import random
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.atomic import append_whole, make_folder
from draftsmith.data.prompts import (
    Conversation,
    appended_records,
    cut_records,
    drop_last_write,
    last_write,
    lead,
    mark_write,
    opening,
    write_cut,
)
from draftsmith.errors import DraftsmithError
from draftsmith.options import at_least_one, redacted_url

Messages = list[dict[str, str]]
# assistant message index -> the ids the engine decoded for it (`Conversation.answer_ids`)
Recorded = dict[int, "list[int] | None"]
# a prompt's length in target tokens: (messages, the ids recorded for its answers) -> count
Counts = Callable[..., int]
# With refill the engine takes this many batches' prompts at once (the records of a chunk are
# written together: a killed run redoes at most one chunk) so that finished rows have a next one.
REFILL_CHUNK = 8

# An engine's sampled answers depend on the rows decoded together (the draws of a batch) and
# on the chunks seeded (REFILL_CHUNK batches with refill, one without): a rerun made otherwise
# would add answers equal to neither run's.
BATCHING: dict[str, Callable[[Any], str]] = {
    "batch_size": lambda v: f"--batch-size {v}",
    "refill": lambda v: "--refill" if v else "--no-refill",
}
# So do the weights' dtype and compiled layers (other kernels: near-ties break otherwise, and
# one token apart the answers part).
NUMERICS: dict[str, Callable[[Any], str]] = {
    "dtype": lambda v: f"--dtype {v}",
    "compile": lambda v: "--compile" if v else "no --compile",
}
ENGINE = BATCHING | NUMERICS


def tell(line: str) -> None:
    """A line on stderr mid-run: on a terminal above the progress bar, not onto its line."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as --dtype spells it."""
    return str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class RegenConfig:
    max_new_tokens: int = 512
    max_len: int = 2048  # prompt + answer, in target tokens
    too_long: str = "truncate"  # or "skip"
    batch_size: int = 16
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0
    refill: bool = True  # engine: a row whose answer ended takes the next prompt

    def __post_init__(self) -> None:
        if self.too_long not in ("truncate", "skip"):
            raise DraftsmithError(f"--too-long must be 'truncate' or 'skip', got "
                                  f"{self.too_long!r}")
        at_least_one({"--max-new-tokens": self.max_new_tokens, "--batch-size": self.batch_size})
        if self.max_new_tokens >= self.max_len:
            raise DraftsmithError(
                f"--max-new-tokens {self.max_new_tokens} leaves no room for a prompt in "
                f"--max-len {self.max_len}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0 or not 0 < self.top_p <= 1 \
                or self.top_k < 0:  # NaN passed `< 0`
            raise DraftsmithError(
                f"sampling: --temperature ({self.temperature}) must be a finite number >= 0, "
                f"--top-k ({self.top_k}) >= 0, --top-p ({self.top_p}) in (0, 1]"
            )

    @property
    def prompt_limit(self) -> int:
        return self.max_len - self.max_new_tokens

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "seed": self.seed}


def within_positions(cfg: RegenConfig, most: int | None,
                     say: Callable[[str], None] | None = None,
                     window: int | None = None) -> RegenConfig:
    """`cfg` for the built-in engine, which decodes no further than the target's
    max_position_embeddings (`most`) and its sliding window (`window`, which the cached engine
    does not apply): a --max-len past them is cut to them, so a prompt that cannot fit with its
    answer is truncated or skipped as one past --max-len is."""
    limit, what = most, f"max_position_embeddings {most}"
    if window and (not most or window < most):
        limit, what = window, f"sliding window of {window} tokens"
    if not limit or cfg.max_len <= limit:
        return cfg
    if cfg.max_new_tokens >= limit:
        raise DraftsmithError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a "
                              f"prompt within the target's {what}")
    (say or (lambda s: print(s, file=sys.stderr)))(
        f"regenerate: warning: --max-len {cfg.max_len} exceeds the target's {what}: prompts "
        f"are held to {limit - cfg.max_new_tokens} tokens ({limit} less --max-new-tokens "
        f"{cfg.max_new_tokens}; longer ones: --too-long {cfg.too_long})")
    return dataclasses.replace(cfg, max_len=limit)


# A server answering these to every request is set up wrongly (--api-key, --model, --base-url):
# each prompt would fail alike.
_KEY = "check --api-key (or OPENAI_API_KEY)"
FATAL_STATUS = {401: _KEY, 403: _KEY, 404: "check --model and --base-url"}
# passing refusals (a proxy's request timeout, a conflict), retried as OpenAI's own client does
PASSING = (408, 409)


@dataclass
class Answer:
    text: str
    tokens: int | None  # None: the reply did not say (no `usage`)
    finish: str  # "stop" | "length" | UNKNOWN | "error: ..." (or a server's other reason)
    ids: list[int] | None = None  # the ids the target decoded (stop id excluded), where known
    unreached: bool = False  # no server answered it: connection errors or timeouts, each retry
    lasting: bool = False  # a refusal a rerun gets again (an HTTP 4xx, a reply with no text)
    timed_out: bool = False  # the last try connected but had no answer within the timeout
    foreign_ids: bool = False  # the server's ids do not decode to its text: recorded as text
    refused: tuple[str, ...] = ()  # `server_sampling` fields the server refused, not sent
    past_context: bool = False  # refused as longer than the server's context (`context_limit`)


class EngineBackend:
    """Batched answers from the built-in engine."""

    name = "engine"

    def __init__(self, target: Any, model: Any, cfg: RegenConfig, compile: bool = False) -> None:
        from draftsmith.engine.runtime import Runtime
        from draftsmith.engine.sampling import SamplingParams

        self.target = target
        self.cfg = cfg = within_positions(cfg, target.cfg.max_position_embeddings,
                                          window=target.cfg.sliding_window)
        self.model_name = target.source
        self.params = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k)
        self.rt = Runtime(model, cfg.batch_size, cfg.max_len + 1, compile=compile,
                          kept=cfg.max_len)
        if cfg.refill:  # before regenerate's first per-chunk seed
            from draftsmith.engine.refill import prepare

            prepare(self.rt, cfg.batch_size, cfg.max_new_tokens, target.eos_ids, self.params)

    def answer(self, batch: list[Messages],
               recorded: list[Recorded] | None = None) -> list[Answer]:
        """`recorded[i]`: the ids decoded for prompt i's earlier answers, which it is asked
        after in place of their text's tokens, as capture splices them (`prompt_ids`)."""
        from draftsmith.engine.generate import run_generation
        from draftsmith.engine.refill import generate_refill

        ids = [prompt_ids(self.target.tokenizer, m, r) if r else self.target.chat_ids(m, True)
               for m, r in zip(batch, recorded or [{}] * len(batch), strict=True)]
        new, eos = self.cfg.max_new_tokens, self.target.eos_ids
        if self.cfg.refill:
            rows = decode_rows(len(ids), self.cfg.batch_size, self.rt.device)
            tokens = generate_refill(self.rt, ids, new, self.params, eos, rows)
        else:
            tokens = [t for c in range(0, len(ids), self.cfg.batch_size) for t in
                      run_generation(self.rt, ids[c : c + self.cfg.batch_size], new,
                                     self.params, eos).tokens]
        dec = self.target.tokenizer.decode
        return [Answer(dec(t, skip_special_tokens=True).strip(), len(t),
                       "length" if len(t) >= new else "stop", [int(x) for x in t])
                for t in tokens]


def prompt_ids(tok: Any, msgs: Messages, recorded: Recorded) -> list[int]:
    """The ids of a later turn's prompt as capture builds the sample that holds it
    (`chat.splice_answers`): each earlier answer as the ids the target decoded, not its stripped
    text's tokens (another context where the answer held special tokens, spaces at its ends or
    ids the tokenizer would merge). Its text's tokens where no answer can be spliced."""
    from draftsmith.data.chat import assistant_turns, render, splice_answers

    text = render(tok, msgs, True)
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        closed, turns = assistant_turns(tok, msgs)
    except (NotImplementedError, DraftsmithError):  # no offsets, or turns capture cannot find
        return list(tok(text, add_special_tokens=False)["input_ids"])
    ids = list(enc["input_ids"])
    if not recorded or not text.startswith(closed):
        return ids
    return splice_answers(tok, text, turns, ids, enc["offset_mapping"], msgs, recorded)[0]


def decode_rows(prompts: int, batch_size: int, device: torch.device) -> int:
    """The rows a refilled call decodes in: no more than its prompts (a chunk or later turn of
    fewer, `data make --n 16`, idled the rest at full cost). The rows are a function of the
    chunk, so its seeded draws repeat on a rerun; a greedy answer is the one a prompt gets alone
    on the CPU's eager steps. On CUDA always --batch-size: another row count is another graph,
    captured and compiled mid-run, and its kernels' sums part greedy answers at near-ties."""
    return batch_size if torch.device(device).type == "cuda" else max(1, min(prompts, batch_size))


# a reply's body that does not read as JSON: the text garbled, or its UTF-8 bytes
GARBLED = (json.JSONDecodeError, UnicodeDecodeError)
MOST_WAIT = 60.0  # seconds: the longest Retry-After a request waits out


def retry_after(e: BaseException) -> float:
    """The seconds a 429 or 503 asks to wait (`Retry-After`, or `retry-after-ms` as OpenAI's
    own client reads it), at most `MOST_WAIT`; 0 where it names none: a rate-limited endpoint
    refused each retry of a backoff shorter than its window, and the answer failed."""
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            wait = float(headers.get(name, "")) * scale
        except (TypeError, ValueError):  # absent, or an HTTP date: the backoff's own wait
            continue
        if wait >= 0:  # NaN and negatives: none
            return min(wait, MOST_WAIT)
    return 0.0


def pause(backoff: float, e: BaseException) -> float:
    """The wait before a retry: the backoff or the Retry-After, whichever is longer, and up to a
    quarter more at random, so that requests refused together do not come back together."""
    return max(backoff, retry_after(e)) * (1 + random.random() / 4)


SAID = 300  # characters of a server's error message a prompt's warning shows


def one_line(said: str) -> str:
    """A server's error message as one line of at most `SAID` characters: vLLM's validation
    errors run over lines, and some echo the request (a warning of thousands of characters)."""
    flat = " ".join(said.split())
    return flat if len(flat) <= SAID else flat[: SAID - 3].rstrip() + "..."


def slow(e: BaseException) -> bool:
    """A timeout of a request the server took (no answer in time), not of the connection to it
    (a ConnectTimeout of httpx or httpx2, by name as the client may use either: no server
    reached, as a refused connection)."""
    import openai

    return (isinstance(e, openai.APITimeoutError)
            and type(e.__cause__).__name__ != "ConnectTimeout")


def check_base_url(url: str) -> None:
    """--base-url an http(s) URL with a host: one without its scheme (`host:8000/v1`) failed
    every request as if no server were there, and one the client cannot parse (a bracket left
    open) was a traceback."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - read for its ValueError on a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise DraftsmithError(f"--base-url {redacted_url(url)!r} is not an http:// or https:// "
                              "URL with a host: give it as http://HOST:PORT/v1")


TIMEOUT = 600.0  # seconds an answer may take (`--timeout`; the openai client's own default)


def check_server_options(concurrency: int, retries: int, timeout: float = TIMEOUT) -> None:
    if concurrency < 1:
        raise DraftsmithError(f"--concurrency must be >= 1, got {concurrency}")
    if retries < 0:
        raise DraftsmithError(f"--retries must be >= 0, got {retries}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise DraftsmithError(f"--timeout must be a number of seconds > 0, got {timeout:g}")


class OpenAIBackend:
    """Answers from an OpenAI-compatible server through the `openai` client, `concurrency`
    requests at a time, retrying connection errors, timeouts, 408, 409, 429 and 5xx (waiting at
    least their Retry-After, `retry_after`, jittered: `pause`) and replies that are not JSON
    with backoff; a 401, 403 or 404 (`FATAL_STATUS`) or a context shorter than --max-len
    (`context_limit`) stops the run, and so does a chunk none of whose
    requests reached the server while later chunks remain (`regenerate`, `gone`)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, cfg: RegenConfig, concurrency: int = 8,
                 retries: int = 5, backoff: float = 1.0, api_key: str | None = None,
                 timeout: float = TIMEOUT, tokenizer: Any = None) -> None:
        import openai

        check_server_options(concurrency, retries, timeout)
        check_base_url(base_url)
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY",
                                    max_retries=0, timeout=timeout)
        # as records and messages show it: credentials in the URL stay with the client alone
        self.base_url, self.model_name, self.cfg = redacted_url(base_url), model, cfg
        self.timeout, self.concurrency = timeout, concurrency
        self.retries, self.backoff, self.tokenizer = retries, backoff, tokenizer
        self.closed = threading.Event()
        self.pool = Requests(concurrency)
        self.ask_ids = True  # vLLM's return_token_ids, until the server refuses the field
        self.extras = server_sampling(cfg)  # less the fields a strict server refuses by name
        self.ids_lock = threading.Lock()
        self.told_foreign = False  # the warning on ids of another vocabulary, said once
        self.reached = False  # whether the server has answered any request of this run

    def answer(self, batch: list[Messages]) -> list[Answer]:
        futures = [self.pool.submit(self.one, m) for m in batch]
        try:
            return [f.result() for f in futures]
        finally:  # after a fatal status, the requests not yet sent are not sent
            for f in futures:
                f.cancel()

    def one(self, messages: Messages) -> Answer:
        import openai

        # a reply cut short or garbled (a proxy, a server crashing mid-write): its JSON unread,
        # which escaped the worker as a traceback that ended the run and its chunk's answers
        # (cut inside a character: not UTF-8, as servers write their JSON unescaped)
        retry = (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                 openai.InternalServerError, *GARBLED)
        for attempt in range(self.retries + 1):
            if self.closed.is_set():  # a ctrl-C: no request, nor retry, after it
                return Answer("", 0, "error: stopped")
            try:
                r = self.create(messages)
            except retry as e:
                self.reached |= isinstance(e, openai.APIStatusError)  # a 429 or 5xx answers
                if attempt == self.retries:
                    what = ("the server's reply is not valid JSON" if
                            isinstance(e, GARBLED) else type(e).__name__)
                    return Answer("", 0, f"error: {what}: {one_line(str(e))}",
                                  unreached=isinstance(e, openai.APIConnectionError),
                                  timed_out=slow(e))
                self.closed.wait(pause(self.backoff * 2**attempt, e))
            except openai.APIStatusError as e:
                self.reached = True
                self._check_status(e)
                if e.status_code in PASSING and attempt < self.retries:
                    self.closed.wait(pause(self.backoff * 2**attempt, e))
                    continue
                return Answer("", 0, f"error: HTTP {e.status_code}: {one_line(e.message)}",
                              lasting=e.status_code < 500 and e.status_code not in PASSING,
                              past_context=context_limit(e) is not None)
            else:
                self.reached = True
                answer = reply(r, self.model_name, self.tokenizer, self.cfg.max_new_tokens)
                if answer.foreign_ids:
                    self._say_foreign_ids()
                answer.refused = tuple(sorted(set(server_sampling(self.cfg)) - set(self.extras)))
                return answer
        raise AssertionError("unreachable")

    def _check_status(self, e: Any) -> None:
        """Stops the run at a refusal every request would get alike: a `FATAL_STATUS`, or one
        naming a context shorter than --max-len (below --max-new-tokens, no prompt fits); one
        within it is the prompt's alone (a server counting with another tokenizer)."""
        if e.status_code in FATAL_STATUS:
            raise DraftsmithError(
                f"{self.base_url}: HTTP {e.status_code} for model {self.model_name!r} "
                f"({e.message}): {FATAL_STATUS[e.status_code]}") from None
        limit = context_limit(e)
        if limit is None or limit >= self.cfg.max_len:
            return
        where = (f"{self.base_url} serves {self.model_name!r} with a context of {limit} tokens "
                 f"(HTTP {e.status_code})")
        if self.cfg.max_new_tokens >= limit:
            raise DraftsmithError(f"{where}: --max-new-tokens {self.cfg.max_new_tokens} leaves "
                                  f"no room for a prompt: lower --max-new-tokens "
                                  f"{self.cfg.max_new_tokens}, with --max-len {limit} at most")
        raise DraftsmithError(f"{where}, less than --max-len {self.cfg.max_len}: rerun with "
                              f"--max-len {limit}, so prompts are cut to fit it, or serve the "
                              "target with a longer context")

    def _say_foreign_ids(self) -> None:
        with self.ids_lock:
            if not self.told_foreign:
                self.told_foreign = True
                tell(f"regenerate: warning: {self.base_url}'s token ids for an answer do not "
                      "decode to its text with this run's target tokenizer (--target): such "
                      "answers are recorded as text; if --model "
                      f"{self.model_name!r} is not that target, its answers are another "
                      "model's")

    def create(self, messages: Messages) -> Any:
        """One chat completion, asking for the answer's ids (`IDS_FIELD`) and sending the
        sampling fields beyond OpenAI's (`server_sampling`) until a server refuses them by
        name (vLLM before 0.6.5, OpenAI's own API, gateways that forbid fields they do not
        know: a 400 or 422 on every request); then asked again without them, as is every later
        request (answers recorded as text, which capture tokenizes). A field the user set
        (--top-k) that the server refuses stops the run (`_drop_extras`)."""
        import openai

        while True:
            ask, extras = self.ask_ids, self.extras
            try:
                return self.client.chat.completions.create(
                    model=self.model_name, messages=messages, max_tokens=self.cfg.max_new_tokens,
                    temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                    seed=request_seed(self.cfg.seed, messages), **PENALTIES,
                    extra_body=extras | ({IDS_FIELD: True} if ask else {}),
                )
            except openai.APIStatusError as e:
                named = refused_fields(e, [*extras, *([IDS_FIELD] if ask else [])])
                if not named or self.closed.is_set():
                    raise
                if IDS_FIELD in named:
                    self._stop_asking_ids(e.status_code)
                if named - {IDS_FIELD}:
                    self._drop_extras(named - {IDS_FIELD}, e)

    def _drop_extras(self, names: set[str], e: Any) -> None:
        """Stop sending the sampling fields a server refuses by name: sent at their off values
        only to keep vLLM's and SGLang's generation_config defaults out, which a server that
        does not know them cannot apply. One the user set (--top-k) cannot be kept so."""
        if self.cfg.top_k and "top_k" in names:
            raise DraftsmithError(
                f"{self.base_url} refuses top_k (HTTP {e.status_code}: {e.message}): it cannot "
                f"sample as --top-k {self.cfg.top_k} asks: drop --top-k {self.cfg.top_k}, or "
                "serve the target with vLLM or SGLang, which take it")
        with self.ids_lock:
            if not names & set(self.extras):  # another request dropped them first
                return
            self.extras = {k: v for k, v in self.extras.items() if k not in names}
            tell(f"regenerate: note: {self.base_url} refuses {', '.join(sorted(names))} (HTTP "
                  f"{e.status_code}): asked without them (each at its off value, so the "
                  "sampling is the same unless the server has defaults of its own for them); "
                  "the answers record them as `refused`")

    def _stop_asking_ids(self, status: int) -> None:
        with self.ids_lock:
            if self.ask_ids:
                self.ask_ids = False
                tell(f"regenerate: note: {self.base_url} refuses {IDS_FIELD} (HTTP {status}): "
                      "answers are recorded as text, which capture tokenizes")

    def close(self) -> None:
        """Ends the workers without waiting for the requests in flight (after a ctrl-C they
        would hold the exit up to the request timeout): their answers are abandoned."""
        self.closed.set()
        self.pool.close()


class Requests:
    """`n` daemon threads running submitted calls. ThreadPoolExecutor's workers are joined
    by its shutdown and again at Python's exit, so a ctrl-C waited for every request in
    flight; these are left to end with the process."""

    def __init__(self, n: int) -> None:
        self.todo: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = \
            queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"regenerate-{k}", daemon=True)
                        for k in range(max(1, n))]
        for t in self.threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        f: Future = Future()
        self.todo.put((f, fn, args))
        return f

    def _work(self) -> None:
        while (job := self.todo.get()) is not None:
            f, fn, args = job
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # f.result() raises it in the caller
                f.set_exception(e)

    def close(self) -> None:
        """Calls not begun are cancelled; those running end when their request does."""
        while True:
            try:
                job = self.todo.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self.threads:
            self.todo.put(None)


PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
IDS_FIELD = "return_token_ids"  # vLLM's, SGLang's and draftsmith serve's: the answer's ids


# how servers word a field they do not know (pydantic, serde, OpenAI's API, draftsmith serve)
UNKNOWN_FIELD = ("extra_forbidden", "extra inputs are not permitted", "unknown field",
                 "unrecognized request argument", "is not supported")


def refused_fields(e: Any, fields: list[str]) -> set[str]:
    """Those of `fields` a 400 or 422 names as fields it does not know (pydantic's
    extra_forbidden, serde's unknown field, OpenAI's unrecognized argument); none for an error
    that does not say so, though its body echoes the request, as vLLM's validation errors do,
    which would turn the ids off for the run."""
    said = f"{e.message} {e.body}"
    if e.status_code not in (400, 422) or not any(w in said.lower() for w in UNKNOWN_FIELD):
        return set()
    return {f for f in fields if re.search(rf"\b{f}\b", said)}


# how vLLM, SGLang and TGI name the model's context in refusing a request past it
CONTEXT_SAYS = re.compile(r"(?:context|model|allowed) length (?:is |of |\()(\d+)"
                          r"|max_new_tokens` must be <= (\d+)")


def context_limit(e: Any) -> int | None:
    """The context in tokens a 4xx refusal names (vLLM's --max-model-len, SGLang's
    --context-length), or None."""
    found = CONTEXT_SAYS.search(f"{e.message} {e.body}") if 400 <= e.status_code < 500 else None
    return int(next(g for g in found.groups() if g)) if found else None


def refuses_ids(e: Any) -> bool:
    """A 400 or 422 that names `IDS_FIELD` as a field it does not know (`refused_fields`)."""
    return bool(refused_fields(e, [IDS_FIELD]))


def request_seed(seed: int, messages: Messages) -> int:
    """A request's own seed, from --seed and its messages: vLLM and SGLang seed a generator per
    request, so one seed for all drew the same noise for every prompt at each step (answers
    correlated across the data); the same conversation still gets the same seed on a rerun."""
    key = json.dumps([seed, messages], sort_keys=True, ensure_ascii=False).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") >> 1  # 31 bits: any server


def server_sampling(cfg: RegenConfig) -> dict[str, Any]:
    """The sampling fields outside OpenAI's API, each sent: vLLM and SGLang give a field a
    request leaves out the model's generation_config.json value (Qwen's top_k 20, top_p 0.8,
    repetition_penalty 1.05), not the one this run records. top_k -1 is "off" to both (SGLang
    refuses 0), min_p 0 and repetition_penalty 1 are no-ops; the engine has neither."""
    return {"top_k": cfg.top_k or -1, "min_p": 0.0, "repetition_penalty": 1.0}


# finish reasons of an answer the server cut off for its own reasons, not the target's end nor
# max_tokens (vLLM's "abort" for a request it dropped, "error"; a proxy's "content_filter"):
# kept, its partial text would train the end of turn that capture closes it with
UNFINISHED = ("abort", "error", "content_filter", "cancelled")
# the finish recorded for a reply with a null or no finish_reason whose answer did not reach
# max_tokens (`finish_of`): not counted a clean stop; capture closes it as a whole turn
UNKNOWN = "unknown"


def reply(r: Any, asked: str = "", tok: Any = None, most: int | None = None) -> Answer:
    """The Answer in a chat completion; a failed one for a reply with none (a proxy's HTML page,
    an error object sent with status 200), which is counted and retried by a rerun. A reply
    that names another model than `asked` stops the run: a router's fallback or an alias
    answered, and its answers would be recorded as the target's. `most`: the max_tokens asked,
    by which a reply without a finish reason is told cut (`finish_of`)."""
    served = getattr(r, "model", None)
    if asked and isinstance(served, str) and served and served != asked:
        raise DraftsmithError(
            f"the server answered with model {served!r}, not {asked!r} as asked (a router's "
            f"fallback, an alias): pass --model {served} if that is the target, else point "
            "--base-url at the target's own server")
    choices = getattr(r, "choices", None)
    message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices \
        else None
    if not hasattr(message, "content"):  # None, or bare text the client passed on unchecked
        return Answer("", 0, f"error: the server's reply holds no answer: {str(r)[:200]!r}")
    if getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None):
        raise DraftsmithError(
            "the server returns the answer's reasoning apart from its text (it runs a reasoning "
            "parser): the drafter must learn all the target writes; serve it without one")
    used = getattr(getattr(r, "usage", None), "completion_tokens", None)
    raw_ids = getattr(choices[0], "token_ids", None)
    finish = finish_of(getattr(choices[0], "finish_reason", None), used, raw_ids, most)
    if finish in UNFINISHED:
        return Answer("", 0, f"error: the server cut the answer off (finish_reason {finish!r}): "
                             "not kept as an answer, a rerun asks again")
    calls = getattr(message, "tool_calls", None)
    if not isinstance(message.content, str) or (calls and not message.content.strip()):
        # a tool call, or a parser that took the text: no answer of the target's to learn; an
        # empty string is one (an end of turn at once), kept as the built-in engine keeps it
        what = " but a tool call" if calls else ""
        return Answer("", 0, f"error: the server's reply holds no text{what} (finish "
                             f"{finish}): not kept as an answer", lasting=True)
    text = without_end(message.content.strip(), finish, tok)
    ids = served_ids(raw_ids, finish, tok)
    foreign = ids is not None and not _spells(tok, ids, text)
    kept = None if foreign else ids
    return Answer(text, answer_count(used, finish, kept, tok), finish, kept, foreign_ids=foreign)


def answer_count(used: Any, finish: str, ids: list[int] | None, tok: Any) -> int | None:
    """An answer's tokens as the engine counts them, without the end token that stopped it:
    vLLM, SGLang and `draftsmith serve` count it in `usage.completion_tokens`, though its text
    leaves it out. The target's ids where served (`served_ids`: that token dropped), else the
    server's count, less one for an answer that stopped (as `served_ids` reads `UNKNOWN`) where
    the target's tokenizer is known (as for `served_ids`: without it, no end token is known);
    None where the reply gives neither."""
    if ids is not None:
        return len(ids)
    if not isinstance(used, int) or isinstance(used, bool):
        return None
    if tok is None or finish not in ("stop", UNKNOWN):
        return used
    return max(used - 1, 0)


def finish_of(said: Any, used: Any, ids: Any, most: int | None) -> str:
    """The finish reason the server gave; where it gave none (null or absent), "length" for an
    answer of `most` tokens or more by the server's own count (`usage`, else its ids), as the
    engine tells a cut answer, else `UNKNOWN`: a "stop" it did not say."""
    if isinstance(said, str) and said:
        return said
    count = used if isinstance(used, int) else len(ids) if isinstance(ids, list) else None
    return "length" if most is not None and count is not None and count >= most else UNKNOWN


def served_ids(ids: Any, finish: str, tok: Any, text: str | None = None) -> list[int] | None:
    """The ids a server decoded for an answer (vLLM's `return_token_ids`), as the engine records
    them: without the special token that stopped it (vLLM's end with it, the engine's do not;
    one that ends an answer of `UNKNOWN` finish, short of max_tokens, most likely stopped it).
    None for a server that sends none, no tokenizer to read them with, or (`text` given) ids
    that do not decode to the answer's text with it: another model's vocabulary (the default
    tokenizer, a --model other than the target), whose stop token `control_ids` cannot tell and
    capture, skipping special tokens as it decodes, would have trained as the answer's."""
    if tok is None or not isinstance(ids, list) or not all(type(t) is int and t >= 0
                                                           for t in ids):
        return None
    if finish in ("stop", UNKNOWN) and ids and (ids[-1] in control_ids(tok)
                                                or _is_end(tok, ids[-1])):
        ids = ids[:-1]
    if text is not None and not _spells(tok, ids, text.strip()):
        return None
    return ids


def _spells(tok: Any, ids: list[int], text: str) -> bool:
    """Whether `ids` decode to `text`, with spaces cleaned up or not: Llama 3's tokenizer config
    cleans them (` .` to `.`, ` 's` to `'s`) where vLLM's detokenizer does not. False past the
    tokenizer's vocabulary."""
    try:
        return any(tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=c)
                   .strip() == text for c in (False, True))
    except Exception:  # noqa: BLE001 - a tokenizer's own error for ids it does not hold
        return False


_END_MARKS: dict[tuple[int, str, str | None], tuple[str, ...]] = {}


def end_marks(tok: Any) -> tuple[str, ...]:
    """The texts of the tokens that end an answer: the chat template's closing marker
    ("<|im_end|>") and the eos token."""
    key = (id(tok), str(getattr(tok, "chat_template", "")), getattr(tok, "eos_token", None))
    if key not in _END_MARKS:
        from draftsmith.data.chat import closing_marker

        if len(_END_MARKS) > 64:
            _END_MARKS.clear()
        marks = (closing_marker(tok), getattr(tok, "eos_token", None))
        _END_MARKS[key] = tuple(dict.fromkeys(m for m in marks if isinstance(m, str) and m))
    return _END_MARKS[key]


def without_end(text: str, finish: str, tok: Any) -> str:
    """An answer's text less the end token written out after it: vLLM and SGLang leave it in
    with skip_special_tokens off, or for an end token the tokenizer does not mark special.
    Left in, capture read it as the end id and closed the turn with a second one."""
    if tok is None or finish not in ("stop", UNKNOWN):
        return text
    for mark in end_marks(tok):
        if text.endswith(mark):
            return text[: -len(mark)].rstrip()
    return text


def _is_end(tok: Any, i: int) -> bool:
    """Whether id `i` is written as an end token's text (`end_marks`), special or not."""
    try:
        return tok.convert_ids_to_tokens(i) in end_marks(tok)
    except Exception:  # noqa: BLE001 - a tokenizer's own error for an id it does not hold
        return False


def control_ids(tok: Any) -> set[int]:
    """The tokenizer's special ids: the chat template's own (`<|im_start|>`, Llama 3's headers),
    bos, eos, pad: those a decode skips (self-made prompts cut a question at one; a served
    answer's last one stopped it)."""
    added = getattr(tok, "added_tokens_decoder", None) or {}
    return {int(i) for i, t in added.items() if getattr(t, "special", False)} | set(
        getattr(tok, "all_special_ids", ()))


def fit_prompt(target_tok: Any, conv: Conversation, limit: int, mode: str,
               count: Callable[[Messages], int]) -> Conversation | None:
    """The conversation with its first user message cut to fit `limit` tokens, or None."""
    over = count(opening(conv.messages)) - limit
    if over <= 0:
        return conv
    if mode == "skip":
        return None
    msgs = [dict(m) for m in conv.messages]
    k = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    for _ in range(4):
        toks = target_tok(msgs[k]["content"], add_special_tokens=False)["input_ids"]
        keep = len(toks) - over - 2
        if keep < 1:
            return None
        msgs[k]["content"] = _head(target_tok, msgs[k]["content"], toks, keep)
        over = count(opening(msgs)) - limit
        if over <= 0:
            return Conversation(msgs, conv.id, dict(conv.meta))
    return None


def _head(tok: Any, text: str, toks: list[int], keep: int) -> str:
    """`text` up to its token `keep`, cut where the tokenizer says that token starts: decoding
    the first `keep` tokens wrote a character they split as U+FFFD and text the tokenizer cannot
    spell back (an unknown token) as its name. Decoded where it gives no offsets (a slow one)."""
    try:
        spans = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        spans = None
    if spans is None or len(spans) != len(toks) or not spans[keep][0]:
        return tok.decode(toks[:keep])
    return text[: spans[keep][0]]


def regenerate(
    convs: list[Conversation],
    out: str | Path,
    backend: EngineBackend | OpenAIBackend,
    tokenizer: Any,
    cfg: RegenConfig = RegenConfig(),
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, int]:
    """Answer every conversation not yet in `out`; returns counts."""
    from draftsmith.data.progress import Progress

    say = log or (lambda s: print(s, file=sys.stderr))
    out = Path(out)
    if isinstance(backend, EngineBackend) and backend.cfg.max_len < cfg.max_len:
        cfg = dataclasses.replace(cfg, max_len=backend.cfg.max_len)  # the target's positions
    info = answerer(backend, cfg)
    step = cfg.batch_size * (REFILL_CHUNK if _refills(backend) else 1)
    records, torn = appended_records(out)
    torn = torn or write_cut(records)
    done = {_prompt_id(out, line, r) for line, r in records}
    # a file with nothing left to answer takes no more answers: any batching may reread it
    full = not torn and all(c.id in done for c in convs)
    _same_answerer(out, records, {k: v for k, v in info.items()
                                  if not (full and k in ENGINE)})
    # the engine answers a chunk a kill tore again whole, as it sampled it uninterrupted; a
    # server's answers (not reproducible, paid for) are kept
    if torn and isinstance(backend, EngineBackend):
        chunk_of = {c.id: i // step for i, c in enumerate(convs)}
        records = drop_last_write(out, records, lambda r: chunk_of.get(_pid(r)))
        done = {_prompt_id(out, line, r) for line, r in records}
    cut = _grown_chunk(records, convs, step, info) if _redoes(backend, cfg) else None
    if cut is not None:  # kept on disk until the chunk's whole answers are written
        done = {_prompt_id(out, line, r) for line, r in records[:cut]}
        say(f"regenerate: the last chunk {out} holds was sampled with {len(records) - cut} "
            "answered prompts of the more it now has: they are answered again with the rest, "
            "as a run of this whole input samples them")
    todo = [c for c in convs if c.id not in done]
    stats = {"done_before": len(convs) - len(todo), "answered": 0,
             "redone": len(records) - cut if cut is not None else 0, "skipped_too_long": 0,
             "truncated": 0, "turns_cut": 0, "template_refused": 0, "failed": 0,
             "refused_by_server": 0, "timed_out": 0, "answer_tokens": 0,
             "answers_at_max_new": 0, "finish_unknown": 0}
    count = _counter(tokenizer, isinstance(backend, EngineBackend))
    if todo:
        say(f"regenerate: {len(todo)} conversations to answer, {sampling_words(cfg)}, at most "
            f"{cfg.max_new_tokens} new tokens each")
    bar = Progress(len(convs), stats["done_before"], "conv", "regenerate", progress, say)
    make_folder(out.parent)
    append_whole(out, b"", f"it keeps the {stats['done_before']} conversations answered "
                 "before; a rerun resumes after them")
    job = _Job(out, backend, tokenizer, cfg, count, info, stats, bar, say)
    try:  # closed before an error is told: on a terminal it ran on from the bar
        if isinstance(backend, OpenAIBackend):
            _Window(job, convs, done, step).run()
        else:
            _answer_chunks(job, convs, done, step, records, cut)
    finally:
        bar.close()
    say(closing_line(stats))
    return stats


@dataclass
class _Job:
    """What the answering of a run shares: where it writes, who answers how, and its counts."""

    out: Path
    backend: Any
    tok: Any
    cfg: RegenConfig
    count: Counts
    info: dict[str, Any]
    stats: dict[str, int]
    bar: Any
    say: Callable[[str], None]

    def kept(self, written: int) -> str:
        return f"the {self.stats['done_before'] + written} conversations answered before"

    def append(self, recs: list[dict], written: int) -> None:
        """One write: a kill or a full disk keeps a chunk whole or not at all (a part would be
        resumed in a smaller batch, sampled otherwise)."""
        append_whole(self.out, "".join(json.dumps(rec, ensure_ascii=False) + "\n"
                                       for rec in mark_write(recs)).encode(),
                     f"it keeps {self.kept(written)}; a rerun resumes after them")

    def stopped(self, written: int, unwritten: int = 0) -> None:
        self.bar.close()
        again = (f" (the {unwritten} conversations in flight or finished but not yet written "
                 "are asked again)") if unwritten else ""
        self.say(f"regenerate: stopped (ctrl-C): {self.out} keeps {self.kept(written)}; a "
                 f"rerun resumes after them{again}")


def _answer_chunks(job: _Job, convs: list[Conversation], done: set[str], step: int,
                   records: list[tuple[int, dict[str, Any]]], cut: int | None) -> None:
    """The engine's answers (or a backend's of `answer` alone), a chunk of `step` at a time."""
    stats, backend = job.stats, job.backend
    # chunks and seeds by place in `convs`, not in what is left: prompts skipped or failed
    # before are not written, and must not shift a resumed run's chunks
    for c in range(0, len(convs), step):
        chunk = [x for x in convs[c : c + step] if x.id not in done]
        if not chunk:
            continue
        torch.manual_seed(job.cfg.seed * 1_000_003 + c)
        there = stats["answered"] + (0 if cut is None else stats["redone"])
        try:
            recs, unreached, slowed = _answer_chunk(chunk, backend, job.tok, job.cfg, job.count,
                                                    job.info, stats)
            # the server is gone: each later chunk would fail alike (counted only then: a
            # scan of the rest every chunk was quadratic in the prompts)
            if unreached and (left := sum(x.id not in done for x in convs[c + step :])):
                raise DraftsmithError(gone(backend, unreached, left, slowed))
        except DraftsmithError as e:
            raise DraftsmithError(f"{e} ({job.out} keeps {job.kept(there)}; a rerun resumes "
                                  "after them)") from None
        except KeyboardInterrupt:  # the chunk's answers so far are dropped, not waited for
            job.stopped(there)
            raise
        if isinstance(backend, EngineBackend):
            for rec in recs:  # the prompts it was asked with: a larger input redoes it
                rec["meta"]["chunk"] = [c, len(convs[c : c + step])]
        if cut is not None:
            records, cut = cut_records(job.out, records, cut), None
        job.append(recs, there)
        job.bar.update(len(chunk))


# finished conversations a server's run holds for the file's order, per --concurrency: one slow
# answer idles no slot until this many have finished after it
BUFFERED = 4


class _Window:
    """A server's answers: --concurrency conversations in flight, each one's turns in turn, the
    next begun as soon as one ends. They are written in input order, a chunk of `step` input
    places at a time as chunked runs wrote them, so the file is theirs; at most
    max(BUFFERED x concurrency, step) conversations are finished or in flight past the first
    unwritten one. A whole chunk none of whose requests reached the server stops the run
    (`gone`); while the last requests ended so, no conversation is begun."""

    def __init__(self, job: _Job, convs: list[Conversation], done: set[str], step: int) -> None:
        self.job, self.pool = job, job.backend.pool
        self.todo = [(c, i // step) for i, c in enumerate(convs) if c.id not in done]
        self.size = Counter(k for _, k in self.todo)
        self.left = Counter(self.size)  # per chunk: its conversations not finished
        self.tried = {k: [0, 0, 0] for k in self.size}  # per chunk: requests, unreached, slow
        self.most = max(BUFFERED * job.backend.concurrency, step)
        self.results: dict[int, dict | None] = {}  # finished, not written: place -> record
        self.flying: dict[Future, tuple[int, Talk, Messages]] = {}
        self.begun = self.written_to = self.written = self.streak = 0

    def run(self) -> None:
        try:
            while self._flush() < len(self.todo):
                self._start()
                if not self.flying:  # paused on requests that reached no server; none left
                    self.streak = 0
                    continue
                finished, _ = wait(self.flying, return_when=FIRST_COMPLETED)
                for f in finished:
                    self._turned(f)
        except KeyboardInterrupt:  # the answers not written are dropped, not waited for
            self.job.stopped(self.written, self.begun - self.written_to)
            raise
        finally:
            for f in self.flying:
                f.cancel()

    def _start(self) -> None:
        job = self.job
        while (not self.streak and len(self.flying) < job.backend.concurrency
               and self.begun < len(self.todo)
               and len(self.results) + len(self.flying) < self.most):
            i, self.begun = self.begun, self.begun + 1
            self._next(i, _open(self.todo[i][0], job.tok, job.cfg, job.count, job.stats))

    def _next(self, i: int, talk: Talk | None) -> None:
        """The talk's next turn asked, or the talk finished."""
        job = self.job
        try:  # the chat template may refuse a later turn: the run stops, as a chunk's does
            ask = _ask(talk, job.cfg, job.count, job.stats) if talk is not None else None
        except DraftsmithError as e:
            raise self._error(str(e)) from None
        if ask is not None:
            self.flying[self.pool.submit(job.backend.one, ask)] = (i, talk, ask)
            return
        self.results[i] = _record(talk, job.stats) if talk is not None else None
        k = self.todo[i][1]
        self.left[k] -= 1
        job.bar.update(1)
        if not self.left[k]:
            self._check_reached(k)

    def _turned(self, f: Future) -> None:
        i, talk, ask = self.flying.pop(f)
        try:
            ans = f.result()
        except DraftsmithError as e:
            raise self._error(str(e)) from None
        tried = self.tried[self.todo[i][1]]
        tried[0], tried[1], tried[2] = (tried[0] + 1, tried[1] + ans.unreached,
                                        tried[2] + ans.timed_out)
        self.streak = self.streak + 1 if ans.unreached else 0
        _take(talk, ask, ans, self.job.tok, self.job.info, self.job.stats)
        self._next(i, talk)

    def _check_reached(self, k: int) -> None:
        asked, unreached, slowed = self.tried[k]
        left = len(self.todo) - self.begun + len(self.flying)
        if asked and unreached == asked and left:
            self._flush()
            raise self._error(gone(self.job.backend, asked, left, slowed))

    def _error(self, why: str) -> DraftsmithError:
        """`why`, naming what the file keeps: each chunk finished before it, written first."""
        self._flush()
        return DraftsmithError(f"{why} ({self.job.out} keeps {self.job.kept(self.written)}; a "
                               "rerun resumes after them)")

    def _flush(self) -> int:
        """Each chunk whose conversations have all finished written, in input order; the
        places written."""
        while self.written_to < len(self.todo) and not self.left[self.todo[self.written_to][1]]:
            end = self.written_to + self.size[self.todo[self.written_to][1]]
            recs = [r for i in range(self.written_to, end)
                    if (r := self.results.pop(i)) is not None]
            if recs:
                self.job.append(recs, self.written)
            self.written, self.written_to = self.written + len(recs), end
        return self.written_to


def retryable(stats: dict[str, int]) -> int:
    """Failed conversations a rerun may answer: not those the server refused (an HTTP 4xx, a
    reply with no text), which a rerun gets again and the closing line counts."""
    return stats.get("failed", 0) - stats.get("refused_by_server", 0)


def failed_words(stats: dict[str, int], out: Path, base_url: str | None, after: str = "") -> str:
    """One line for a run that left conversations a rerun may answer (`retryable`): how many,
    what the file keeps (`after`: what else the run left undone), and that a rerun asks them
    again (`data regenerate`'s exit, `data make`'s stop before capture)."""
    kept = stats["done_before"] + stats["answered"]
    asked = stats["failed"] + stats["answered"]
    where = f" (is the server at {redacted_url(base_url)} up?)" if base_url else ""
    if base_url and stats.get("timed_out"):  # it answered others: up, but slow under the load
        where = (f" ({stats['timed_out']} timed out: the server at {redacted_url(base_url)} "
                 "is slow under this load; lower --concurrency or raise --timeout)")
    # appended, not put back in input order: capture --grow keeps the shards of the lines
    # before, as of any answers file grown since
    return (f"regenerate: {retryable(stats)} of the {asked} conversations asked failed{where}, "
            f"see the warnings above; {out} keeps the {kept} answered{after}: rerun the same "
            "command to ask the failed ones again (their answers are written after the others)")


# the closing line's names where a stat's key reads otherwise ("truncated" counts prompts)
WORDS = {"truncated": "prompts truncated", "redone": "answered again in their grown chunk",
         "refused_by_server": "of them refused (a rerun gets the same)",
         "timed_out": "of them timed out",
         "answers_at_max_new":
         "answered ones cut at --max-new-tokens",  # this run's: done_before's are not counted
         "finish_unknown": "answers without a finish reason"}


def closing_line(stats: dict[str, int]) -> str:
    """The run's figures in one line; the failures' "of them" counts only where some failed,
    the grown chunk's only where one was answered again, and the answers without a finish
    reason only where some came."""
    quiet = {"refused_by_server", "timed_out"} if not stats.get("failed") else set()
    quiet |= {k for k in ("redone", "finish_unknown") if not stats.get(k)}
    return "regenerate: " + ", ".join(f"{WORDS.get(k, k)} {v}" for k, v in stats.items()
                                      if k not in quiet)


def sampling_words(cfg: RegenConfig) -> str:
    """How the answers are drawn, in words: greedy, or the sampling settings."""
    if cfg.temperature == 0:
        return "greedy (--temperature 0)"
    parts = [f"--temperature {cfg.temperature:g}", f"--top-p {cfg.top_p:g}"]
    if cfg.top_k:
        parts.append(f"--top-k {cfg.top_k}")
    return f"sampled ({', '.join(parts)}, --seed {cfg.seed})"


# a recorded sampling's fields as flags; top_p, top_k and seed do nothing at temperature 0
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                  "max_new_tokens": "--max-new-tokens", "seed": "--seed"}
GREEDY_IGNORES = ("top_p", "top_k", "seed")


def sampling_diff(there: Any, now: dict[str, Any]) -> tuple[str, str]:
    """Two recorded samplings as the flags they differ in (greedy as such), not dicts."""
    if not isinstance(there, dict):
        return ("no recorded sampling" if there is None else f"an unknown sampling ({there})",
                _flags(now, list(SAMPLING_FLAGS)))
    keys = [k for k in SAMPLING_FLAGS if there.get(k) != now.get(k)]
    return _flags(there, keys), _flags(now, keys)


def _flags(s: dict[str, Any], keys: list[str]) -> str:
    greedy = s.get("temperature") == 0
    words = [_flag(k, s.get(k)) for k in keys if not (greedy and k in GREEDY_IGNORES)]
    if greedy and "temperature" not in keys:
        words.insert(0, _flag("temperature", 0))
    return " ".join(words) or "the same flags"


def _flag(key: str, value: Any) -> str:
    if key == "temperature" and value == 0:
        return "--temperature 0 (greedy)"
    if key == "top_k" and value == 0:
        return "--top-k 0 (off)"
    shown = "none" if value is None else f"{value:g}" if isinstance(value, float) else value
    return f"{SAMPLING_FLAGS[key]} {shown}"


def _redoes(backend: Any, cfg: RegenConfig) -> bool:
    """Whether a chunk asked with fewer prompts than it now holds is answered again whole:
    the engine's sampled draws are the chunk's (a server seeds each request by its messages,
    and a greedy answer is its prompt's alone)."""
    return isinstance(backend, EngineBackend) and cfg.temperature > 0


def _grown_chunk(records: list[tuple[int, dict[str, Any]]], convs: list[Conversation],
                 step: int, info: dict[str, Any]) -> int | None:
    """Where the last write of `records` begins when it is the engine's chunk of an earlier,
    smaller input (`data make` with a smaller --n, a prompt file grown since): a fresh run
    of `convs` samples that chunk with all its prompts together, so it is asked again whole
    (None: the last chunk is whole, or written before chunks or its batching were recorded)."""
    meta = (records[-1][1].get("meta") or {}) if records else {}
    place, answers = meta.get("chunk"), meta.get("answers") or [{}]
    if not (isinstance(place, list) and len(place) == 2 and all(type(x) is int for x in place)
            and isinstance(answers[0], dict)
            and all(answers[0].get(k) == info[k] for k in BATCHING)):
        return None
    start, size = place
    asked = convs[start : start + step]
    k = last_write(records, lambda r: None)
    ids = {c.id for c in asked}
    if len(asked) <= size or k == len(records) or not all(_pid(r) in ids
                                                          for _, r in records[k:]):
        return None
    return k


def _pid(rec: dict[str, Any]) -> str | None:
    meta = rec.get("meta")
    pid = meta.get("prompt_id") if isinstance(meta, dict) else None
    return pid if isinstance(pid, str) else None


def _prompt_id(out: Path, line: int, rec: dict[str, Any]) -> str:
    pid = _pid(rec)
    if pid is None:
        raise DraftsmithError(f"{out}:{line}: not an answer `regenerate` wrote (no "
                              "meta.prompt_id): write to another file (regenerate --out, or "
                              "another `data make` folder)")
    return pid


def answered_by(name: str, model: str, cfg: RegenConfig, target: Any = None) -> dict[str, Any]:
    """Every answer's record of who answered (`answerer`'s base): the backend, the model, the
    sampling, and an engine's `target` by its fingerprint. Built without a live backend, so
    `data make` checks a folder's answers by it before the target's weights load."""
    info = {"backend": name, "model": model, "sampling": cfg.sampling()}
    return info | ({"target": target.fingerprint} if target is not None else {})


def answerer(backend: Any, cfg: RegenConfig) -> dict[str, Any]:
    """What each answer records of who answered and how (`answered_by`): the engine's also its
    batching (`BATCHING`: the rows sampled together and their seeds) and its numerics
    (`NUMERICS`), a server's requests by the fields sent beyond OpenAI's (`sent`)."""
    engine = isinstance(backend, EngineBackend)
    info = answered_by(backend.name, backend.model_name, cfg,
                       backend.target if engine else None)
    if engine:
        info |= {"batch_size": backend.cfg.batch_size, "refill": backend.cfg.refill,
                 "dtype": dtype_name(backend.rt.dtype), "compile": backend.rt.compiled}
    if isinstance(backend, OpenAIBackend):
        info |= {"base_url": backend.base_url, "sent": PENALTIES | server_sampling(cfg)}
    return info


def _same_answerer(out: Path, records: list[tuple[int, dict[str, Any]]],
                   info: dict[str, Any]) -> None:
    """A rerun adds answers of the same model and sampling: the prompts answered before are
    skipped, so another target's answers would pass for this one's."""
    for line, rec in records:
        for a in (rec.get("meta") or {}).get("answers") or []:
            diff = _differs(a, info) if isinstance(a, dict) else []
            if diff:
                raise DraftsmithError(
                    f"{out}:{line}: holds answers {'; '.join(diff)}: write to another file "
                    "(regenerate --out, or another `data make` folder), or "
                    "rerun with the settings there")


def _differs(a: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """How answer `a` was made otherwise than this run answers. An engine's target is known by
    its fingerprint (a path typed otherwise is the same target, other weights there are not)."""
    out = []
    both = a.get("target") and info.get("target")
    if (a["target"] != info["target"]) if both else (a.get("model") != info["model"]):
        out.append(f"by {a.get('model')!r} (target {a.get('target')}), this run answers by "
                   f"{info['model']!r} (target {info.get('target')})")
    if a.get("sampling") != info["sampling"]:
        there, now = sampling_diff(a.get("sampling"), info["sampling"])
        out.append(f"sampled with {there}, this run with {now}")
    # answers written before `sent` was recorded carry none: the draftsmith of 64217c7 on sent
    # what this one sends, an older one less, which their records cannot tell apart
    if "sent" in a and a["sent"] != info.get("sent"):
        out.append(f"of requests with the fields {a['sent']} beyond OpenAI's, this run sends "
                   f"{info.get('sent')}")
    # answers written before the batching or numerics were recorded carry none, and are
    # resumed as before
    for key, flag in ENGINE.items():
        if key in a and key in info and a[key] != info[key]:
            out.append(f"made with {flag(a[key])}, this run with {flag(info[key])}")
    return out


def _refills(backend: Any) -> bool:
    return isinstance(backend, EngineBackend) and backend.cfg.refill


def _counter(tok: Any, splices: bool = False) -> Counts:
    """A prompt's length in target tokens; `splices` (the engine): as the engine asks it, with
    the earlier answers' recorded ids (`prompt_ids`), which may be more tokens than their text's.
    A server takes text, and is measured by it."""
    from draftsmith.data.chat import render

    def count(msgs: Messages, recorded: Recorded | None = None) -> int:
        if splices and recorded:
            return len(prompt_ids(tok, msgs, recorded))
        text = render(tok, msgs, True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


def _recorded(talk: Talk, ask: Messages) -> Recorded:
    """The ids recorded for the talk's answers so far, by their message's place in `ask`."""
    return Conversation(ask, meta={"answers": talk.answers}).answer_ids()


def text_tokens(tok: Any, text: str) -> int:
    """An answer's length in target tokens, for a reply that does not give its `usage`."""
    return len(tok(text, add_special_tokens=False)["input_ids"])


@dataclass
class Talk:
    """A conversation being answered: its messages so far, its user turns and its answers."""

    conv: Conversation
    msgs: Messages
    users: list[str]
    answers: list[dict] = dataclasses.field(default_factory=list)
    failed: bool = False
    ended: bool = False  # its next turn no longer fits


def _open(conv: Conversation, tok: Any, cfg: RegenConfig, count: Counts,
          stats: dict[str, int]) -> Talk | None:
    """The conversation its first prompt fitted, or None where it is skipped (counted)."""
    try:
        fitted = fit_prompt(tok, conv, cfg.prompt_limit, cfg.too_long, count)
    except DraftsmithError as e:  # one conversation's roles, not the run: a rerun would
        _refused(conv, e, stats)  # stop at it again
        return None
    if fitted is None:
        stats["skipped_too_long"] += 1
        return None
    stats["truncated"] += fitted is not conv
    return Talk(conv, lead(fitted.messages), fitted.user_turns())


def _ask(talk: Talk, cfg: RegenConfig, count: Counts,
         stats: dict[str, int]) -> Messages | None:
    """The request for the talk's next turn; None once it is over (a turn past the limit
    ends it there, counted)."""
    turn = len(talk.answers)
    if talk.failed or talk.ended or turn >= len(talk.users):
        return None
    ask = talk.msgs + [{"role": "user", "content": talk.users[turn]}]
    if turn and count(ask, _recorded(talk, ask)) > cfg.prompt_limit:
        stats["turns_cut"] += 1
        talk.ended = True
        return None
    return ask


def _take(talk: Talk, ask: Messages, ans: Answer, tok: Any, info: dict[str, Any],
          stats: dict[str, int]) -> None:
    """The answer to `ask` kept in `talk`, or the talk failed (counted and warned). A later
    turn the server refuses as past its context (its count, not ours) ends the talk there, as
    `_ask` ends one past --max-len: a rerun would be refused alike, the turns before lost."""
    if ans.past_context and talk.answers:
        stats["turns_cut"] += 1
        talk.ended = True
        return
    if ans.finish.startswith("error"):
        talk.failed = True
        stats["failed"] += 1
        stats["refused_by_server"] += ans.lasting
        stats["timed_out"] += ans.timed_out
        tell(f"draftsmith: warning: prompt {talk.conv.id}: {ans.finish}")
        return
    turn = len(talk.answers)
    talk.msgs[:] = ask + [{"role": "assistant", "content": ans.text}]
    tokens = ans.tokens if ans.tokens is not None else text_tokens(tok, ans.text)
    talk.answers.append({"turn": turn, **info, "tokens": tokens, "finish": ans.finish}
                        | ({"ids": ans.ids} if ans.ids is not None else {})
                        | ({"refused": list(ans.refused)} if ans.refused else {}))
    stats["answer_tokens"] += tokens
    stats["answers_at_max_new"] += ans.finish == "length"
    stats["finish_unknown"] += ans.finish == UNKNOWN


def _record(talk: Talk, stats: dict[str, int]) -> dict | None:
    """The finished talk's record; None where it failed or has no answer."""
    if talk.failed or not talk.answers:
        return None
    stats["answered"] += 1
    return Conversation(talk.msgs, meta={"prompt_id": talk.conv.id,
                                         "answers": talk.answers}).to_json()


def _answer_chunk(chunk, backend, tok, cfg: RegenConfig, count, info,
                  stats) -> tuple[list[dict], int, int]:
    """The chunk's records, its requests' count where none reached the server (else 0), and
    how many of those timed out with the server connected (`slow`)."""
    live = [t for conv in chunk if (t := _open(conv, tok, cfg, count, stats)) is not None]
    asked = unreached = timed_out = 0
    for _ in range(max((len(t.users) for t in live), default=0)):
        active = [(t, a) for t in live if (a := _ask(t, cfg, count, stats)) is not None]
        got = _asked(backend, active) if active else []
        asked, unreached = asked + len(got), unreached + sum(a.unreached for a in got)
        timed_out += sum(a.timed_out for a in got)
        for (talk, ask), ans in zip(active, got, strict=True):
            _take(talk, ask, ans, tok, info, stats)
    recs = [r for t in live if (r := _record(t, stats)) is not None]
    return recs, (asked if unreached == asked else 0), timed_out


def _asked(backend: Any, active: list[tuple[Talk, Messages]]) -> list[Answer]:
    """The answers to `active`'s requests; the engine's after the ids it decoded before."""
    asks = [a for _, a in active]
    if isinstance(backend, EngineBackend) and any(recs := [_recorded(t, a) for t, a in active]):
        return backend.answer(asks, recs)  # a first turn has none: asked as before
    return backend.answer(asks)


def gone(backend: Any, asked: int, left: int, timed_out: int = 0) -> str:
    """Why a run stops at a chunk none of whose `asked` requests reached the server (connection
    errors and timeouts after every retry), `left` conversations unasked: asking each later
    chunk, with retries and backoff each time, took many minutes to fail alike. Where they all
    timed out with the server connected (`slow`), it is up but slower than the timeout."""
    if timed_out == asked:
        return (f"regenerate: the server at {backend.base_url} takes requests but answered none "
                f"in time: each of the {asked} requests of a chunk timed out after "
                f"{backend.timeout:g} s, --retries {backend.retries}; {left} conversations left "
                f"unasked: raise --timeout (now {backend.timeout:g} s), lower --concurrency (now "
                f"{backend.concurrency}) or --max-new-tokens, or give the server more capacity")
    why = (f"none of the {asked} requests of a chunk reached it, each a connection error or "
           f"timeout after --retries {backend.retries}; {left} conversations left unasked")
    if backend.reached:
        return f"regenerate: the server at {backend.base_url} stopped answering: {why}"
    return (f"regenerate: no server answered at {backend.base_url}: {why}; is it running, and "
            "is the URL right (with its /v1)?")


def _refused(conv: Conversation, e: DraftsmithError, stats: dict[str, int]) -> None:
    stats["template_refused"] += 1
    if stats["template_refused"] == 1:  # the count is in the closing line
        tell(f"draftsmith: warning: prompt {conv.id} skipped, and any other the chat template "
              f"refuses: {e}")


def load_tokenizer(source: str) -> Any:
    """The target's tokenizer without loading weights where possible (HF folders)."""
    path = Path(source)
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise DraftsmithError(f"{path}: cannot load the tokenizer ({e})") from None
    from draftsmith.targets import load_target

    return load_target(source).tokenizer


def regenerate_file(
    convs: list[Conversation],
    out: str | Path,
    cfg: RegenConfig,
    target: str = "default",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    base_url: str | None = None,
    model: str | None = None,
    concurrency: int = 16,
    retries: int = 5,
    api_key: str | None = None,
    log: Callable[[str], None] | None = None,
    compile: bool = False,
    timeout: float = TIMEOUT,
) -> dict[str, int]:
    """`regenerate` with the backend built from names: a server when base_url, else the engine."""
    if base_url:
        check_server_options(concurrency, retries, timeout)
        check_base_url(base_url)  # before the tokenizer loads
        if target == "default":  # the served model is another one, most likely
            (log or (lambda m: print(m, file=sys.stderr)))(
                "regenerate: warning: prompts are measured and cut to --max-len with the default "
                "target's tokenizer (SmolLM2); pass --target with the served model's folder or "
                "GGUF for its own")
        tok = load_tokenizer(target)
        backend: Any = OpenAIBackend(base_url, model or "", cfg, concurrency, retries,
                                     api_key=api_key, timeout=timeout, tokenizer=tok)
    else:
        from draftsmith.options import check_compile
        from draftsmith.targets import load_target

        check_compile(compile, device)
        t = load_target(target)
        cfg = within_positions(cfg, t.cfg.max_position_embeddings, log,  # before the weights
                               t.cfg.sliding_window)
        tok, backend = t.tokenizer, EngineBackend(t, t.build(dtype, device), cfg, compile)
    try:
        if isinstance(backend, OpenAIBackend) and not model:
            backend.model_name = server_model(backend.client, base_url)
        elif isinstance(backend, OpenAIBackend):
            check_listed(backend.client, base_url or "", backend.model_name,
                         log or (lambda m: print(m, file=sys.stderr)))
        return regenerate(convs, out, backend, tok, cfg, log=log)
    finally:
        if isinstance(backend, OpenAIBackend):
            backend.close()


def server_model(client: Any, base_url: str) -> str:
    names = list_models(client, base_url, needed=True) or []
    if len(names) != 1:
        raise DraftsmithError(f"{redacted_url(base_url)} serves {names}: pass --model NAME")
    return names[0]


def check_listed(client: Any, base_url: str, model: str, say: Callable[[str], None]) -> None:
    """--model said where the server lists other models: SGLang answers any name with the
    model it serves, echoing the name asked, so its answers would be recorded as --model's
    (a warning: a server may take aliases it does not list). A server that cannot be listed
    is left to its answers to tell (no server, a refused key)."""
    try:
        names = list_models(client, base_url, needed=False)
    except Exception:  # noqa: BLE001 - an HTML page or cut JSON: the answers tell the rest
        return
    if said := unlisted(base_url, names, model):
        say(f"regenerate: warning: {said}")


def unlisted(base_url: str, names: list[str] | None, model: str) -> str | None:
    """The line for a --model the server does not list (`data make` and `data regenerate`)."""
    if not names or model in names:
        return None
    return (f"{redacted_url(base_url)} lists {names}, not --model {model!r}: a server that "
            f"answers any name (SGLang) answers with its own model, recorded as {model!r}; pass "
            "--model as the server lists the target")


LIST_TIMEOUT = 30.0  # seconds for the model listing: a quick route, unlike an answer


def list_models(client: Any, base_url: str, needed: bool) -> list[str] | None:
    """The models the server lists, asked within `LIST_TIMEOUT` (or the client's own timeout
    where shorter; an answer's 600 s held a run before its first stage); None where it lists
    none (no /models route) and they are not `needed` (its answers tell). No server reached,
    none answering in time, or a key refused, is one line."""
    import openai

    base_url = redacted_url(base_url)
    limit = client.timeout if isinstance(client.timeout, (int, float)) else LIST_TIMEOUT
    limit = min(limit, LIST_TIMEOUT)
    try:
        return [m.id for m in client.with_options(timeout=limit).models.list()]
    except openai.APITimeoutError as e:
        raise DraftsmithError(f"{base_url}: no server answered ({e}) its model listing within "
                              f"{limit:g} s: is it running and ready (still loading?), and is "
                              "the URL right (with its /v1)?") from None
    except openai.APIConnectionError as e:  # no server: --model would not help
        raise DraftsmithError(f"{base_url}: no server answered ({e}): is it running, and is the "
                              "URL right (with its /v1)?") from None
    except openai.OpenAIError as e:
        status = getattr(e, "status_code", None)
        if status in (401, 403):
            raise DraftsmithError(f"{base_url}: HTTP {status}, cannot list models ({e}); "
                                  f"{FATAL_STATUS[status]}") from None
        if needed:
            raise DraftsmithError(f"{base_url}: cannot list models ({e}); pass --model") from None
        return None
