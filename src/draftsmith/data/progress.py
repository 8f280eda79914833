"""Progress of a data stage: tqdm's bar on a terminal; off one (a log file, a pipe), where a bar
is one endless line of carriage returns, a plain line now and then and one at the end."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EVERY_S = 30.0  # off a terminal: the most often a line is written
BEAT_S = 5.0  # a long step's time so far is told this often (off a terminal: EVERY_S at most)


def stderr_line(line: str) -> None:
    """A progress line on stderr, where stdout carries a command's tables or JSON."""
    print(line, file=sys.stderr, flush=True)


def on_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    def __init__(self, total: int, initial: int, unit: str, desc: str, shown: bool,
                 say: Callable[[str], None], every: float = EVERY_S) -> None:
        from tqdm import tqdm

        self.shown, self.lines = shown, shown and not on_terminal()
        self.bar: Any = tqdm(total=total, initial=initial, unit=unit, desc=desc,
                             disable=not shown or self.lines)
        self.total, self.done, self.first = total, initial, initial
        self.unit, self.desc, self.say, self.every = unit, desc, say, every
        self.start = self.said = time.perf_counter()
        self.unsaid = False
        self.told: float | None = None  # when a status line was last said

    def update(self, n: int) -> None:
        self.bar.update(n)
        self.done += n
        self.unsaid = True
        if self.lines and time.perf_counter() - self.said >= self.every:
            self._line()

    def status(self, text: str) -> None:
        """What the stage is doing before its next update (a long round): on a terminal beside
        the bar; off one a line, the first always, then at most every `every` seconds."""
        self.bar.set_postfix_str(text)
        now = time.perf_counter()
        if self.lines and (self.told is None or now - self.told >= self.every):
            self.say(f"{self.desc}: {text}")
            self.told = now

    def announce(self, text: str) -> None:
        """A step beginning: beside the bar on a terminal, a line of its own off one (where
        `status` would say one every `every` seconds at most)."""
        if self.lines:
            self.say(f"{self.desc}: {text}")
        else:
            self.status(text)

    @contextmanager
    def beating(self, text: str, beat: float | None = None) -> Iterator[None]:
        """`status(text)`, then `text, <time> in` every `beat` seconds until the block ends: a
        step without progress of its own (a round of self-made prompts: minutes on CPU) is
        seen to be alive."""
        self.status(text)
        if not self.shown:
            yield
            return
        stop, start = threading.Event(), time.perf_counter()

        def tell() -> None:
            while not stop.wait(beat or BEAT_S):
                self.status(f"{text}, {span(time.perf_counter() - start)} in")

        thread = threading.Thread(target=tell, name="progress-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        self.bar.close()
        if self.lines and self.unsaid:
            self._line()

    def _line(self) -> None:
        now = time.perf_counter()
        spent, made = now - self.start, self.done - self.first
        left = self.total - self.done
        eta = f", eta {span(spent / made * left)}" if made and left > 0 else ""
        self.say(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {span(spent)} spent{eta}")
        self.said, self.unsaid = now, False


def span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
