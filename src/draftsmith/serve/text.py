"""Text of one growing completion: incremental detokenization and stop strings.

Streaming decodes only a window of recent tokens (vLLM's prefix/read offsets), so a partial
UTF-8 sequence or a tokenizer's clean-up never changes text already sent; text that could still
become the start of a stop string is held back. Non-streaming text is `decode(all tokens)`, the
same string `draftsmith generate` prints.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from draftsmith.data.chat import template_ids


class ChoiceText:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], stream: bool) -> None:
        self.decode, self.stop, self.stream = decode, stop, stream
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_end = 0  # where the stop string that ended the text ended, once stopped
        self._tokens: list[int] = []
        self._p = self._r = 0

    def feed(self, tokens: list[int], final: bool = False) -> str:
        """The row's tokens so far (eos excluded); returns the text now safe to send."""
        if self.stopped:
            return ""
        self._tokens = tokens
        if self.stream:
            self._advance(final)
        elif final or self.stop:  # no stop string to watch: decoded once, at the end
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
            self.text += new[len(prefix) :]
            self._p, self._r = self._r, len(toks)

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


@dataclass
class TextSide:
    """What parsing a request needs of the engine: the tokenizer (and its chat template), the
    vocabulary and the longest prompt plus answer. The engine parses through one; `serve
    --frontends` pickles it to each HTTP process (no torch in it)."""

    tokenizer: Any
    vocab_size: int
    max_len: int
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "max_len": self.max_len}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        with self.lock:  # a tokenizer is not safe to share between threads
            return template_ids(self.tokenizer, messages)

    def text_ids(self, text: str) -> list[int]:
        with self.lock:
            return self.tokenizer(text)["input_ids"]
