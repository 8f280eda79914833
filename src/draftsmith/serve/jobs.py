"""A request as the scheduler runs it (no torch here: a frontend process holds these too)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from draftsmith.serve.protocol import GenRequest

if TYPE_CHECKING:
    from draftsmith.serve.scheduler import Row

_ENDS = threading.Lock()  # `Job.end`'s: the worker and the event loop may both count a job


class Job:
    def __init__(self, req: GenRequest, sink: Callable[[tuple], None]) -> None:
        self.req, self._sink = req, sink
        self.cancelled = False
        self.solo = False
        self.sent = False  # a delta or a finish went out: a rerun would repeat it
        self.done = False  # every row finished and "done" sent
        self._ended = False  # how it ended is counted in the metrics
        self.rows: list[Row] = []
        self.queued_at = time.perf_counter()
        self.batch_key: Any = req.params  # the engine's, set on submit

    @property
    def key(self) -> tuple:
        """Jobs with equal keys may share a batch; a seeded one (its draws must not depend on
        other rows) or one rerun alone shares with none."""
        if self.solo or self.req.seeded:
            return ("alone", id(self))
        return ("batch", self.batch_key)

    def end(self) -> bool:
        """True the first time only: its caller counts how the job ended (the worker, or the app
        answering it 503 itself), so no job is counted twice."""
        with _ENDS:
            first, self._ended = not self._ended, True
        return first

    def emit(self, event: tuple) -> None:
        self.sent |= event[0] in ("delta", "finish")
        try:
            self._sink(event)
        except RuntimeError:  # the client's event loop is gone
            self.cancelled = True
