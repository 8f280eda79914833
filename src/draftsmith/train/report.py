"""Training log: one JSON line per logging window (`train_log.jsonl`) and a PNG of the curves."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

from draftsmith.data.atomic import append_whole, atomic_write
from draftsmith.errors import DraftsmithError
from draftsmith.measured import gaps

LOG = "train_log.jsonl"
PLOT = "train_curves.png"


def read_log(out: Path) -> list[dict[str, Any]]:
    """The rows; a last line cut short (a run killed while appending it) is left out, and so
    is a row that names no step (edited by hand), which no curve or resume can place."""
    return _parse(out)[0]


def _parse(out: Path) -> tuple[list[dict[str, Any]], int]:
    """(the rows with a step, how many other rows were left out)."""
    path = Path(out) / LOG
    if not path.is_file():
        return [], 0
    # numbered as an editor numbers them, blank lines included, so the line named is the one
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows, stepless = [], 0
    for i, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < lines[-1][0]:
                raise DraftsmithError(
                    f"{path}: line {i} is not a JSON row; delete or repair line {i} and rerun "
                    "(the other rows and the checkpoints are untouched)") from None
            continue
        if _step(row) is None:
            stepless += 1
        else:
            rows.append(row)
    return rows, stepless


def _step(row: Any) -> float | None:
    """A row's step, None where it is no JSON object with a numeric "step"."""
    step = row.get("step") if isinstance(row, dict) else None
    ok = isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
    return step if ok else None


def truncate_log(out: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (a resumed run rewrites what came after); through a
    tmp file, so a crash here loses no row. Rows without a step are dropped, said once."""
    rows, stepless = _parse(out)
    if stepless:
        warnings.warn(f"{Path(out) / LOG}: dropped {stepless} row(s) without a numeric "
                      "\"step\" (edited by hand?); the rows of steps are kept", stacklevel=2)
    rows = [r for r in rows if r["step"] <= step]
    atomic_write(Path(out) / LOG, "".join(json.dumps(r) + "\n" for r in rows).encode())


def append_log(out: Path, row: dict[str, Any]) -> None:
    """One row, whole or not at all (a full disk: the rows before stay, the run stops)."""
    append_whole(Path(out) / LOG, (json.dumps(row) + "\n").encode(),
                 "it keeps the rows before: make room and rerun the same command with --resume")


def plot(out: Path) -> Path | None:
    """Loss and per-TTT-position accuracy (and the draft vocab's coverage of the target's next
    tokens, which caps it) against the optimizer step."""
    rows = read_log(out)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(steps, gaps([_number(r.get("loss")) for r in rows]))
    a.set(xlabel="step", ylabel="weighted TTT loss", title="loss")
    k = max(len(_list(r.get("acc"))) for r in rows)
    for i in range(k):  # a position no chain reached in a window (None) is a gap, not a 0
        b.plot(steps, gaps([_at(r.get("acc"), i) for r in rows]), marker=".", ms=3,
               label=f"position {i}")
    b.plot(steps, gaps([_share(r, k) for r in rows]), "k--",
           label="accept length / (k+1), over the measured positions")
    coverage = [_number(r.get("coverage")) for r in rows]
    if any(c is not None for c in coverage):  # logs written before it lack it
        b.plot(steps, gaps(coverage), ":", color="grey",
               label="draft vocab coverage")
    b.set(xlabel="step", ylabel="accuracy (top-1 = target argmax)", ylim=(0, 1),
          title="TTT per-position accuracy")
    b.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(out) / PLOT
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)
    # whole or not at all: a full disk leaves the last whole plot
    atomic_write(path, png.getvalue(), "the checkpoints are kept: make room and rerun the same "
                 "command with --resume")
    return path


def _number(v: Any) -> float | None:
    """A figure to plot; None (a gap) where an edited row holds none."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _list(v: Any) -> list[Any]:
    """A row's per-position figures; none where an edited row holds no list there."""
    return v if isinstance(v, list) else []


def _at(values: Any, i: int) -> float | None:
    values = _list(values)
    return _number(values[i]) if i < len(values) else None


def _share(row: dict[str, Any], k: int) -> float | None:
    """A row's accept length as a share of the k + 1 tokens a cycle can take."""
    accept = _number(row.get("accept_length"))
    return None if accept is None else accept / (k + 1)
