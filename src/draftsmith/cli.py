"""The `draftsmith` command line: a thin layer over the stage functions.

Each stage module exposes a typer app or command; they are registered here. A DraftsmithError
anywhere becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftsmith.errors import DraftsmithError
from draftsmith.options import (
    DEVICE,
    DTYPE,
    SECRETS,
    TARGET,
    URLS,
    at_least_one,
    check_sampling,
    check_seed,
    given,
    redacted_url,
    unused,
)

if TYPE_CHECKING:
    from draftsmith.engine.params import SamplingParams

NB_HYPHEN = "\u2011"  # a hyphen click's wrapping does not break at


def _held(text: str) -> str:
    """`text` with each hyphen inside a word held, so a flag is never wrapped as `--max-` over
    `batch` (the name cut where a reader took it for whole)."""
    return re.sub(r"(?<=[\w-])-(?=\w)", NB_HYPHEN, text)


_Context = typer.core.TyperCommand.context_class


class _Formatter(_Context.formatter_class):
    """click's help formatter, hyphens held while it wraps (`_held`) and put back after."""

    def write_text(self, text: str) -> None:
        super().write_text(_held(text))

    def write_dl(self, rows, *args: Any, **kwargs: Any) -> None:
        super().write_dl([(_held(a), _held(b)) for a, b in rows], *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(NB_HYPHEN, "-")


class _PlainContext(_Context):
    formatter_class = _Formatter


class _Untyped(typer.core.TyperArgument):
    def display_type_rich(self, ctx: Any) -> str | None:
        return None


class _Once:
    """Over click's parser (typer's own copy of click, or click's), refusing a single-value
    option given more than once (`_refuse_repeats`): click kept the last value without a word
    (`serve --port 1 --port 2` served on 2)."""

    def parse_args(self, args: list[str]) -> Any:
        self.typed: dict[Any, list[Any]] = {}
        out = super().parse_args(args)  # type: ignore[misc]
        if not self.ctx.resilient_parsing and not any(p.is_eager for p in self.typed):
            _refuse_repeats(self.typed)  # --help still helps
        return out

    def _process_opts(self, arg: str, state: Any) -> None:
        before = len(getattr(state, "order", []))
        super()._process_opts(arg, state)  # type: ignore[misc]
        # a list or count option adds its repeats
        for param in getattr(state, "order", [])[before:]:
            if not (getattr(param, "multiple", False) or getattr(param, "count", False)):
                self.typed.setdefault(param, []).append(state.opts[param.name])


@functools.cache
def _once_parser(parser: type) -> type:
    return type(f"Once{parser.__name__}", (_Once, parser), {})


def _refuse_repeats(typed: dict[Any, list[Any]]) -> None:
    """One option's values as typed, each a value (or a flag's True/False), refused where more
    than one: a flag given twice the same way is given once."""
    for param, values in typed.items():
        if param.is_flag and len(set(values)) > 1:
            raise DraftsmithError(f"{_long(param.opts)} and {_long(param.secondary_opts)} both "
                                  "given: give one of them")
        if not param.is_flag and len(values) > 1:
            flag = _long(param.opts)
            shown = ", ".join(_shown(flag, v) for v in values)
            raise DraftsmithError(f"{flag} given {len(values)} times ({shown}): give it once")


def _long(opts: list[str]) -> str:
    return next((o for o in opts if o.startswith("--")), opts[0])


def _shown(flag: str, value: Any) -> str:
    """A value as an error may show it: a secret's never, a URL's without its credentials."""
    text = " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
    if flag in SECRETS:
        return "***"
    return redacted_url(text) if flag in URLS else text


class PlainCommand(typer.core.TyperCommand):
    """click's plain help (`_Formatter`); a variadic argument shown as `name...` alone: typer
    adds its annotation (`sources... <list[str]>`), metavar or not, a Python type its help
    says better; a single-value option given twice refused (`_Once`)."""

    context_class = _PlainContext

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:
            if type(p) is typer.core.TyperArgument and p.nargs != 1:
                p.__class__ = _Untyped

    def make_parser(self, ctx: Any) -> Any:
        parser = super().make_parser(ctx)
        if hasattr(parser, "_process_opts"):  # click's private step; another click: no check
            parser.__class__ = _once_parser(type(parser))
        return parser


class PlainGroup(typer.core.TyperGroup):
    context_class = _PlainContext


# click's plain help, not rich's panels: rich shrank the option column to fit 80 columns and cut
# long names (`--intermediate-si…`); click wraps the help text instead and keeps every name whole
app = typer.Typer(
    cls=PlainGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
    help="Make data for, train, check, benchmark, tune, serve and export EAGLE-3 drafters of "
         "Llama-family targets.",
)


def _print_version(on: bool) -> None:
    if on:
        print(f"draftsmith {installed_version()}")
        raise typer.Exit()


def installed_version() -> str:
    """The installed distribution's version; a source tree run without installing has none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("draftsmith")
    except PackageNotFoundError:
        return "(not installed: no version recorded)"


@app.callback()
def _top(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print draftsmith's version and exit")) -> None:
    pass


targets_app = typer.Typer(no_args_is_help=True, help="Inspect a target (HF folder, .gguf or "
                          "'default'): shapes, hashes, fingerprint, default aux layers.")
app.add_typer(targets_app, name="targets")
console = Console()

# (module, attribute, name): stage commands that live beside their code.
SUBAPPS = [
    ("draftsmith.data.cli", "app", "data"),
]
COMMANDS = [
    ("draftsmith.train.cli", "train", "train"),
    ("draftsmith.export.cli", "export", "export"),
    ("draftsmith.export.cli", "import_", "import"),
    ("draftsmith.doctor", "doctor", "doctor"),
    ("draftsmith.bench.cli", "bench", "bench"),
    ("draftsmith.bench.allreduce", "allreduce_bench", "bench-allreduce"),
    ("draftsmith.tune.cli", "tune", "tune"),
    ("draftsmith.tune.cli", "tune_nccl", "tune-nccl"),
    ("draftsmith.compare", "compare", "compare"),
    ("draftsmith.serve.cli", "serve", "serve"),
    ("draftsmith.demo", "demo", "demo"),
]


def _register() -> None:
    """Adds every stage command once: a second call (a test, a program calling `main` again)
    listed each command twice in the help."""
    groups = {g.name for g in app.registered_groups}
    commands = {c.name for c in app.registered_commands}
    for mod, attr, name in SUBAPPS:
        if name not in groups:
            app.add_typer(getattr(importlib.import_module(mod), attr), name=name)
    for mod, attr, name in COMMANDS:
        if name in commands:
            continue
        try:
            app.command(name)(getattr(importlib.import_module(mod), attr))
        except ModuleNotFoundError as e:  # a stage still being built
            if not e.name or not e.name.startswith("draftsmith"):
                raise
    whole_short_help(app)


def whole_short_help(group: typer.Typer) -> None:
    """Each command's line in its group's list: its help's first paragraph whole, wrapped
    (click cut it to fit one line, mid-word: `Compare drafters: architecture, parameters
    by...`); every command and group helped by `_Formatter` (no flag cut at a hyphen)."""
    for info in group.registered_commands:
        if info.cls in (None, typer.core.TyperCommand):  # typer's own: not a command's choice
            info.cls = PlainCommand
        if info.short_help is None:
            info.short_help = first_paragraph(info.help or inspect.getdoc(info.callback))
    for sub in group.registered_groups:
        helps = (sub.help, sub.typer_instance.info.help)
        text = next((h for h in helps if isinstance(h, str)), None)
        if not isinstance(sub.short_help, str) and text:
            sub.short_help = first_paragraph(text)
        if not isinstance(sub.cls, type) or sub.cls is typer.core.TyperGroup:
            sub.cls = PlainGroup
        whole_short_help(sub.typer_instance)


def first_paragraph(text: str | None) -> str | None:
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split()) if text else None


def dtype_of(name: str):
    import torch

    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise DraftsmithError(f"--dtype {name}: use auto, float32, bfloat16 or float16 (fp32, "
                              "bf16, fp16 for short)")
    return table[name]


def pick_device(device: str | None) -> str:
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = device.partition(":")
    # torch takes meta, mps, cpu:1 ... too: they failed deep in a run (a traceback), and cpu:1
    # was taken for a GPU (bfloat16 by --dtype auto)
    # the index as torch reads it: ASCII digits, no leading zero (`cuda:01` it refuses late)
    if device != "cpu" and (kind != "cuda" or colon and not re.fullmatch(r"0|[1-9][0-9]*",
                                                                          index)):
        raise DraftsmithError(f"--device {device}: use cpu, cuda, cuda:N or auto")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"--device {device}: no CUDA device is available")
    if index and int(index) >= (n := torch.cuda.device_count()):
        raise DraftsmithError(f"--device {device}: this host has {n} CUDA device(s), cuda:0 to "
                              f"cuda:{n - 1}")
    return device


def dtype_name(dev: str, dtype: str) -> str:
    """--dtype with `auto` resolved (float32 on CPU, bfloat16 on a GPU), checked."""
    name = ("float32" if dev == "cpu" else "bfloat16") if dtype == "auto" else dtype
    dtype_of(name)
    return name


def device_dtype(device: str, dtype: str) -> tuple[str, Any]:
    """--device and --dtype resolved: (device, torch dtype)."""
    dev = pick_device(device)
    return dev, dtype_of(dtype_name(dev, dtype))


def greedy_flags(params: SamplingParams, seed: bool = False) -> None:
    """Refuse --top-k / --top-p, and --seed where given (`seed`), at temperature 0, where
    decoding is greedy and they do nothing (the record would name a top-k no token was drawn
    with). The one rule of every command that samples: generate, bench, tune."""
    if not params.greedy:
        return
    if params.top_k or params.top_p < 1:
        raise DraftsmithError("--top-k and --top-p apply to sampling: give --temperature > 0 "
                              "with them (at temperature 0 decoding is greedy)")
    if seed:
        raise DraftsmithError("--seed applies to sampling: give --temperature > 0 with it (at "
                              "temperature 0 decoding is greedy)")


def sampling_params(temperature: float, top_p: float, top_k: int,
                    seed: bool = False) -> SamplingParams:
    """--temperature, --top-p and --top-k as one setting, a bad value refused by its flag (not
    by SamplingParams' field name), and --top-k/--top-p (and --seed, where `seed` says the user
    gave it) at temperature 0 (`greedy_flags`)."""
    from draftsmith.engine.params import SamplingParams

    check_sampling(temperature, top_p, top_k)
    params = SamplingParams(temperature, top_p, top_k)
    greedy_flags(params, seed)
    return params


@targets_app.command("show")
def targets_show(
    path: str = typer.Argument("default", help="HF folder, .gguf file, or 'default'"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table"),
) -> None:
    """Print what a target is: architecture, sizes, tokenizer and fingerprint."""
    from draftsmith.layers import default_aux_layers, to_convention
    from draftsmith.targets import load_target

    t = load_target(path)
    info = t.describe()
    ids = default_aux_layers(t.cfg.num_layers)
    info["default_aux_layers (canonical: output of layer j)"] = ids
    info["same ids for vLLM/speculators (input of layer j)"] = to_convention(
        ids, "vllm", t.cfg.num_layers
    )
    if as_json:
        print(json.dumps(info, indent=1))
        return
    table = Table(title="target", show_header=False)
    for k, v in info.items():  # Text: a source path's `[v2]` read as markup was dropped
        table.add_row(k, Text(str(v)))
    Console().print(table)  # the terminal's width now (COLUMNS included), not at import


@app.command()
def generate(
    prompt: list[str] = typer.Option(None, "--prompt", "-p", metavar="<text>",
                                     help="A user message (repeatable)"),
    prompts_file: Path = typer.Option(None, "--prompts", help="A prompt file (JSONL, JSON, "
                                      "Parquet, .txt: one a line), a datasets folder or "
                                      "humaneval: each conversation's first turn, its system "
                                      "prompt kept"),
    target: str = TARGET,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n",
                                       help="New tokens per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", help="With --temperature: nucleus sampling"),
    top_k: int = typer.Option(0, "--top-k", help="With --temperature: the k likeliest only"),
    device: str = DEVICE,
    dtype: str = DTYPE,
    batch_size: int = typer.Option(16, "--batch-size", help="Prompts decoded together"),
    seed: int | None = typer.Option(None, help="With --temperature: seeds the sampling "
                                                "(default 0)"),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel processes (torchrun or spawned)"),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per completion"),
    drafter: Path = typer.Option(None, "--drafter", help="A draftsmith drafter folder: "
                                 "speculative decoding (greedy: the same text as without it; "
                                 "sampled with --temperature too) and its accept length"),
    steps: int = typer.Option(3, "--steps", help="With --drafter: draft steps per cycle"),
    topk: int = typer.Option(1, "--topk", help="With --drafter: 1 = chain; > 1 = EAGLE-2 tree"),
    num_draft_tokens: int = typer.Option(None, "--num-draft-tokens",
                                         help="With --drafter: tokens verified per cycle (tree; "
                                              "chain: steps+1)"),
) -> None:
    """Complete prompts with the target's chat template (greedy by default; speculative with
    --drafter)."""
    from draftsmith.dist import launch_tp
    from draftsmith.tune.tp_targets import refuse_split

    if max_new_tokens < 1 or batch_size < 1:
        raise DraftsmithError(f"--max-new-tokens and --batch-size must be >= 1, got "
                              f"{max_new_tokens} and {batch_size}")
    spec = _drafting(drafter, given(generate, steps=steps, topk=topk,
                                    num_draft_tokens=num_draft_tokens), steps, topk,
                     num_draft_tokens)
    if any(not x.strip() for x in prompt or []):  # as a prompts file's empty message is
        raise DraftsmithError("--prompt: an empty user message; give the text to complete")
    asks = [[{"role": "user", "content": x}] for x in prompt or []]
    asks += _read_prompts(prompts_file) if prompts_file else []
    if not asks:
        raise DraftsmithError(f"--prompts {prompts_file}: no prompt with a user turn in it"
                              if prompts_file else "give --prompt TEXT or --prompts FILE.jsonl")
    params = sampling_params(temperature, top_p, top_k, seed is not None)
    check_seed(seed)
    dev = pick_device(device)
    dt = dtype_name(dev, dtype)
    refuse_split(target, tp)
    done = launch_tp(
        _generate_rank, tp, asks, target, max_new_tokens, params, dt, batch_size, seed or 0,
        spec, device=dev,
    )
    if done is None:  # a torchrun rank other than 0, which prints nothing
        return
    for text, out, n in done["completions"]:
        if as_json:
            print(json.dumps({"prompt": text, "completion": out, "tokens": n}))
        else:  # Text, not markup: a completion's `a[i]` was dropped, its `[/INST]` a traceback
            console.print(Text(f"> {text}", style="bold"), soft_wrap=True)
            console.print(Text(out), soft_wrap=True)
            console.print()
    for line in done["notes"]:
        print(f"draftsmith generate: {line}", file=sys.stderr)


def _drafting(drafter: Path | None, flags: list[str], steps: int, topk: int,
              tokens: int | None) -> tuple[str, int, int, int | None] | None:
    """The speculative setting (drafter folder, steps, topk, tokens) or None, refused by flag
    before the target loads, as serve refuses it."""
    from draftsmith.bench.run import check_topk
    from draftsmith.models.eagle3 import check_drafter
    from draftsmith.serve.cli import check_drafting

    if drafter is None:
        unused(flags, "with --drafter", "give --drafter DIR with {it}, or leave {it} out")
        return None
    at_least_one({"--steps": steps, "--topk": topk})
    check_drafting(steps, topk, tokens)
    cfg = check_drafter(drafter)  # a mistyped or damaged folder, before the target's minutes
    check_topk([(steps, topk, tokens or steps + 1)], cfg.draft_vocab_size)
    return str(drafter), steps, topk, tokens


def _generate_rank(tp, asks, target, new, params, dt, batch_size, seed, spec=None):
    """One rank's generation: every rank runs it, rank 0's result is printed (under torchrun
    every process prints what it returns: the others return None). asks: each prompt's
    messages (its system prompts, then its user message); spec: `_drafting`'s setting."""
    import os

    import torch

    from draftsmith.bench.suites import prompt_ids
    from draftsmith.engine.generate import check_positions, run_generation
    from draftsmith.targets import load_target

    torch.manual_seed(seed)
    t = load_target(target)
    ids = prompt_ids(t, asks, "generate")
    check_positions(ids, new, t.cfg.max_position_embeddings, "--max-new-tokens",
                    t.cfg.sliding_window)
    model = t.build(dtype_of(dt), str(tp.device), tp)
    batches = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    notes: list[str] = []
    if spec is None:
        rt = _plain_runtime(model, batches, new)
        tokens = [toks for b in batches for toks in run_generation(rt, b, new, params,
                                                                      t.eos_ids).tokens]
    else:
        tokens = _speculative(t, model, tp, spec, batches, new, params, notes)
    done = [(ask[-1]["content"], t.tokenizer.decode(toks, skip_special_tokens=True), len(toks))
            for ask, toks in zip(asks, tokens, strict=True)]
    rank0 = os.environ.get("RANK", "0") == "0" and tp.rank == 0
    return {"completions": done, "notes": notes} if rank0 else None


