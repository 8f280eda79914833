"""`draftsmith train`: a thin typer layer over `draftsmith.train.train`."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import typer

from draftsmith.layers import CANONICAL_WORDS, parse_ids
from draftsmith.models.eagle3 import CONFIG_FILE
from draftsmith.options import check_seed, command_line
from draftsmith.train.checkpoint import latest_checkpoint


def train(
    out: str = typer.Option(..., "--out", "-o", help="Folder for the drafter, log, checkpoints"),
    data: str = typer.Option(None, "--data", help="Dataset folder: `data make`'s OUT/dataset or "
                             "`data capture`'s --out (offline)"),
    prompts: str = typer.Option(None, "--prompts", help="Conversations with answers (JSONL, ...): "
                                "the target makes hidden states on the fly (online)"),
    target: str = typer.Option(None, "--target", help="HF folder, .gguf or 'default' (offline: "
                               "the dataset's target)"),
    ttt_steps: int = typer.Option(7, "--ttt-steps", help="Unrolled training-time-test steps"),
    step_decay: float = typer.Option(0.8, "--step-decay", help="Loss weight of step j: decay^j"),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW)"),
    min_lr: float = typer.Option(0.0, "--min-lr", help="Floor of the cosine schedule"),
    warmup_ratio: float = typer.Option(0.02, "--warmup-ratio",
                                       help="Share of the steps warming the learning rate up"),
    warmup_steps: int = typer.Option(None, "--warmup-steps", help="Overrides --warmup-ratio"),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay"),
    grad_clip: float = typer.Option(0.5, "--grad-clip", help="Gradient norm clipped to this"),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the data"),
    max_steps: int = typer.Option(None, "--max-steps", help="Train exactly this many steps "
                                  "(instead of --epochs; past them the data repeats)"),
    batch_size: int = typer.Option(1, "--batch-size", help="Packed rows per step and rank"),
    max_len: int = typer.Option(2048, "--max-len", help="Tokens per packed row"),
    draft_vocab_size: int = typer.Option(None, "--draft-vocab-size", help="Draft vocab "
                                         "(default 32000; with --vocab: the file's, no larger; "
                                         "with --init-from: that drafter's)"),
    vocab: str = typer.Option(None, "--vocab", help="A vocab.safetensors (d2t, t2d) to use"),
    aux_layers: str = typer.Option(None, "--aux-layers", help="Online: comma-separated ids, "
                                   f"canonical ({CANONICAL_WORDS})"),
    num_layers: int = typer.Option(None, "--num-layers", help="Drafter decoder layers (default "
                                   "1, or with --init-from that drafter's; more deepens it)"),
    intermediate_size: int = typer.Option(None, "--intermediate-size", help="Drafter MLP width "
                                          "(default the target's, or with --init-from that "
                                          "drafter's; wider widens it)"),
    norm_before_residual: bool = typer.Option(False, "--norm-before-residual",
                                              help="The layer's residual is the normed hidden"),
    norm_before_fc: bool = typer.Option(False, "--norm-before-fc",
                                        help="One RMSNorm over the joined aux states before fc"),
    fc_norm: bool = typer.Option(False, "--fc-norm",
                                 help="An RMSNorm per aux state before fc"),
    norm_output: bool = typer.Option(False, "--norm-output", help="Feed the normed hidden back "
                                     "to the next step (a vLLM before PR #46488 ignores it)"),
    init_head: str = typer.Option("random", "--init-head", help="random, or target: start the "
                                  "draft lm_head and final norm from the target's"),
    init_from: str = typer.Option(None, "--init-from", help="Start from this drafter's weights "
                                  "(a fresh optimizer and schedule): more epochs or more data"),
    max_samples: int = typer.Option(None, "--max-samples", help="Use the first N samples"),
    seed: int = typer.Option(0, "--seed", help="Seeds the weights and the data order"),
    save_every: int = typer.Option(500, "--save-every", help="Checkpoint every N steps"),
    keep_last: int = typer.Option(3, "--keep-last", help="Checkpoints kept"),
    log_every: int = typer.Option(10, "--log-every", help="Steps per train_log.jsonl row"),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto (torchrun: "
                                "per rank)"),
    loader_workers: int = typer.Option(None, "--loader-workers",
                                       help="Processes reading batches ahead (default: auto)"),
    bf16: bool = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: on GPU)"),
    verify_shards: bool = typer.Option(True, "--verify-shards/--no-verify-shards",
                                       help="Check the shards' sha256 against the manifest "
                                       "before training (reads the data once; a --resume "
                                       "only the shards changed on disk since)"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint"),
    time_limit: float = typer.Option(None, "--time-limit", help="Seconds (checked every "
                                     "--log-every steps); then stop at a checkpoint (rerun "
                                     "with --resume to continue)"),
    profile_steps: int = typer.Option(0, "--profile-steps", help="Profile that many steps "
                                      "(after 3 warm-up steps): profile.json/.txt in --out"),
    compile_loss: bool = typer.Option(None, "--compile-loss/--no-compile-loss",
                                      help="torch.compile the TTT loss (one fused pass over the "
                                      "draft-vocab logits per step; default: on a GPU)"),
    pad_multiple: int = typer.Option(None, "--pad-multiple", help="Round batch widths up to "
                                     "this (default: 128 on a GPU, 1 on CPU): fewer shapes"),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="A progress bar on a terminal, a line a logged step "
                                       "elsewhere (a log file); --no-progress: no bar, the "
                                       "lines on a terminal too"),
) -> None:
    """Train an EAGLE-3 drafter with training-time test (offline or online; torchrun for DDP)."""
    from draftsmith.train import TrainConfig
    from draftsmith.train import train as run

    check_seed(seed)  # torch's overflow was a traceback after the target and data loaded
    cfg = TrainConfig(
        out=out, data=data, prompts=prompts, target=target, ttt_steps=ttt_steps,
        step_decay=step_decay, lr=lr, min_lr=min_lr, warmup_ratio=warmup_ratio,
        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, epochs=epochs,
        max_steps=max_steps, batch_size=batch_size, max_len=max_len,
        draft_vocab_size=draft_vocab_size, vocab=vocab, aux_layer_ids=parse_ids(aux_layers),
        num_layers=num_layers, intermediate_size=intermediate_size,
        norm_before_residual=norm_before_residual,
        norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output,
        init_head=init_head, init_from=init_from,
        max_samples=max_samples, seed=seed, save_every=save_every, keep_last=keep_last,
        log_every=log_every, device=device, loader_workers=loader_workers, bf16=bf16,
        verify_shards=verify_shards,
        resume=resume, time_limit=time_limit, profile_steps=profile_steps, progress=progress,
        compile_loss=compile_loss, pad_multiple=pad_multiple,
        extra=commands(out, resume),
    )
    with warnings.catch_warnings():
        warnings.showwarning = _say_warning
        run(cfg)


def commands(out: str, resume: bool) -> dict[str, Any]:
    """The run's commands for `draftsmith.json`: "command" this one (the latest), "commands"
    every one since the run began (a --resume's after those of the checkpoint it continues,
    whose record kept only the last)."""
    now = command_line()
    if not resume or (found := latest_checkpoint(Path(out))) is None:
        return {"command": now, "commands": [now]}
    try:
        extra = json.loads((found / CONFIG_FILE).read_text())["training"]["config"]["extra"]
        before = extra.get("commands") or [extra["command"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        before = []  # an unreadable checkpoint: the resume refuses it by name
    return {"command": now, "commands": [*(c for c in before if isinstance(c, str)), now]}


def _say_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, as `data vocab` prints it (not Python's file:line and source)."""
    from tqdm import tqdm

    if os.environ.get("RANK", "0") == "0":  # through tqdm: a line of its own below the bar
        tqdm.write(f"draftsmith train: warning: {message}", file=sys.stderr)
