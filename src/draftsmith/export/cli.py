"""`draftsmith export` and `draftsmith import`: thin typer layers over `draftsmith.export`."""

from __future__ import annotations

import json
import shlex
import sys
import warnings

import typer

from draftsmith.errors import DraftsmithError
from draftsmith.tune.flags import UNNAMED, launch_command

DTYPES = {"keep": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
          "float16": "float16", "fp32": "float32", "float32": "float32"}
SPELLED = "keep, bfloat16 (bf16), float16 (fp16) or float32 (fp32)"  # as the other commands'


def export(
    drafter: str = typer.Argument(..., help="A draftsmith drafter folder (from `train`)"),
    fmt: str = typer.Option(..., "--format", "-f", help="sglang or speculators (vLLM)"),
    out: str = typer.Option(..., "--out", "-o", help="Folder to write"),
    target: str = typer.Option(None, "--target", help="The target (layer count, max positions, "
                               "verifier path); default: what the drafter recorded"),
    dtype: str = typer.Option("keep", "--dtype", help=f"{SPELLED} (keep: as saved)"),
    speculative_tokens: int = typer.Option(3, "--speculative-tokens",
                                           help="speculators: default draft length"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out"),
) -> None:
    """Write a drafter in SGLang's or speculators' (vLLM) layout, aux ids in the engine's form."""
    import torch

    from draftsmith.export import export_served
    from draftsmith.export.speculators import VllmNote

    if dtype not in DTYPES:
        raise DraftsmithError(f"--dtype {dtype!r}: use one of {SPELLED}")
    dt = None if DTYPES[dtype] is None else getattr(torch, DTYPES[dtype])
    with warnings.catch_warnings():  # the hint below says them, once
        warnings.simplefilter("ignore", VllmNote)
        path, served = export_served(drafter, fmt, out, target, dt, speculative_tokens,
                                     overwrite)
    config = json.loads((path / "config.json").read_text())
    print(f"wrote {fmt} drafter to {path}", file=sys.stderr)
    # engines run elsewhere
    print(_serve_hint(fmt, path.resolve(), config, speculative_tokens, served))


def _serve_hint(fmt: str, path, config: dict, k: int, target: str = "") -> str:
    """The aux ids as written, the engine's speculative flags, and the whole launch command
    with `target` (the HF folder the engine serves; for speculators its verifier by default)."""
    from draftsmith.export.speculators import vllm_notes

    ds, q = config.get("draftsmith", {}), shlex.quote
    ids = ds.get("aux_layer_ids_canonical")
    if fmt == "sglang":
        written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        flags = (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {q(str(path))} "
                 f"--speculative-num-steps {k} --speculative-eagle-topk 1 "
                 f"--speculative-num-draft-tokens {k + 1}")
        return (f"aux layers: canonical {ids} written for SGLang as {written}\nSGLang: {flags}\n"
                f"SGLang command: {launch_command('sglang', target, flags)}{_unnamed(target)}")
    target = target or config.get("speculators_config", {}).get("verifier", {}).get(
        "name_or_path", "")
    spec = q(json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": k}))
    written = config["eagle_aux_hidden_state_layer_ids"]
    hint = (f"aux layers: canonical {ids} written for vLLM/speculators as {written}\n"
            f"vLLM: --speculative-config {spec}\nvLLM command: "
            f"{launch_command('vllm', target, f'--speculative-config {spec}')}{_unnamed(target)}")
    return hint + "".join(f"\nwarning: {line}" for line in vllm_notes(config))


def _unnamed(target: str) -> str:
    return "" if target else (f"\n{UNNAMED}: the drafter records no target; put the target "
                              "model's folder there (the one it was trained for)")


def import_(
    src: str = typer.Argument(..., help="An SGLang/SpecForge/EAGLE or speculators EAGLE-3 folder"),
    out: str = typer.Option(..., "--out", "-o", help="Draftsmith drafter folder to write"),
    target: str = typer.Option(None, "--target", help="The target: its layer count reads the aux "
                               "ids, its embedding fills a checkpoint without one"),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace the draftsmith drafter already in --out"),
) -> None:
    """Read an external EAGLE-3 drafter into the draftsmith layout (ids made canonical)."""
    from draftsmith.export import detect_format, import_drafter
    from draftsmith.models.eagle3 import read_drafter_meta

    fmt = detect_format(src)
    path = import_drafter(src, out, target, overwrite)
    cfg = read_drafter_meta(path)["config"]
    print(f"imported {fmt} drafter {src} to {path}: aux layers {cfg['aux_layer_ids']} "
          f"({cfg['aux_convention']}), draft vocab {cfg['draft_vocab_size']}", file=sys.stderr)
