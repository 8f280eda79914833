"""`tune.partial.json`: what a tune run has measured so far, kept when it stops partway and
taken up again by a rerun of the same tune (same target, drafter, prompts, settings, device)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import Acceptance, CostTable, Measurement, PromptMix, SpecSetting

PARTIAL = "tune.partial.json"

# what says where and how the kept figures were measured, named in words when they differ
WHAT = {"target_fingerprint": "the target (its config, weights or tokenizer)",
        "drafter_digest": "the drafter's files", "prompt_digest": "the prompts (as token ids)"}
PATHS = ("drafter", "target", "prompts")  # said, not compared: a moved folder is the same run
# said, not compared: what was measured at the batch sizes both runs tune for is taken up
# (`kept_costs`, `kept_measured`), the rest measured
RESHAPED = ("batches",)
# CostTable's tables keyed by batch size (refill and spec_refill: by refilled rows)
BATCH_KEYED = ("verify", "draft_step", "extend", "overhead", "decode", "draft_first")


def files_digest(folder: Path, names: tuple[str, ...]) -> str:
    """sha256 over the named files of a folder (each file's sha256, in order; a missing one
    counts as missing)."""
    from draftsmith.data.shards import sha256_file

    h = hashlib.sha256()
    for name in names:
        path = folder / name
        h.update(name.encode() + b"\0")
        if path.is_file():
            h.update(sha256_file(path).encode())
    return h.hexdigest()


def ids_digest(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def differences(theirs: dict, mine: dict, skip: tuple[str, ...] = (),
                words: dict[str, str] | None = None) -> list[str]:
    """What differs between a stopped run's settings and this run's, a key at a time (`words`:
    a key said otherwise; `skip`: keys not compared)."""
    return [(words or {}).get(k) or f"{k} {theirs.get(k)!r} there, {mine.get(k)!r} here"
            for k in dict.fromkeys([*mine, *theirs])
            if k not in skip and theirs.get(k) != mine.get(k)]


class Partial:
    """What a tune run has measured so far, written into out/tune.partial.json as it goes
    (acceptance, costs, each swept setting): a run that fails or is stopped partway leaves
    it, its error names it, and a rerun of the same tune resumes from it (`resume`). None for
    `out`: a TP rank other than 0, which writes nothing."""

    def __init__(self, out: Path | None, run: dict) -> None:
        self.path = None if out is None else out / PARTIAL
        self.data = {"status": "partial: the run stopped before its report (tune.json)",
                     "run": json.loads(json.dumps(run, default=str))}
        self.written = False

    def resume(self) -> dict:
        """What an earlier, stopped run of this very tune kept ({} without one), taken into
        this run's file. One of another tune is refused, naming what differs: its figures are
        not this run's, and it is not overwritten."""
        if self.path is None or not self.path.is_file():
            return {}
        try:
            old = json.loads(self.path.read_text())
            theirs = old["run"]
            if not isinstance(theirs, dict):
                raise TypeError(f"its run is {type(theirs).__name__}, not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DraftsmithError(f"{self.path}: not a stopped tune's measurements ({e}); "
                                  "delete it or give another --out") from e
        if differ := differences(theirs, self.data["run"], PATHS + RESHAPED, WHAT):
            raise DraftsmithError(
                f"{self.path} holds what another tune measured before it stopped ("
                + "; ".join(differ) + "): rerun that tune to resume it, or delete the file "
                "or give another --out")
        _readable(self.path, old)
        self.data.update({k: v for k, v in old.items() if k not in ("status", "run")})
        self.written = True  # a failure from here on names it
        return old

    def acceptance(self, acc, mix, stage: str, rows: int | None = None) -> None:
        """The acceptance measured up to `stage` ("chain", then "tree"), the tree's run
        decoding prompts `rows` at a time."""
        self.save(acceptance=acc.to_dict(), acceptance_stage=stage,
                  prompt_acceptance=[a.to_dict() for a in mix.prompts],
                  prompt_tree_counts=[{"reached": r, "accepted": a} for r, a in mix.tree_counts],
                  **({"tree_rows": rows} if stage == "tree" else {}))

    def save(self, **parts) -> None:
        if self.path is None:
            return
        from draftsmith.data.atomic import atomic_write

        self.data.update(parts)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a crash mid-write leaves the last whole file
        atomic_write(self.path, json.dumps(self.data, indent=1, default=str).encode(),
                     "the measurements it held before are kept")
        self.written = True

    @contextlib.contextmanager
    def on_failure(self, say: Callable[[str], None] | None = None) -> Iterator[None]:
        """A failure inside names the file, where this run wrote one; a ctrl-C through `say`
        too, as typer turns it into exit 130 without showing the note."""
        try:
            yield
        except DraftsmithError as e:
            if not self.written:
                raise
            raise DraftsmithError(f"{e} (tune stopped; what it measured is in {self.path}, "
                                  "and the same tune run again resumes from it)") from e
        except BaseException as e:
            if self.written and say is not None and isinstance(e, KeyboardInterrupt):
                say(f"tune: stopped (ctrl-C): what it measured is in {self.path}; the same "
                    "tune run again resumes from it")
            if self.written:
                e.add_note(f"draftsmith tune stopped; what it measured is in {self.path}, and "
                           "the same tune run again resumes from it")
            raise

    def drop(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _readable(path: Path, old: dict) -> None:
    """The kept figures read as the run will read them, now: a damaged or hand-edited file
    raised a KeyError or TypeError minutes later, after the target and drafter loaded."""
    try:
        kept_acceptance(old, False)
        kept_costs(old)
        kept_shapes(old)
        kept_measured(old)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
        raise DraftsmithError(f"{path}: its kept measurements cannot be read ({what}); delete "
                              "it to measure them again, or give another --out") from e


def agreed(tp, resume: Callable[[], dict]) -> dict:
    """Rank 0's `resume()` on every rank, its refusal too: ranks measure in step, so they
    skip alike."""
    got: tuple[dict, str | None] = ({}, None)
    if tp is None or tp.rank == 0:
        try:
            got = (resume(), None)
        except DraftsmithError as e:
            got = ({}, str(e))
    if tp is not None and tp.size > 1:
        import torch.distributed as dist

        box = [got]
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp.group, 0), group=tp.group)
        got = box[0]
    if got[1]:
        raise DraftsmithError(got[1])
    return got[0]


