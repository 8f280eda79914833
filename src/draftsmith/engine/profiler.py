"""Phase profiler for the speculative cycle: draft, verify, accept/bookkeeping, extend.

Marks are CUDA events on CUDA (recorded between graph replays, never inside one) and
`time.perf_counter` readings on CPU; both are read only in `summary()`, after the run. When off,
`NullProfiler` does nothing at all. `DRAFTSMITH_PROFILE=1` turns it on where the caller passes
`enabled=None`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter as clock
from typing import Any

import torch

from draftsmith.switches import env_flag

PHASES = ("draft", "verify", "accept", "extend")
LABELS = {
    "draft": "draft steps",
    "verify": "target verify",
    "accept": "accept/bookkeeping",
    "extend": "draft re-extend",
    "refill": "refill (harvest, prefill)",
}


@dataclass
class PhaseSummary:
    cycles: int
    ms: dict[str, float]  # mean per cycle
    pct: dict[str, float]
    cycle_ms: float
    accept_length: float = 0.0
    accept_rate: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON writes it: null where no cycle was timed (as the table's "-"),
        never a 0 ms cycle or a 0.0 accept length that was not measured."""
        out = asdict(self)
        if not self.cycles:
            out.update(ms=dict.fromkeys(self.ms), pct=dict.fromkeys(self.pct), cycle_ms=None,
                       accept_length=None, accept_rate=None)
        return out


class NullProfiler:
    """Profiling off: every method is a no-op, nothing is created or recorded."""

    enabled = False

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def summary(self) -> PhaseSummary | None:
        return None


class PhaseProfiler:
    """`start()` opens a cycle; `mark(phase)` closes `phase`, which began at the previous mark."""

    enabled = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cycles: list[list[tuple[str, Any]]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def start(self) -> None:
        self.cycles.append([("", self._now())])

    def mark(self, phase: str) -> None:
        self.cycles[-1].append((phase, self._now()))

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self) -> PhaseSummary:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        total = dict.fromkeys(PHASES, 0.0)
        for marks in self.cycles:
            for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
                total[name] = total.get(name, 0.0) + self._ms(a, b)
        n = max(1, len(self.cycles))
        ms = {k: v / n for k, v in total.items()}
        cycle = sum(ms.values())
        pct = {k: 100.0 * v / cycle if cycle else 0.0 for k, v in ms.items()}
        return PhaseSummary(len(self.cycles), ms, pct, cycle)


class HostClock:
    """Where the host's time goes in a decode loop, without adding a sync: `lap(name)` adds the
    time since the previous lap to `name` ("launch": replaying a step's graphs; "wait": blocked
    on the late done flag, i.e. on the device). Wall time a step that is mostly "wait" means the
    device is the bottleneck; mostly "launch" means the host is."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.laps: dict[str, int] = {}
        self.last = clock()

    def start(self) -> None:
        self.last = clock()

    def lap(self, name: str) -> None:
        now = clock()
        self.totals[name] = self.totals.get(name, 0.0) + now - self.last
        self.laps[name] = self.laps.get(name, 0) + 1
        self.last = now

    def summary(self) -> dict[str, Any]:
        """{"iterations": n, "<name>_ms": mean ms a lap}."""
        n = max(self.laps.values(), default=0)
        return {"iterations": n, **{f"{k}_ms": 1e3 * v / max(self.laps[k], 1)
                                    for k, v in self.totals.items()}}


class NullClock:
    def start(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def summary(self) -> None:
        return None


def env_on(name: str) -> bool:
    """A switch read strictly (`switches.env_flag`), unset or empty meaning 0: "false" or "off"
    would otherwise turn on a profiler whose host sync a cycle slows every timed run."""
    return bool(os.environ.get(name, "").strip()) and env_flag(name, "0")


def make_clock() -> HostClock | NullClock:
    """A HostClock when DRAFTSMITH_HOST_TIMING=1, else a no-op."""
    return HostClock() if env_on("DRAFTSMITH_HOST_TIMING") else NullClock()


def make_profiler(device: torch.device | str, enabled: bool | None = None):
    """A PhaseProfiler when `enabled` (or, for None, when DRAFTSMITH_PROFILE=1), else a no-op."""
    if enabled is None:
        enabled = env_on("DRAFTSMITH_PROFILE")
    return PhaseProfiler(device) if enabled else NullProfiler()


NONE = ("-", "-")  # a row's ms and % where no cycle was timed


def table(s: PhaseSummary, title: str = "speculative cycle"):
    """The seed's table: ms and % of the cycle per phase, accept length and rate."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title))  # a suite's file name is text, not rich markup
    t.add_column("phase")
    t.add_column("ms / cycle", justify="right")
    t.add_column("% of cycle", justify="right")
    timed = s.cycles > 0  # no cycle: nothing was timed, no 0 ms or 100 % to show
    for k, v in s.ms.items():
        t.add_row(LABELS.get(k, k), *((f"{v:.3f}", f"{s.pct[k]:.1f}%") if timed else NONE))
    t.add_row("total cycle", *((f"{s.cycle_ms:.3f}", "100.0%") if timed else NONE), style="bold")
    # per row: at batch > 1 a cycle makes this many tokens in every row still running
    t.add_row("accept length (tokens a row-cycle)", f"{s.accept_length:.2f}" if timed else "-",
              "")
    t.add_row("accept rate (length / (steps + 1))", f"{s.accept_rate:.3f}" if timed else "-",
              "")
    t.add_row("cycles", str(s.cycles), "")
    return t


def write_json(s: PhaseSummary, path: str | Path) -> Path:
    """The summary at `path`, whole or not at all (an earlier file stays on a failed write);
    strict JSON: no NaN or Infinity literal."""
    from draftsmith.data.atomic import atomic_write, make_folder

    path = Path(path)
    make_folder(path.parent)
    text = json.dumps(s.to_dict(), indent=1, allow_nan=False) + "\n"
    atomic_write(path, text.encode())
    return path
