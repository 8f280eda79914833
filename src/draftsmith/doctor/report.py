"""Findings and the doctor's report: one record per problem (severity, what, where, fix)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    severity: str  # error | warning | info
    check: str  # short name of the check that produced it
    what: str
    where: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} not in {SEVERITIES}")


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # checks that ran and found nothing
    skipped: list[str] = field(default_factory=list)  # checks that could not run, and why
    context: dict[str, Any] = field(default_factory=dict)  # target, data, drafter, engine
    wiring: dict[str, Any] | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)
    behaviour: dict[str, Any] | None = None

    def add(self, check: str, found: list[Finding]) -> None:
        if found:
            self.findings += found
        else:
            self.passed.append(check)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in ("error", "warning")]

    @property
    def ok(self) -> bool:
        return not self.errors()

    def exit_code(self, strict: bool = False) -> int:
        bad = self.problems() if strict else self.errors()
        return 1 if bad else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "errors": len(self.errors()),
            "warnings": sum(f.severity == "warning" for f in self.findings),
            "findings": [asdict(f) for f in self.findings],
            "passed": self.passed,
            "skipped": self.skipped,
            "context": self.context,
            "wiring": self.wiring,
            "engines": self.engines,
            "behaviour": self.behaviour,
        }