def _rows(was: dict) -> int | None:
    """The most rows the stopped run's engine held (its largest batch size)."""
    batches = (was.get("run") or {}).get("batches")
    return max(batches) if isinstance(batches, list) and batches else None


def kept_acceptance(was: dict, sampled: bool, rows: int | None = None
                    ) -> tuple[str | None, Acceptance | None, PromptMix | None]:
    """(stage, pooled, each prompt's) of the acceptance a stopped run kept; stage None: none.
    A tree run that decoded the prompts other than `rows` at a time (another largest batch
    size) is measured again; the chain's (each prompt alone) is kept."""
    stage = was.get("acceptance_stage")
    if stage not in ("chain", "tree"):
        return None, None, None
    if stage == "tree" and rows is not None and was.get("tree_rows", _rows(was)) != rows:
        stage = "chain"
    own = tuple(Acceptance.from_dict(a) for a in was["prompt_acceptance"])
    counts = tuple((c["reached"], c["accepted"]) for c in was.get("prompt_tree_counts", []))
    return stage, Acceptance.from_dict(was["acceptance"]), PromptMix(own, counts, sampled)


def kept_costs(was: dict, batches: list[int] | None = None, refill_rows: int | None = None
               ) -> CostTable | None:
    """The costs a stopped run kept, at those of `batches` it timed (None: none of them; the
    others are `missing`); its refills' prompt passes only where timed for `refill_rows`."""
    if not was.get("costs"):
        return None
    costs = CostTable.from_dict(was["costs"])
    if batches is None:
        return costs
    keep = [b for b in batches if b in costs.verify]
    if not keep:
        return None
    same = was.get("refill_rows", refill_rows if was["run"].get("batches") == batches else None)
    return dataclasses.replace(
        costs, **{n: {b: t[b] for b in keep if b in (t := getattr(costs, n))}
                  for n in BATCH_KEYED},
        **({} if same == refill_rows else {"refill": {}, "spec_refill": {}}))


def kept_shapes(was: dict) -> dict[str, float | dict[str, float]]:
    """The cost shapes a stopped run timed, by name (`measure.CostLog`): ms, or ms by phase."""
    shapes = was.get("cost_shapes", {})
    for key, v in shapes.items():
        ok = (isinstance(v, dict) and all(isinstance(x, int | float) for x in v.values())
              ) or (isinstance(v, int | float) and not isinstance(v, bool))
        if not ok:
            raise ValueError(f"cost shape {key!r}: {v!r} is no figure")
    return shapes


def missing(costs: CostTable | None, batches: list[int]) -> list[int]:
    """The batch sizes `costs` has not timed."""
    return [b for b in batches if costs is None or b not in costs.verify]


def joined(kept: CostTable | None, new: CostTable, batches: list[int]) -> CostTable:
    """`kept` and `new` (timed at the batch sizes `kept` lacks) as one table, by batch size in
    the order of `batches`, as one run timing them all writes it."""
    if kept is None:
        return new
    return dataclasses.replace(kept, **{
        n: {b: t[b] for b in batches for t in (getattr(kept, n), getattr(new, n)) if b in t}
        for n in BATCH_KEYED})


def measured_row(m: Measurement) -> dict:
    s = m.setting
    return {"batch": m.batch, "setting": str(s), "steps": s.steps, "topk": s.topk,
            "num_draft_tokens": s.num_draft_tokens, "tokens_per_s": m.tokens_per_s,
            "accept_length": m.accept_length, "phases_ms": dict(m.phases or {}),
            "cycle_ms": m.cycle_ms, "busy": m.busy}


def kept_measured(was: dict) -> dict[tuple[int, SpecSetting], Measurement]:
    """The swept settings a stopped run measured, by (batch, setting)."""
    out = {}
    for r in was.get("measured", []):
        s = SpecSetting(r["steps"], r["topk"], r["num_draft_tokens"])
        out[(r["batch"], s)] = Measurement(s, r["batch"], r["tokens_per_s"], r["accept_length"],
                                           r["phases_ms"] or None, r["cycle_ms"], r["busy"])
    return out
