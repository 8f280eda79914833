"""Command-line options that several commands share, declared once."""

from __future__ import annotations

import typer

TARGET = typer.Option("default", "--target", help="HF folder, .gguf file, or 'default'")
DEVICE = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto")
DTYPE = typer.Option("auto", "--dtype", help="float32, bfloat16 or auto (bf16 on GPU)")
COMPILE = typer.Option(False, "--compile", help="torch.compile the target's layers (GPU; faster "
                       "decode after a one-off compile)")
