"""`draftsmith bench`: baseline vs speculative decoding on prompt suites."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from draftsmith.errors import DraftsmithError
from draftsmith.options import (
    COMPILE,
    DEVICE,
    DTYPE,
    TARGET,
    at_least_one,
    check_folder,
    check_seed,
    command_line,
    given,
    int_list,
)


# click keeps the last of a scalar option given twice, without a word: bench's own options are
# lists of what was typed, so a repeat is refused by flag (`_once`) or, in a comma-separated
# list, adds its values (`_joined`), as --suite does; metavars keep the help as it read
def _repeatable(default: list[str], *decls: str, **kw: Any) -> Any:
    return typer.Option(default, *decls, metavar="<str>", **kw)


def bench(
    target: list[str] = _repeatable(["default"], "--target", help=TARGET.help),
    drafter: list[str] = _repeatable([], "--drafter", show_default=False,
                                     help="required (bench refuses to start without it): a "
                                          "draftsmith drafter folder, or 'random' (untrained: "
                                          "times the machinery only)"),
    suite: list[str] = typer.Option(["chat"], "--suite", metavar="<name|file>",
                                    help="chat, humaneval, or a prompt file (repeatable)"),
    num_prompts: int = typer.Option(16, "--num-prompts", help="Prompts per suite; 0 = all"),
    steps: list[str] = _repeatable(["1,3,5"], "--steps",
                                   help="Draft steps per cycle, comma-separated"),
    topk: list[str] = _repeatable(["1"], "--topk",
                                  help="Comma-separated: 1 = chain; > 1 = EAGLE-2 tree"),
    num_draft_tokens: list[str] = _repeatable([], "--num-draft-tokens", show_default=False,
                                              help="Tokens verified per cycle, root included, "
                                                   "comma-separated: a tree needs them (a chain "
                                                   "verifies steps + 1)"),
    batch_size: list[str] = _repeatable(["1"], "--batch-size", "--batch-sizes",
                                        help="Batch sizes, comma-separated"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n",
                                       help="New tokens per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", help="With --temperature: nucleus sampling"),
    top_k: int = typer.Option(0, "--top-k", help="With --temperature: the k likeliest only"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    compile: bool = COMPILE,
    profile: bool = typer.Option(False, "--profile",
                                 help="Phase profiler (also DRAFTSMITH_PROFILE=1), in a second "
                                      "run of each setting, the timed one unprofiled; with "
                                      "--refill it adds the refills' share"),
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o",
                             help="Folder for bench.json, bench.png"),
    seed: int = typer.Option(0, help="With --temperature: seeds the sampling"),
    refill: bool = typer.Option(False, "--refill",
                                help="A finished row takes the next prompt (baseline and "
                                     "speculative alike); tokens/s over wall time"),
    refill_every: int = typer.Option(0, "--refill-every",
                                     help="With --refill: refill ended rows at most every N "
                                          "cycles (decode steps for the baseline); 0: 4 below "
                                          "32 rows, 8 from 32"),
    repeats: int = typer.Option(1, "--repeats",
                                help="Timed rounds of each suite and batch, the runs' order "
                                     "rotated a round: the table shows tok/s and speedups as "
                                     "the median over the rounds and their range (1: timed "
                                     "once, no spread)"),
) -> None:
    """Tokens/s, speedup, accept length and phases: the baseline engine vs speculative settings."""
    from draftsmith.bench.run import (
        BenchConfig,
        BenchFailed,
        BenchInterrupted,
        check_topk,
        run_bench,
    )
    from draftsmith.bench.suites import distinct_suites, suite_messages
    from draftsmith.cli import device_dtype, sampling_params
    from draftsmith.models.eagle3 import check_drafter

    target = _once(target, "--target", "bench times one target; give --target once")
    drafter = _once(drafter, "--drafter", "bench times one drafter against the baseline; give "
                    "one, or set drafters side by side with `draftsmith compare "
                    f"{' '.join(drafter)}`")
    params = sampling_params(temperature, top_p, top_k, bool(given(bench, seed=seed)))
    check_seed(seed)
    at_least_one({"--repeats": repeats})
    if not drafter:
        raise DraftsmithError("give --drafter DIR (a draftsmith drafter folder) or 'random'")
    # a mistyped or damaged folder, before the target's minutes of loading
    dcfg = check_drafter(drafter) if drafter != "random" else None
    for name in distinct_suites(suite):  # before the target loads; run_bench says its skips
        suite_messages(name, num_prompts, warn=lambda _: None)
    if refill_every and not refill:
        raise DraftsmithError("--refill-every applies to refilled rows: give --refill with it")
    if refill_every < 0:
        raise DraftsmithError(f"--refill-every must be >= 0 (0: by batch size), got "
                              f"{refill_every}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_folder(out, "--out")
    dev, dt = device_dtype(device, dtype)
    cfg = BenchConfig(
        target=target, drafter=drafter, suites=list(suite), num_prompts=num_prompts,
        steps=int_list(_joined(steps), "--steps"), topk=int_list(_joined(topk), "--topk"),
        num_draft_tokens=int_list(_joined(num_draft_tokens), "--num-draft-tokens",
                                  empty_ok=True),
        batch_sizes=int_list(_joined(batch_size), "--batch-size"),
        max_new_tokens=max_new_tokens,
        params=params, device=dev,
        dtype=dt, profile=True if profile else None,
        seed=seed, compile=compile, refill=refill, refill_every=refill_every,
        repeats=repeats,
    )
    if dcfg is not None:  # as run_bench does, here before the target loads
        check_topk(cfg.settings(), dcfg.draft_vocab_size)
    # soft_wrap: each line whole, as written (rich cut a warning in two at 80 columns in a log)
    console = Console(stderr=True, soft_wrap=True)
    try:
        report = run_bench(cfg, log=lambda s: console.print(s, style="dim", markup=False))
    except BenchInterrupted as stop:  # ctrl-C: what was timed is kept, as train keeps a step
        report = stop.report
        report["meta"]["command"] = command_line()
        _write(report, out)
        console.print(f"interrupted: wrote the runs finished to {out / 'bench.json'} and "
                      f"{out / 'bench.png'} ({len(report['meta']['not_run'])} not run, listed "
                      "there)", markup=False)
        raise KeyboardInterrupt from None  # exit 130
    except BenchFailed as stop:  # an error midway: the rows timed before it are kept
        report = stop.report
        report["meta"]["command"] = command_line()
        _write(report, out)
        console.print(f"failed in {report['meta']['failed']['run']}: wrote the runs finished "
                      f"to {out / 'bench.json'} and {out / 'bench.png'} "
                      f"({len(report['meta']['not_run'])} not run, listed there)", markup=False)
        raise stop.error from None  # as it came: our one line, or a bug's traceback
    report["meta"]["command"] = command_line()  # bench.json says how to run it again
    _write(report, out)
    console.print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}", markup=False)


def _once(values: list[str] | str, flag: str, why: str) -> str:
    """The one value of an option given at most once ("" where not given); given more often,
    refused by flag with every value, since only one of them would run. A Python caller's
    plain string is that one value."""
    if isinstance(values, str):
        return values
    if len(values) > 1:
        raise DraftsmithError(f"{flag} given {len(values)} times ({', '.join(values)}): {why}")
    return values[0] if values else ""


def _joined(values: list[str] | str) -> str:
    """A comma-separated list option given once or more, as one list (`--steps 1 --steps 3`
    is `--steps 1,3`); a Python caller's plain string as it is."""
    return values if isinstance(values, str) else ",".join(values)


