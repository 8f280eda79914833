"""Command-line options that several commands share, declared once."""

from __future__ import annotations

import inspect
import math
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any

import typer

from draftsmith.engine.params import whole  # the engine's rule: not a bool, nor a float
from draftsmith.errors import DraftsmithError


def checked_device(value: str) -> str:
    """--device refused as it is parsed (a callback), before any work: a command that hands it
    to worker processes unread (`tune-nccl`) would otherwise fail in every one of them."""
    if value != "auto":
        from draftsmith.cli import pick_device

        pick_device(value)
    return value


TARGET = typer.Option("default", "--target", help="HF folder, .gguf file, or 'default'")
DEVICE_HELP = "cpu, cuda, cuda:N or auto"
DEVICE = typer.Option("auto", "--device", help=DEVICE_HELP, callback=checked_device)
# for a command that uses --device only in some modes: it refuses the flag where unused, not an
# absent GPU first (it checks the device itself where it uses it)
DEVICE_UNCHECKED = typer.Option("auto", "--device", help=DEVICE_HELP)
DTYPE = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto (bfloat16 on "
                     "GPU, float32 on CPU)")
COMPILE = typer.Option(False, "--compile", help="torch.compile the target's layers (GPU; faster "
                       "decode after a one-off compile)")


def count(value: Any, flag: str) -> int:
    """One count option's value: a whole number >= 1, or the error every count option gives
    (the same value the same answer in every command and in the Python API)."""
    if not whole(value):
        raise DraftsmithError(f"{flag} must be a whole number >= 1, got {value!r}")
    if value < 1:
        raise DraftsmithError(f"{flag} must be >= 1, got {value}")
    return int(value)


