"""Read a Hugging Face checkpoint folder: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise DraftsmithError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}: not valid JSON ({e})") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{folder}: no *.safetensors weight files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftsmithError(f"{f}: cannot read safetensors file ({e})") from None
    return out
