"""Read a Hugging Face checkpoint folder: config.json + safetensors (sharded or not)."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_json


def read_config(folder: Path) -> dict:
    return read_json(Path(folder) / "config.json", "not a Hugging Face checkpoint folder")


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
