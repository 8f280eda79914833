"""The OpenAI wire format: request validation (with OpenAI's error shape) and response bodies.

Plain Python, no web framework: `parse_chat` / `parse_completion` turn a decoded JSON body into a
`GenRequest` of token ids or raise `ApiError(status, reason)`.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from draftsmith.engine.params import SamplingParams
from draftsmith.options import SEEDS  # one range for --seed and a request's seed
from draftsmith.serve.text import TooLong

MAX_STOP = 16
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
STOPPING = "the server is shutting down"  # a stopping server's 503s and /health


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    # a message may quote the request (a model name): an unpaired surrogate there must not
    # make the error itself fail to encode (a 500)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(slots=True)
class ServeConfig:
    model_name: str
    aliases: tuple[str, ...] = ()
    max_tokens: int = 1024
    max_prompt_tokens: int = 2048
    max_batch: int = 8
    max_queue: int = 256
    api_key: str | None = None
    fingerprint: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    continuous: bool = True  # rows that end take queued jobs (False: batches run to the end)
    max_body: int | None = None  # bytes a request body may hold (None: `app.MAX_BODY`)

    def __post_init__(self) -> None:
        from draftsmith.options import at_least_one  # typer: not in the frontends' start

        names = ("max_tokens", "max_prompt_tokens", "max_batch", "max_queue", "max_body")
        at_least_one({name: getattr(self, name) for name in names})

    def knows(self, model: str) -> bool:
        return model == self.model_name or model in self.aliases


class Prompter(Protocol):
    """Tokenizes a request's prompts; `most`: a text that cannot fit in that many tokens may be
    refused (`TooLong`) before it is tokenized."""

    vocab_size: int

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]: ...

    def text_ids(self, text: str, most: int | None = None) -> list[int]: ...


@dataclass(slots=True)
class GenRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompts: list[list[int]]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each answer's ids
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        self.id = self.id or prefix + uuid.uuid4().hex[:24]
        self.created = self.created or int(time.time())

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: its draws must not depend on other rows."""
        return self.seed is not None and not self.params.greedy


# ---- field checks --------------------------------------------------------------------------

_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "an object"}


def _get(body: dict, name: str, kind: type, default: Any = None, under: str = "") -> Any:
    """`body[name]` of `kind`, or `default` where absent or null; `under`: the object holding
    it (`stream_options`), so a refusal names the field by its path."""
    v = body.get(name)
    if v is None:
        return default
    path = f"{under}.{name}" if under else name
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:  # JSON integers have no bound; a float does
            raise ApiError(400, f"'{path}' is out of range: an integer of {len(str(abs(v)))} "
                           "digits", path, "invalid_value") from None
    if kind is int and isinstance(v, float) and v.is_integer():  # 2.0, as vLLM and OpenAI take
        return int(v)
    if not ok:
        raise ApiError(400, f"'{path}' must be {_NAMES[kind]}, got {type(v).__name__}: {v!r:.60}",
                       path, "invalid_type")
    return v