def int_list(text: str, what: str, empty_ok: bool = False) -> list[int]:
    """A comma-separated list of counts (whole numbers >= 1) from option `what`, each item read
    as one count option reads its text (space around it ignored); an empty item skipped."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        # int() alone read `1_2` as 12 and `٣` as 3
        value: Any = int(item) if re.fullmatch(r"[+-]?[0-9]+", item) else item
        try:
            out.append(count(value, what))
        except DraftsmithError:
            within = f" in {text!r}" if item != text.strip() else ""
            raise DraftsmithError(f"{what} must be whole numbers >= 1, got {value!r}{within}"
                                  + _comma_hint(item, text, what)) from None
    if not out and not empty_ok:
        raise DraftsmithError(f"{what}: give at least one value, got {text!r}")
    return out


def _comma_hint(item: str, text: str, what: str) -> str:
    """Where an item is numbers split some other way (`1 4`, `1;4`): the list as it wants it,
    since "must be whole numbers, got '1 4'" read as if 1 and 4 were not."""
    values = re.findall(r"[^\s,;]+", text)
    if (re.fullmatch(r"[+-]?[0-9]+(?:[\s;]+[+-]?[0-9]+)+", item)
            and all(re.fullmatch(r"\+?[0-9]+", v) and int(v) >= 1 for v in values)):
        return f": separate values with commas, as {what} {','.join(values)}"
    return ""


def at_least_one(flags: dict[str, Any]) -> None:
    """Each of these count options (by flag) a whole number >= 1 where given (`count`)."""
    for flag, value in flags.items():
        if value is not None:
            count(value, flag)


def given(command: Callable[..., Any], **values: Any) -> list[str]:
    """The flags, as typed, of those of `command`'s options whose values differ from their
    declared defaults: what the user gave (one given at its default is not told apart)."""
    params = inspect.signature(command).parameters
    out = []
    for name, value in values.items():
        info = params[name].default
        if value != info.default:
            decl = info.param_decls[0] if info.param_decls else "--" + name.replace("_", "-")
            on, _, off = decl.partition("/")
            out.append(off if off and value is False else on)
    return out


def unused(flags: list[str], where: str, fix: str) -> None:
    """Refuse flags given where they do nothing: they apply only `where`; `fix` says what to do,
    its {it} standing for them."""
    if flags:
        one = len(flags) == 1
        raise DraftsmithError(f"{', '.join(flags)} {'applies' if one else 'apply'} only {where}: "
                              + fix.format(it="it" if one else "them"))


def check_compile(compile: bool, device: str) -> None:
    """--compile refused off CUDA: the compiled layers run only inside CUDA graphs, so on a CPU
    it did nothing while records said `compile: true`."""
    unused(["--compile"] if compile and not str(device).startswith("cuda") else [],
           "on a GPU (--device cuda)", "leave {it} out on the CPU")


def check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    """--temperature, --top-p and --top-k in range, refused by flag before any work."""
    if not math.isfinite(temperature) or temperature < 0:  # NaN passes every comparison
        raise DraftsmithError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                              f"{temperature}")
    if not 0 < top_p <= 1:
        raise DraftsmithError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise DraftsmithError(f"--top-k must be >= 0 (0: off), got {top_k}")


SEEDS = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes


def check_seed(seed: int | None) -> None:
    """--seed within what torch takes: past it, torch.manual_seed's overflow was a traceback
    after the target had loaded."""
    if seed is not None and not SEEDS[0] <= seed <= SEEDS[1]:
        raise DraftsmithError(f"--seed must be from -2**63 to 2**64 - 1, got {seed}")


def check_chain_tokens(steps: list[int], tokens: list[int]) -> None:
    """--num-draft-tokens of chains (--topk 1): steps + 1, as SGLang forces, one for each --steps
    where several are given; none given is fine."""
    want = sorted({s + 1 for s in steps})
    if tokens and sorted(set(tokens)) != want:
        got, need = ",".join(map(str, tokens)), ",".join(map(str, want))
        raise DraftsmithError(f"--num-draft-tokens {got}: a chain (--topk 1) verifies --steps + 1 "
                              f"= {need} tokens; leave it out, or give --topk > 1")


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


SECRETS = ("--api-key",)  # flags whose values a record never keeps
URLS = ("--base-url",)  # flags whose URL a record keeps without its credentials (`redacted_url`)
# query fields that carry a credential (`?api_key=`, `?token=`, a signed URL's `sig`)
SECRET_FIELDS = ("key", "token", "secret", "password", "passwd", "auth", "sig", "signature",
                 "credential")


def redacted_url(url: str) -> str:
    """`url` as records and messages show it: a password in it (or a user name standing alone,
    a token) and the values of query fields named like credentials written as ***."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL: the client refuses it, and it is shown as given
        return url
    user, at, host = parts.netloc.rpartition("@")
    if at:
        name, colon, _ = user.partition(":")
        host = f"{name}:***@{host}" if colon else f"***@{host}"
    fields = parse_qsl(parts.query, keep_blank_values=True)
    if any(_secret(k) for k, _ in fields):
        query = urlencode([(k, "***" if _secret(k) else v) for k, v in fields], safe="*")
    else:
        query = parts.query
    return urlunsplit(parts._replace(netloc=host, query=query))


def _secret(field: str) -> bool:
    low = field.lower()
    return any(w in low for w in SECRET_FIELDS)


def command_line(prog: str = "draftsmith") -> str:
    """This process's command as a user would type it again (`python -m draftsmith` and the
    `draftsmith` script alike), for the records runs keep: a secret's value (`SECRETS`) written
    as *** (the records are shared with the data; OPENAI_API_KEY passes the key unrecorded),
    a server's URL (`URLS`) without its credentials (`redacted_url`)."""
    args = list(sys.argv[1:])
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in SECRETS and eq:
            args[i] = f"{flag}=***"
        elif a in SECRETS and i + 1 < len(args):
            args[i + 1] = "***"
        elif flag in URLS and eq:
            args[i] = f"{flag}={redacted_url(value)}"
        elif a in URLS and i + 1 < len(args):
            args[i + 1] = redacted_url(args[i + 1])
    return shlex.join([*prog.split(), *args])
