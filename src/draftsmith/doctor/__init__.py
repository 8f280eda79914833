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

__all__ = ["DoctorOptions", "Finding", "Report", "doctor", "run_doctor"]


def doctor(
    data: Path = typer.Option(None, "--data", help="Dataset folder (manifest.json + shards)"),
    drafter: Path = typer.Option(None, "--drafter",
                                 help="Drafter folder: draftsmith, SGLang or speculators layout"),
    target: str = typer.Option(None, "--target",
                               help="HF folder, .gguf or 'default' (else the data's target)"),
    engine: str = typer.Option(None, "--engine",
                               help="sglang | sglang-legacy | vllm | draftsmith: check the ids "
                                    "as this engine reads them"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    samples: int = typer.Option(4, "--samples", help="Samples to recompute with the target"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens per sample compared"),
    all_tokens: bool = typer.Option(False, "--all-tokens",
                                    help="Compare every token, not only loss-masked ones"),
    run: bool = typer.Option(True, "--run/--no-run", help="Short speculative run"),
    prompts: int = typer.Option(4, "--prompts", "--num-prompts",
                                help="Prompts in the speculative run"),
    max_new: int = typer.Option(32, "--max-new-tokens", "-n", help="New tokens per prompt"),
    steps: int = typer.Option(None, "--steps", help="Draft steps (default: from the log)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N or auto"),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or auto (bf16 on GPU) for the "
                              "live target"),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 on warnings too"),
    full_verify: bool = typer.Option(False, "--full-verify",
                                     help="Hash every shard (default: sizes, shapes and dtypes "
                                          "of all, sha256 of those samples are read from)"),
) -> None:
    """Check data, drafter and target against each other; exit 1 on any error finding."""
    from draftsmith.cli import device_dtype
    from draftsmith.doctor.render import show

    dev, dt = device_dtype(device, dtype)  # `auto` as every other command reads it
    opts = DoctorOptions(data, drafter, target, engine, samples, max_tokens, all_tokens, run,
                         prompts, max_new, steps, dev, dt, full_verify)
    rep = run_doctor(opts)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1, default=str))
    else:
        show(rep)
    code = rep.exit_code(strict)
    if code:
        raise typer.Exit(code)