def _bounded(body: dict, name: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    v = _get(body, name, kind, default)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be in [{lo}, {hi}], got {v}", name, "invalid_value")
    return v


def _unsupported(body: dict, kind: str) -> None:
    """Reject features this server does not implement instead of silently ignoring them."""
    # vLLM's default: the chat template writes a chat's special tokens; a text gets the BOS
    special = kind != "chat"
    checks = {
        # /v1/completions' logprobs 0 asks for the chosen tokens' logprobs (only chat's is a bool)
        "logprobs": lambda v: v is not None and v is not False,
        "top_logprobs": lambda v: v not in (None, 0),
        "echo": lambda v: v not in (None, False),
        "best_of": lambda v: v not in (None, 1),
        "suffix": lambda v: v not in (None, ""),
        "logit_bias": lambda v: bool(v),
        "tools": lambda v: bool(v),
        "functions": lambda v: bool(v),
        "presence_penalty": lambda v: v not in (None, 0),
        "frequency_penalty": lambda v: v not in (None, 0),
        "response_format": lambda v: v not in (None, {"type": "text"}),
        "tool_choice": lambda v: v not in (None, "none", "auto"),
        "function_call": lambda v: v not in (None, "none", "auto"),  # tool_choice's old name
        "audio": lambda v: v is not None,
        "modalities": lambda v: v not in (None, ["text"]),
        # vLLM's own fields that change the answer (their defaults pass)
        "min_p": lambda v: v not in (None, 0),
        "repetition_penalty": lambda v: v not in (None, 1),
        "min_tokens": lambda v: v not in (None, 0),
        "ignore_eos": lambda v: v not in (None, False),
        "stop_token_ids": lambda v: bool(v),
        "include_stop_str_in_output": lambda v: v not in (None, False),
        "skip_special_tokens": lambda v: v not in (None, True),
        "prompt_logprobs": lambda v: v is not None,
        "use_beam_search": lambda v: v not in (None, False),
        "guided_json": lambda v: v is not None,
        "guided_regex": lambda v: v is not None,
        "guided_choice": lambda v: v is not None,
        "guided_grammar": lambda v: v is not None,
        "add_generation_prompt": lambda v: v not in (None, True),
        "continue_final_message": lambda v: v not in (None, False),
        "chat_template": lambda v: v is not None,
        "chat_template_kwargs": lambda v: bool(v),
        "truncate_prompt_tokens": lambda v: v is not None,
        "allowed_token_ids": lambda v: bool(v),
        "bad_words": lambda v: bool(v),
        "logits_processors": lambda v: bool(v),
        "structured_outputs": lambda v: v is not None,
        "documents": lambda v: bool(v),
        "add_special_tokens": lambda v: v not in (None, special),
        # SGLang's
        "regex": lambda v: v is not None,
        "ebnf": lambda v: v is not None,
        "json_schema": lambda v: v is not None,
        "no_stop_trim": lambda v: v not in (None, False),
        "lora_path": lambda v: v is not None,  # another model's answer
        "custom_logit_processor": lambda v: v is not None,
        # the samplers llama.cpp-style clients send (off: llama.cpp's -1, others' 0)
        "typical_p": lambda v: v not in (None, 1),
        "mirostat": lambda v: v not in (None, 0),
        "xtc_probability": lambda v: v not in (None, 0),
        "dry_multiplier": lambda v: v not in (None, 0),
        "dynatemp_range": lambda v: v not in (None, 0),
        "repeat_penalty": lambda v: v not in (None, 1),  # repetition_penalty's name there
    }
    for name, bad in checks.items():
        if name in body and bad(body[name]):
            raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported")


def _model(body: dict, cfg: ServeConfig) -> str:
    model = _get(body, "model", str, cfg.model_name)
    if not cfg.knows(model):
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{cfg.model_name}'", "model", "model_not_found")
    return cfg.model_name


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    stops = [v] if isinstance(v, str) else v
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or an array of them", "stop",
                       "invalid_type")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop' holds at most {MAX_STOP} strings", "stop", "invalid_value")
    return [_unicode(s, "stop") for s in stops]


def _sampling(body: dict) -> tuple[SamplingParams, int | None]:
    temperature = _bounded(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = _get(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
    top_k = _bounded(body, "top_k", int, 0, -1, 1 << 30)
    seed = _bounded(body, "seed", int, None, *SEEDS) if body.get("seed") is not None else None
    return SamplingParams(temperature, top_p, max(top_k, 0), _top_n_sigma(body)), seed


def _top_n_sigma(body: dict) -> float:
    """SGLang's and llama.cpp's top-nσ: n > 0, or off as 0 or llama.cpp's -1 (`SamplingParams`)."""
    n = _get(body, "top_n_sigma", float, 0.0)
    if not math.isfinite(n) or (n < 0 and n != -1):
        raise ApiError(400, f"'top_n_sigma' must be a finite number >= 0, or -1 (off), got {n}",
                       "top_n_sigma", "invalid_value")
    return max(n, 0.0)


def _max_tokens(body: dict, cfg: ServeConfig, kind: str) -> int:
    """`max_completion_tokens` (OpenAI's newer name, taken on both routes: a bound a client
    sends is never dropped), else `max_tokens` (type-checked either way, as vLLM's)."""
    default = cfg.max_tokens if kind == "chat" else min(COMPLETION_DEFAULT_TOKENS, cfg.max_tokens)
    older = _get(body, "max_tokens", int, default)
    key = "max_completion_tokens"
    max_tokens = _get(body, key, int, None)
    if max_tokens is None:
        key, max_tokens = "max_tokens", older
    if not 1 <= max_tokens <= cfg.max_tokens:
        raise ApiError(400, f"'{key}' must be in [1, {cfg.max_tokens}] (the server's "
                       f"--max-tokens-limit), got {max_tokens}", key, "invalid_value")
    return max_tokens


def _n(body: dict, cfg: ServeConfig) -> int:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= cfg.max_batch:
        # a job's choices decode as rows of one batch: a larger n needs a larger server
        raise_to = f": serving n={n} needs --max-batch {n} or more" if n > cfg.max_batch else ""
        raise ApiError(400, f"'n' must be in [1, {cfg.max_batch}] (the server's --max-batch), "
                       f"got {n}{raise_to}", "n", "invalid_value")
    return n


def _options(body: dict, cfg: ServeConfig, kind: str, count: int) -> dict[str, Any]:
    """Every field but the prompts (`count` of them), checked before any is tokenized."""
    max_tokens = _max_tokens(body, cfg, kind)
    params, seed = _sampling(body)
    n = _n(body, cfg)
    if count * n > cfg.max_batch:
        raise _too_many(count, n, cfg.max_batch)
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, {})
    if opts and not stream:  # as OpenAI and vLLM: not silently dropped
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                       "stream_options", "invalid_value")
    if _get(opts, "continuous_usage_stats", bool, False, "stream_options"):  # usage every chunk
        raise ApiError(400, "'stream_options.continuous_usage_stats' is not supported by this "
                       "server", "stream_options", "unsupported")
    token_ids = _get(body, "return_token_ids", bool, False)
    return {"model": _model(body, cfg), "max_tokens": max_tokens, "params": params, "n": n,
            "seed": seed, "stop": _stop(body), "stream": stream,
            "include_usage": stream and _get(opts, "include_usage", bool, False,
                                             "stream_options"),
            "token_ids": token_ids}


