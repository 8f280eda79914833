"""Text of one growing completion: incremental detokenization and stop strings.

Streaming decodes only a window of recent tokens (vLLM's prefix/read offsets), so a partial
UTF-8 sequence or a tokenizer's clean-up never changes text already sent; text that could still
become the start of a stop string is held back. A non-streamed text with stop strings grows the
same way (the rows carrying one are looked at every step, so each look decodes a window, not the
whole text); without stop strings it is `decode(all tokens)`, once, the same string `draftsmith
generate` prints.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from draftsmith.data.chat import template_ids


class ChoiceText:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], stream: bool) -> None:
        self.decode, self.stop, self.stream = decode, stop, stream
        self.incremental = stream or bool(stop)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_end = 0  # where the stop string that ended the text ended, once stopped
        self._tokens: list[int] = []
        self._p = self._r = 0
        # characters of the tokens past `_r` already in `text`: those before a character the
        # last tokens end inside of (0: the text holds whole tokens only)
        self.partial = 0

    def feed(self, tokens: list[int], final: bool = False) -> str:
        """The row's tokens so far (eos excluded); returns the text now safe to send."""
        if self.stopped:
            return ""
        self._tokens = tokens
        if self.incremental:
            self._advance(final)
        elif final:  # no stop string to watch: decoded once, at the end
            self.text = self.decode(tokens)
        hit = self._find_stop()
        if hit is not None:
            (cut, self.stop_end), self.stopped, final = hit, True, True
            self.text = self.text[:cut]
        # not past a partial UTF-8 character (decoded whole, it may complete a stop string)
        safe = len(self.text.rstrip("\ufffd"))
        end = len(self.text) if final else max(self.sent, min(safe, len(self.text) - self.hold))
        out, self.sent = self.text[self.sent : end], end
        return out

    def tokens_used(self, tokens: list[int]) -> int:
        """How many of `tokens` the text took: all of them, or once a stop string ended it,
        the fewest whose text reaches that string's end (the usage counts these; a character's
        first bytes alone decode to a placeholder that does not reach it)."""
        if not self.stopped:
            return len(tokens)
        lo, hi = 1, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(tokens[:mid]).rstrip("\ufffd")) >= self.stop_end:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _advance(self, final: bool) -> None:
        toks = self._tokens
        if len(toks) <= self._r:
            return
        prefix = self.decode(toks[self._p : self._r])
        new = self.decode(toks[self._p :])
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            self.text += new[len(prefix) + self.partial :]
            self._p, self._r, self.partial = self._r, len(toks), 0
            return
        # the new tokens end inside a character (a speculative run may): the whole characters
        # before it go now, not a cycle later; the offsets stay until it is whole
        whole = len(new.rstrip("\ufffd")) - len(prefix)
        if whole > self.partial:
            self.text += new[len(prefix) + self.partial : len(prefix) + whole]
            self.partial = whole

    def _find_stop(self) -> tuple[int, int] | None:
        """(start, end) of the stop string completed first (the smallest end; of two ending
        together, the longer): the one a token-by-token stream meets first, whatever the text
        grew by between looks."""
        start = max(0, self.sent - self.hold)
        hits = [(i + len(s), i) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        end, at = min(hits)
        return at, end


class TooLong(Exception):
    """A text that cannot fit: it makes at least `tokens` tokens (told before tokenizing it)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"at least {tokens} tokens")
        self.tokens = tokens


@dataclass
class TextSide:
    """What parsing a request needs of the engine: the tokenizer (and its chat template), the
    vocabulary and the longest prompt plus answer. The engine parses through one; `serve
    --frontends` pickles it to each HTTP process (no torch in it). `span`: the most characters
    one token stands for (`chars_per_token`), so a text too long to fit is refused untokenized."""

    tokenizer: Any
    vocab_size: int
    max_len: int
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    span: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.span = chars_per_token(self.tokenizer)

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "max_len": self.max_len, "span": self.span}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    def at_least(self, text: str) -> int:
        """A lower bound on the tokens `text` makes (0 where none is known)."""
        return -(-len(text) // self.span) if self.span else 0

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]:
        """`most`: raise `TooLong` for a rendered conversation that cannot fit in that many
        tokens, before tokenizing it."""
        with self.lock:  # a tokenizer is not safe to share between threads
            return template_ids(_Capped(self, most), messages)

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        with self.lock:
            return _Capped(self, most)(text)["input_ids"]


class _Capped:
    """The text side's tokenizer, refusing (`TooLong`) a text over `most` tokens before it
    tokenizes it (the chat template renders through it unchanged)."""

    def __init__(self, side: TextSide, most: int | None) -> None:
        self._side, self._most = side, most

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side.tokenizer, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        if self._most is not None and (least := self._side.at_least(text)) > self._most:
            raise TooLong(least)
        return self._side.tokenizer(text, **kw)


# ---- how many characters one token stands for at most ------------------------------------------

NFC_FOLD = 4  # NFC/NFKC join at most 4 code points into one (a canonical decomposition's most)


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of a text one token of `tokenizer` can stand for, so a text of more
    than `tokens x this` characters makes more than `tokens` tokens; from a fast tokenizer's
    pipeline (normalizer, pre-tokenizer, model, added tokens). None where a step may drop or fold
    text without bound (a whitespace split, a regex replace, fused unknowns, an added token that
    takes the spaces around it, a model of whole words) or the tokenizer is not a fast one."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except Exception:  # noqa: BLE001 (a slow or foreign tokenizer: no bound)
        return None
    fold, pieces = _fold(spec.get("normalizer")), _pieces(spec.get("pre_tokenizer"))
    cover = _cover(spec.get("model") or {}, pieces)
    added = spec.get("added_tokens") or []
    if fold is None or cover is None or any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    return fold * max([cover, *(len(a.get("content", "")) for a in added)])


def _fold(norm: dict | None) -> int | None:
    """How many characters a normalizer may turn into one (None: any number, or to none)."""
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        folds = [_fold(n) for n in norm.get("normalizers", [])]
        return None if None in folds else _product(folds)
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):
        return 1
    if kind in ("NFC", "NFKC"):
        return NFC_FOLD
    if kind == "Replace":
        pattern, content = norm.get("pattern") or {}, norm.get("content") or ""
        if "String" in pattern and content:
            return max(1, -(-len(pattern["String"]) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex replaces, unknown


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


_KEEPS = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _pieces(pre: dict | None) -> str | None:
    """"chars": each character a piece of its own; "kept": every character in some piece; None:
    a pre-tokenizer that may drop characters (whitespace splits, removed delimiters)."""
    if pre is None:
        return "kept"
    kind = pre.get("type")
    if kind == "Sequence":
        got = [_pieces(p) for p in pre.get("pretokenizers", [])]
        return None if None in got else "chars" if "chars" in got else "kept"
    if kind == "Split" and pre.get("behavior") != "Removed" and not pre.get("invert"):
        single = pre.get("pattern") == {"String": ""} and pre.get("behavior") == "Isolated"
        return "chars" if single else "kept"
    if kind == "Punctuation" and pre.get("behavior") != "Removed":
        return "kept"
    return "kept" if kind in _KEEPS else None


def _cover(model: dict, pieces: str | None) -> int | None:
    """The most characters of a piece one of the model's tokens covers."""
    if pieces is None:
        return None
    if pieces == "chars" and model.get("type") in ("BPE", "WordLevel", "WordPiece", "Unigram"):
        return 1  # each non-empty piece makes a token at least
    if model.get("type") != "BPE":
        return None  # a whole word to one token (WordLevel, WordPiece's unknown), fused unknowns
    vocab = model.get("vocab") or {}
    fallback = model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if model.get("unk_token") is not None and model.get("fuse_unk") and not fallback:
        return None
    return max(map(len, vocab), default=1)
