"""`draftsmith doctor`: is the drafter wired to the hidden states its data holds?

The stored aux states are matched against a live forward of the target, layer by layer; the
drafter's config is read the way each engine reads it; data, drafter and target are checked
for consistency; a short speculative run compares acceptance with the training log.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from draftsmith.doctor.report import Finding, Report
from draftsmith.doctor.run import DoctorOptions, run_doctor
from draftsmith.errors import DraftsmithError

NUM_PROMPTS = 4  # the short run's prompts by default

__all__ = ["DoctorOptions", "Finding", "Report", "doctor", "report_json", "run_doctor"]


def report_json(rep: Report, strict_exit: bool = False) -> str:
    """The report as strict JSON: a NaN or inf anywhere in it is null, as every other
    draftsmith report writes it (jq and JavaScript refuse the NaN literal); `exit_code` is the
    command's (under --strict, `ok` alone does not say it: warnings fail it too)."""
    from draftsmith.bench.report import strict

    out = rep.to_dict() | {"exit_code": rep.exit_code(strict_exit)}
    return json.dumps(strict(out), indent=1, default=str, allow_nan=False)


def prompt_count(value: int | str, flag: str = "--num-prompts") -> int:
    """--num-prompts (or its old name --prompts, `flag`) as a count: a suite name or file (what
    compare, tune, train and generate take) refused in one line, not click's "Input should be a
    valid integer"."""
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise DraftsmithError(
            f"{flag} takes a number of prompts for the short run, got {value!r}; doctor "
            "takes them from --data, else built-in ones (a suite or file is what compare, tune, "
            "train and generate take there): give a whole number, e.g. --num-prompts 8") from None


def _old_count(value: int | str) -> int:
    return prompt_count(value, "--prompts")


def prompts_given(num_prompts: int, old: int | None) -> tuple[int, str]:
    """The run's prompt count and the flag that gave it: --prompts, the old name, where given
    (refused beside a --num-prompts of other than its default)."""
    if old is None:
        return num_prompts, "--num-prompts"
    if num_prompts != NUM_PROMPTS:
        raise DraftsmithError("--prompts is --num-prompts' old name: give --num-prompts alone")
    return old, "--prompts"


def doctor(
    data: Path = typer.Option(None, "--data", help="Dataset folder (manifest.json + shards)"),
    drafter: Path = typer.Option(None, "--drafter",
                                 help="Drafter folder: draftsmith, SGLang or speculators layout"),
    target: str = typer.Option(None, "--target",
                               help="HF folder, .gguf or 'default' (else the target the data, "
                                    "else the drafter, records)"),
    engine: str = typer.Option(None, "--engine",
                               help="sglang | vllm | draftsmith (sglang-legacy, an older name, "
                                    "reads as sglang): check the ids "
                                    "as this engine reads them (default: none; without it, as "
                                    "the drafter's layout is served: a draftsmith folder by "
                                    "draftsmith, SGLang's by SGLang, and vLLM where its key "
                                    "is written, speculators' by vLLM; capture limits "
                                    "warned, not errors)"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    samples: int = typer.Option(4, "--samples", help="Samples to recompute with the target"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens per sample compared"),
    all_tokens: bool = typer.Option(False, "--all-tokens",
                                    help="Compare every token, not only loss-masked ones"),
    run: bool = typer.Option(True, "--run/--no-run", help="Short speculative run"),
    num_prompts: int = typer.Option(NUM_PROMPTS, "--num-prompts", parser=prompt_count,
                                    metavar="<int>", help="How many prompts the speculative "
                                    "run takes (a count: the data's, else built-in ones; "
                                    "--prompts is its old name)"),
    prompts: int | None = typer.Option(None, "--prompts", parser=_old_count, hidden=True,
                                help="--num-prompts' old name"),
    max_new: int = typer.Option(32, "--max-new-tokens", "-n", help="New tokens per prompt"),
    steps: int = typer.Option(None, "--steps", help="Draft steps (default: from the log)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto"),
    dtype: str = typer.Option("float32", help="float32, bfloat16, float16 or auto (bfloat16 on "
                              "GPU, float32 on CPU) for the live target"),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 on warnings too"),
    full_verify: bool = typer.Option(False, "--full-verify",
                                     help="Hash every shard (default: sizes, shapes and dtypes "
                                          "of all, sha256 of those samples are read from)"),
) -> None:
    """Check data, drafter and target against each other; exit 1 on any error finding."""
    from draftsmith.cli import device_dtype
    from draftsmith.doctor.render import show
    from draftsmith.options import given

    count, flag = prompts_given(num_prompts, prompts)
    _unused_flags(data is not None, drafter is not None, run,
                  given(doctor, samples=samples, max_tokens=max_tokens, all_tokens=all_tokens,
                        full_verify=full_verify),
                  [flag if f == "--num-prompts" else f for f in
                   given(doctor, num_prompts=count, max_new=max_new, steps=steps)])
    dev, dt = device_dtype(device, dtype)  # `auto` as every other command reads it
    opts = DoctorOptions(data, drafter, target, engine, samples, max_tokens, all_tokens, run,
                         count, max_new, steps, dev, dt, full_verify, progress=True,
                         prompts_flag=flag)
    rep = run_doctor(opts)
    if as_json:
        print(report_json(rep, strict))
    else:
        show(rep)
    code = rep.exit_code(strict)
    if code:
        raise typer.Exit(code)


def _unused_flags(matches: bool, drafts: bool, run: bool, match_flags: list[str],
                  run_flags: list[str]) -> None:
    """Refuse the live match's flags without --data and the run's where no run is made: they
    did nothing, silently."""
    from draftsmith.options import unused

    if not matches:
        unused(match_flags, "with --data (the live match of its stored states)",
               "give --data DIR with {it}, or leave {it} out")
    if not drafts:
        unused(run_flags, "with --drafter (the speculative run)",
               "give --drafter DIR with {it}, or leave {it} out")
    elif not run:
        unused(run_flags, "to the speculative run, which --no-run skips",
               "drop --no-run, or leave {it} out")
