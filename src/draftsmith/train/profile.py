"""Where a training step's time goes: per-phase timings plus a torch.profiler kernel table.

`StepProfiler` is active for `steps` optimizer steps after `warmup` steps of the run. Phase marks
are CUDA events on CUDA (read once, after the window) and clock readings on CPU. It writes
`profile.json` (ms per phase and step, wall ms per step, the share of the wall the device was
busy) and `profile.txt` (the top operators) into the training folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from time import perf_counter as clock
from typing import Any

import torch

PHASES = ("batch", "target", "targets", "forward", "backward", "optimizer", "stats")
WARMUP = 3  # steps of the run before the profiled ones (compiles, allocator, first reads)


class StepProfiler:
    def __init__(self, out: Path, device: torch.device, steps: int,
                 warmup: int = WARMUP) -> None:
        self.out, self.device, self.steps, self.warmup = out, device, steps, warmup
        self.seen = 0
        self.marks: list[list[tuple[str, Any]]] = []
        self.torch_prof: torch.profiler.profile | None = None
        self.t0 = 0.0
        self.done = steps <= 0

    @property
    def active(self) -> bool:
        return not self.done and self.seen >= self.warmup

    def _now(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return clock()

    def begin(self) -> None:
        if self.done:
            return
        if self.seen == self.warmup:
            self._sync()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_prof = torch.profiler.profile(activities=acts)
            self.torch_prof.__enter__()
            self.t0 = clock()
        if self.active:
            self.marks.append([("start", self._now())])

    def mark(self, phase: str) -> None:
        if self.active:
            self.marks[-1].append((phase, self._now()))

    def end(self) -> None:
        if self.done:
            return
        self.seen += 1
        if self.seen == self.warmup + self.steps:
            self._sync()
            wall = clock() - self.t0
            assert self.torch_prof is not None
            self.torch_prof.__exit__(None, None, None)
            self._write(wall)
            self.done = True

    def close(self) -> None:
        """Stop a window the run ended inside (too few steps, time limit, error): no report."""
        if self.torch_prof is not None and not self.done:
            self.torch_prof.__exit__(None, None, None)
        self.done = True

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3

    def phase_ms(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for marks in self.marks:
            for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
                total[name] = total.get(name, 0.0) + self._elapsed_ms(a, b)
        return {k: v / len(self.marks) for k, v in total.items()}

    def _write(self, wall_s: float) -> None:
        assert self.torch_prof is not None
        phases = self.phase_ms()
        step_ms = wall_s * 1e3 / self.steps
        report: dict[str, Any] = {
            "note": "timed while torch.profiler recorded: its overhead is included",
            "device": str(self.device), "steps": self.steps, "warmup": self.warmup,
            "wall_ms_per_step": step_ms, "phase_ms": phases,
            "phase_pct": {k: 100 * v / step_ms for k, v in phases.items()},
        }
        cuda = self.device.type == "cuda"
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        try:
            events = self.torch_prof.key_averages()
            table = events.table(sort_by=key, row_limit=30)
            if cuda:
                kernels = [e for e in self.torch_prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA
                           and not getattr(e, "is_user_annotation", False)]
                busy_us = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
                report["device_busy_pct"] = 100 * busy_us / 1e3 / (wall_s * 1e3)
                report["kernels_per_step"] = len(kernels) / self.steps
        except Exception as e:  # noqa: BLE001 - the phase timings are still worth writing
            table = f"torch.profiler summary failed: {e!r}"
            report["profiler_error"] = repr(e)
        try:  # the run goes on without them: a traceback here lost the steps since a checkpoint
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "profile.json").write_text(json.dumps(report, indent=1))
            (self.out / "profile.txt").write_text(table)
        except OSError as e:
            warnings.warn(f"{self.out}: profile.json and profile.txt not written "
                          f"({e.strerror or e}); training goes on", stacklevel=2)


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