def _too_many(count: int, n: int, most: int) -> ApiError:
    """More choices than one batch holds: named by `prompt` where n is 1 (the client set no n)."""
    return ApiError(400, f"{count} prompts x n={n} exceeds the server's --max-batch {most}: "
                    f"send at most {most // n} prompts with n={n} a request",
                    "n" if n > 1 else "prompt", "invalid_value")


def _too_long(tokens: int | str, cfg: ServeConfig, param: str, where: str) -> ApiError:
    return ApiError(400, f"the prompt{where} is {tokens} tokens, over the server's "
                    f"--max-prompt-tokens {cfg.max_prompt_tokens}", param,
                    "context_length_exceeded")


def _where(i: int, count: int) -> str:
    return f" (prompt {i})" if count > 1 else ""


def _tokenize(prompter: Prompter, text: str | list[dict[str, str]], cfg: ServeConfig,
              where: str) -> list[int]:
    """A prompt's ids; a text too long to fit is refused before it is tokenized (it would
    hold the shared tokenizer, and the GIL, for seconds)."""
    chat = not isinstance(text, str)
    call = prompter.chat_ids if chat else prompter.text_ids
    try:
        return call(text, most=cfg.max_prompt_tokens)  # type: ignore[arg-type]
    except TooLong as e:
        raise _too_long(f"at least {e.tokens}", cfg, "messages" if chat else "prompt",
                        where) from None


def _check_lengths(prompts: list[list[int]], cfg: ServeConfig, param: str) -> None:
    for i, p in enumerate(prompts):
        if not p:
            raise ApiError(400, "the prompt is empty after tokenization", param, "invalid_value")
        if len(p) > cfg.max_prompt_tokens:
            raise _too_long(len(p), cfg, param, _where(i, len(prompts)))


