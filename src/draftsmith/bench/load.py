"""The machine's load while timings are taken (bench, demo): other work on the cores slows the
timed runs unevenly (a 2-core demo read 0.35x busy, 0.71x quiet), so a report says so.

Other work is the machine's busy CPU time over the timed spans (Linux's /proc/stat for this
process's CPUs, steal included) less this process's own; without /proc/stat, the 1-minute load
average less this process's cores in use. Nothing here fails: a figure the platform lacks is
None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

BUSY_SHARE = 0.25  # other work on more than this share of the cores: timings flagged
STAT = "/proc/stat"


@dataclass(frozen=True)
class Mark:
    wall: float
    cpu: float  # this process's CPU seconds, all threads
    load: float | None
    busy_s: float | None  # the machine's busy CPU seconds since boot


def cpus() -> set[int] | None:
    """The CPUs this process may run on, where the platform says."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def cores() -> int:
    return len(cpus() or ()) or os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_seconds() -> float | None:
    """The non-idle time since boot (user, nice, system, irq, softirq, steal) of the CPUs this
    process may run on: a container's own CPUs, not the whole host's."""
    mine = cpus()
    try:
        with open(STAT) as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu")]
        each = [f for f in lines if f[0] != "cpu" and (mine is None or int(f[0][3:]) in mine)]
        total = 0
        for fields in each or lines[:1]:
            ticks = [int(x) for x in fields[1:9]]
            total += sum(ticks) - ticks[3] - ticks[4]
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def mark() -> Mark:
    return Mark(time.perf_counter(), time.process_time(), load_average(), busy_seconds())


@dataclass
class Tally:
    """Timed spans summed: other work is judged over the timed runs alone, so an untimed
    warm-up's compile workers (inductor's subprocesses) are not taken for other work."""

    wall: float = 0.0
    cpu: float = 0.0
    busy_s: float | None = 0.0
    load_before: float | None = None
    load_after: float | None = None
    spans: int = 0

    def add(self, start: Mark, end: Mark) -> Tally:
        if not self.spans:
            self.load_before = start.load
        self.load_after, self.spans = end.load, self.spans + 1
        self.wall += end.wall - start.wall
        self.cpu += end.cpu - start.cpu
        if self.busy_s is not None and start.busy_s is not None and end.busy_s is not None:
            self.busy_s += end.busy_s - start.busy_s
        else:
            self.busy_s = None
        return self

    def result(self) -> dict[str, Any] | None:
        """The load over the spans (None: none timed): `busy` where other work took more than
        `BUSY_SHARE` of the cores."""
        if not self.spans:
            return None
        n, wall = cores(), max(self.wall, 1e-9)
        own = self.cpu / wall * local_ranks()  # the run's peer ranks here work as this one
        if self.busy_s is not None:
            others: float | None = self.busy_s / wall - own
        else:  # the load average counts this process's running threads too
            others = None if self.load_after is None else self.load_after - own
        others = None if others is None else round(max(others, 0.0), 2)
        return {"cores": n, "load_before": _round(self.load_before),
                "load_after": _round(self.load_after), "own_cores": round(own, 2),
                "other_cores": others, "busy": others is not None and others > BUSY_SHARE * n}


def local_ranks() -> int:
    """The processes of this run on this machine (torchrun's and draftsmith's own spawned
    tensor-parallel ranks set LOCAL_WORLD_SIZE): each rank times the same steps, so its peers'
    CPU time is the run's own work, not other work."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


_watching: list[Tally] = []


@contextmanager
def watching() -> Iterator[Tally]:
    """Sum the `timed` spans run inside into one `Tally`."""
    tally = Tally()
    _watching.append(tally)
    try:
        yield tally
    finally:
        _watching.remove(tally)


@contextmanager
def timed() -> Iterator[None]:
    """A timed span, added to every `watching` tally."""
    start = mark()
    try:
        yield
    finally:
        end = mark()
        for tally in _watching:
            tally.add(start, end)


def busy_note(load: dict[str, Any] | None) -> str | None:
    """The report's line where the timings were taken on a busy machine; None otherwise."""
    if not load or not load.get("busy"):
        return None
    seen = [x for x in (load.get("load_before"), load.get("load_after")) if x is not None]
    n, others = load["cores"], load["other_cores"]
    level = (f"load {max(seen):.1f} on {n} cores, other work on {others:.1f} of them" if seen
             else f"other work on {others:.1f} of {n} cores")
    return f"timings taken while the machine was busy ({level}): rerun on a quiet machine"


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)