def _write(report: dict[str, Any], out: Path) -> None:
    """bench.json, then the tables (stderr) and the headline JSON line (stdout), then bench.png;
    where bench.json cannot be written the JSON line carries the whole report instead, so
    nothing is lost."""
    from draftsmith.bench.report import print_report, table_width, write_json, write_png

    # the tables on stderr: stdout is the JSON line alone (`bench ... | jq` reads it); rounds'
    # ranges widen the table past 150 columns, which would fold each figure from its range
    shown = Console(stderr=True, width=max(Console(stderr=True).width, 150, table_width(report)))
    say_replaced(out / "bench.json", lambda s: shown.print(s, markup=False, highlight=False))
    try:
        path = write_json(report, out / "bench.json")
    except OSError as e:
        print_report(report, shown)
        raise DraftsmithError(f"--out {out}: cannot write bench.json ({e.strerror or e}); the "
                              "results are the JSON line printed above") from None
    print_report(report, shown, path.resolve())
    try:
        # an earlier run's plot never stays beside this bench.json, should this one fail
        (out / "bench.png").unlink(missing_ok=True)
        write_png(report, out / "bench.png")
    except OSError as e:
        raise DraftsmithError(f"--out {out}: cannot write bench.png ({e.strerror or e}); "
                              f"the results are in {path}") from None


def replaced(report: Path) -> str | None:
    """The line saying an earlier run's report is about to be replaced (benchmarks are rerun
    into one folder on purpose, so it is no refusal, but nothing goes without a word): its file
    and when it was written; None where there is none."""
    try:
        written = datetime.fromtimestamp(report.stat().st_mtime)
    except OSError:
        return None
    return (f"replacing the earlier report {report} (written "
            f"{written:%Y-%m-%d %H:%M:%S}) and the files beside it")


def say_replaced(report: Path, say: Callable[[str], object]) -> None:
    """`replaced`'s line, through `say`, where there is an earlier report."""
    if line := replaced(report):
        say(line)