def _plain_runtime(model, batches: list[list[list[int]]], new: int):
    """One runtime for every batch (a runtime a batch allocated its cache and, on a GPU,
    captured its decode graph again each time), sized to the widest batch and longest prompt
    by the engine's own rule: its widest batch of its longest prompt."""
    from draftsmith.engine.generate import _runtime_for

    longest = max((p for b in batches for p in b), key=len)
    return _runtime_for(model, [longest] * max(len(b) for b in batches), new)


def _speculative(t, model, tp, spec, batches, new, params, notes: list[str]) -> list[list[int]]:
    """Every batch decoded by one SpecDecoder sized to the longest prompt + `new`; the mean
    accept length (and a drafter made for another target) said in `notes`."""
    from draftsmith.engine.spec_state import SpecResult
    from draftsmith.engine.speculative import SpecDecoder, check_pair, other_target
    from draftsmith.models.eagle3 import load_drafter

    folder, steps, topk, tokens = spec
    # under TP the target's embedding is sharded: the drafter takes the whole one (as tune's)
    embed = model.embed.weight if tp.size == 1 else t.weights.get("model.embed_tokens.weight")
    drafter = load_drafter(folder, model.embed.weight.device, model.embed.weight.dtype,
                           embed=embed).eval()
    check_pair(model.cfg, drafter.cfg)
    if other := other_target(drafter.cfg, t.fingerprint):
        notes.append(f"warning: {other}: the text is the target's, acceptance may be low")
    verify = steps + 1 if topk == 1 else tokens
    room = max(len(p) for b in batches for p in b) + new + 2 * steps + 2
    dec = SpecDecoder(model, drafter, steps, topk, None if topk == 1 else tokens, params,
                      profile=False, max_batch=len(batches[0]),
                      max_seq=room + (0 if topk == 1 else verify))
    results = [dec.generate(b, new, t.eos_ids) for b in batches]
    merged = SpecResult.merged(results)
    length = merged.measured_accept_length
    shape = f"chain of {steps}" if topk == 1 else f"tree {steps}/{topk}/{tokens}"
    notes.append(f"speculative ({shape}): accept length "
                 + (f"{length:.2f} tokens per target pass" if length is not None
                    else "- (no cycle ran)"))
    return merged.tokens


def _read_prompts(path: Path) -> list[list[dict[str, str]]]:
    """Each conversation's first turn, its system prompts kept (as `data regenerate` asks)."""
    from draftsmith.data.prompts import opening, read_prompts

    return [opening(c.messages) for c in read_prompts(path, flag="--prompts")]


def one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, line: str | None = None) -> str:
    """A warning as the CLI shows it: one line like its errors, not Python's file:line and
    source line (which pointed users at draftsmith's code)."""
    return f"draftsmith: warning: {message}\n"


def main() -> None:
    # formatwarning, not showwarning: recorded warnings (pytest's, a caller's catch_warnings)
    # stay recorded, and a command's own showwarning (train's) still wins
    previous, warnings.formatwarning = warnings.formatwarning, one_line_warning
    try:
        _register()  # imports the engine, whose switches are read (and refused) at import
        app()
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before a command runs (the engine's imports); typer's own: 130
        print("draftsmith: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        warnings.formatwarning = previous


if __name__ == "__main__":
    main()
