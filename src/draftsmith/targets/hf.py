"""Read a Hugging Face checkpoint folder: config.json + safetensors (sharded or not)."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_json


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    cfg = read_json(path, "not a Hugging Face checkpoint folder")
    if not isinstance(cfg, dict):
        raise DraftsmithError(f"{path} holds a {type(cfg).__name__}, not an object of settings")
    return cfg


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = _weight_files(folder)
    if not files:
        raise DraftsmithError(f"{folder}: no *.safetensors weight files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftsmithError(f"{f}: cannot read safetensors file ({e})") from None
    return out


def _weight_files(folder: Path) -> list[Path]:
    """The shards the index names where there is one: Mistral's folders also hold the same
    weights as consolidated.safetensors, which would double the memory a load takes."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    meta = read_json(index, "")
    weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
    if not isinstance(weight_map, dict):
        raise DraftsmithError(f"{index}: no weight_map object")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    if missing := [f.name for f in files if not f.is_file()]:
        raise DraftsmithError(f"{index} names weight files that are missing: {missing}")
    return files