def _unicode(text: str, param: str) -> str:
    """JSON may escape half of a UTF-16 pair ("\\ud83d"): no tokenizer takes that."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} holds an unpaired surrogate {text[e.start]!r} at "
                       f"character {e.start}: not valid Unicode", param, "invalid_value") from None
    return text


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- chat ----------------------------------------------------------------------------------

def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return _unicode(c, f"messages[{i}].content")
    if c is None:
        raise ApiError(400, f"messages[{i}].content is required", f"messages[{i}].content")
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content", "unsupported")
            texts.append(_unicode(part["text"], f"messages[{i}].content"))
        return "\n".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                   f"messages[{i}].content", "invalid_type")


ROLES = ("system", "developer", "user", "assistant")


def _messages(body: dict) -> list[dict[str, str]]:
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages", "missing_required_parameter")
    raw = body["messages"]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty array", "messages", "invalid_type")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'",
                           f"messages[{i}]", "invalid_type")
        if m.get("tool_calls") or m["role"] in ("tool", "function"):
            raise ApiError(400, "tool calls are not supported", f"messages[{i}]", "unsupported")
        if m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not one of "
                           f"{', '.join(ROLES)}", f"messages[{i}].role", "invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    return out


def parse_chat(body: Any, cfg: ServeConfig, prompter: Prompter) -> GenRequest:
    body = _object(body)
    _unsupported(body, "chat")
    messages = _messages(body)
    opts = _options(body, cfg, "chat", 1)
    try:
        ids = _tokenize(prompter, messages, cfg, "")
    except ApiError:
        raise
    except Exception as e:  # the template's own complaint (roles must alternate, ...)
        raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
    _check_lengths([ids], cfg, "messages")
    return GenRequest("chat", prompts=[ids], **opts)


# ---- completions ---------------------------------------------------------------------------

def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


_PROMPT_TYPES = ("'prompt' must be a string, an array of strings, an array of token ids, or an "
                 "array of such arrays")


def _items(body: dict, cfg: ServeConfig) -> list[str | list[int]]:
    """The prompts as given, each a string or an array of token ids: an array's length is
    checked before its ids are (a 16 MiB body holds millions)."""
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if p == []:
        raise _empty("")
    items = [p] if isinstance(p, str) or (isinstance(p, list) and _is_id(p[0])) else p
    if not isinstance(items, list):
        raise ApiError(400, _PROMPT_TYPES, "prompt", "invalid_type")
    for i, x in enumerate(items):
        if x == []:
            raise _empty(_where(i, len(items)))
        if isinstance(x, list):
            if len(x) > cfg.max_prompt_tokens:
                raise _too_long(len(x), cfg, "prompt", _where(i, len(items)))
            if not all(_is_id(t) for t in x):
                raise ApiError(400, _PROMPT_TYPES, "prompt", "invalid_type")
        elif not isinstance(x, str):
            raise ApiError(400, _PROMPT_TYPES, "prompt", "invalid_type")
    return items


def _empty(where: str) -> ApiError:
    """An array of no token ids (or no prompts): empty, not a prompt of the wrong type."""
    return ApiError(400, f"the prompt{where} is empty: send at least one token or character",
                    "prompt", "invalid_value")


def _prompts(items: list[str | list[int]], cfg: ServeConfig,
             prompter: Prompter) -> list[list[int]]:
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            x = _tokenize(prompter, _unicode(x, "prompt"), cfg, _where(i, len(items)))
        else:
            bad = [t for t in x if not 0 <= t < prompter.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary "
                               f"[0, {prompter.vocab_size})", "prompt", "invalid_value")
        out.append(x)
    return out


def parse_completion(body: Any, cfg: ServeConfig, prompter: Prompter) -> GenRequest:
    body = _object(body)
    _unsupported(body, "completion")
    items = _items(body, cfg)
    opts = _options(body, cfg, "completion", len(items))
    prompts = _prompts(items, cfg, prompter)
    _check_lengths(prompts, cfg, "prompt")
    return GenRequest("completion", prompts=prompts, **opts)


# ---- responses -----------------------------------------------------------------------------

@dataclass(slots=True)
class Choice:
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    ids: list[int] = field(default_factory=list)  # as vLLM's: with the eos that ended them


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(req: GenRequest, obj: str, fingerprint: str) -> dict[str, Any]:
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": fingerprint or None}


def response(req: GenRequest, choices: list[Choice], fingerprint: str = "") -> dict[str, Any]:
    chat = req.kind == "chat"
    out = _head(req, "chat.completion" if chat else "text_completion", fingerprint)
    out["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
         "finish_reason": c.finish_reason} if chat else
        {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        for i, c in enumerate(choices)
    ]
    if req.token_ids:  # where vLLM puts them: a chat's prompt at the root, a text's per choice
        for i, (c, choice) in enumerate(zip(choices, out["choices"], strict=True)):
            choice["token_ids"] = c.ids
            if not chat:
                choice["prompt_token_ids"] = req.prompts[i // req.n]
        if chat:
            out["prompt_token_ids"] = req.prompts[0]
    out["usage"] = usage(sum(len(p) for p in req.prompts), sum(c.tokens for c in choices))
    return out


def chunk(req: GenRequest, index: int, text: str | None, finish: str | None = None,
          role: bool = False, fingerprint: str = "", ids: list[int] | None = None,
          first: bool = False) -> dict[str, Any]:
    """One streamed chunk: a text delta (or the role, or the finish reason) of one choice. With
    return_token_ids, as vLLM's: `ids` (the delta's, or at the finish those the deltas did not
    carry: an eos, a held-back text's) as the choice's token_ids (a chat's role chunk has none),
    and a choice's `first` chunk carries its prompt's ids (a chat's at the root)."""
    chat = req.kind == "chat"
    out = _head(req, "chat.completion.chunk" if chat else "text_completion", fingerprint)
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    if req.token_ids:
        if not role:
            choice["token_ids"] = ids or []
        if first and chat:
            out["prompt_token_ids"] = req.prompts[0]
        elif first:
            choice["prompt_token_ids"] = req.prompts[index // req.n]
    out["choices"] = [choice]
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: GenRequest, completion_tokens: int, fingerprint: str = "") -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = _head(req, obj, fingerprint)
    out["choices"] = []
    out["usage"] = usage(sum(len(p) for p in req.prompts), completion_tokens)
    return out
