"""Command-line options that several commands share, declared once."""

from __future__ import annotations

import shlex
import sys

import typer

from draftsmith.errors import DraftsmithError


def checked_device(value: str) -> str:
    """--device refused as it is parsed (a callback), before any work: a command that hands it
    to worker processes unread (`tune-nccl`) would otherwise fail in every one of them."""
    if value != "auto":
        from draftsmith.cli import pick_device

        pick_device(value)
    return value


TARGET = typer.Option("default", "--target", help="HF folder, .gguf file, or 'default'")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto",
                      callback=checked_device)
DTYPE = typer.Option("auto", "--dtype", help="float32, bfloat16 or auto (bf16 on GPU)")
COMPILE = typer.Option(False, "--compile", help="torch.compile the target's layers (GPU; faster "
                       "decode after a one-off compile)")


def int_list(text: str, what: str, empty_ok: bool = False) -> list[int]:
    """A comma-separated list of positive integers from option `what`, or a clear error."""
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DraftsmithError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if (not out and not empty_ok) or any(x < 1 for x in out):
        raise DraftsmithError(f"{what}: expected positive integers, got {text!r}")
    return out


def at_least_one(flags: dict[str, int | None]) -> None:
    """Each of these options (by flag) is at least 1 where given, or a clear error."""
    for flag, value in flags.items():
        if value is not None and value < 1:
            raise DraftsmithError(f"{flag} must be >= 1, got {value}")


def check_folder(folder, flag: str = "") -> None:
    """Refuse a folder to write that is, or would lie under, an existing file (before any work);
    `flag`, where a command-line option named it, leads the message."""
    from pathlib import Path

    folder = Path(folder)
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == folder else f"lies under the file {p}"
                raise DraftsmithError(f"{flag} {folder}".strip() + f": {where}, not a folder")
            return


def command_line(prog: str = "draftsmith") -> str:
    """This process's command as a user would type it again (`python -m draftsmith` and the
    `draftsmith` script alike), for the records runs keep."""
    return shlex.join([*prog.split(), *sys.argv[1:]])
