"""Read a Hugging Face checkpoint folder: config.json + safetensors (sharded or not), or
PyTorch .bin weights where a folder holds no safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_json
from draftsmith.weightsfile import read_weights_file


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    cfg = read_json(path, "not a Hugging Face checkpoint folder")
    if not isinstance(cfg, dict):
        raise DraftsmithError(f"{path} holds a {type(cfg).__name__}, not an object of settings")
    return cfg


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = weight_files(folder)
    if not files:
        raise DraftsmithError(f"{folder}: no *.safetensors (or pytorch_model*.bin) weight files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(read_weights_file(f))
    return out


def weight_files(folder: Path) -> list[Path]:
    """The shards the index names where there is one: Mistral's folders also hold the same
    weights as consolidated.safetensors, which would double the memory a load takes. Older
    checkpoints hold only PyTorch pickles (pytorch_model*.bin; not training_args.bin)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return _indexed(folder, index)
    if found := sorted(folder.glob("*.safetensors")):
        return found
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return _indexed(folder, index)
    return sorted(folder.glob("pytorch_model*.bin"))


def _indexed(folder: Path, index: Path) -> list[Path]:
    meta = read_json(index, "")
    weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
    if not isinstance(weight_map, dict):
        raise DraftsmithError(f"{index}: no weight_map object")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    if missing := [f.name for f in files if not f.is_file()]:
        raise DraftsmithError(f"{index} names weight files that are missing: {missing}")
    return files


def generation_eos(folder: Path) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list; none without the file), the ids
    HF's generate stops at: Llama 3's lists <|eot_id|>, which its config.json may not."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return []
    meta = read_json(path, "")
    eos = meta.get("eos_token_id") if isinstance(meta, dict) else None
    ids = [eos] if isinstance(eos, int) else eos or []
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise DraftsmithError(f"{path}: eos_token_id is {eos!r}, expected a token id or a list "
                              "of them")
    return ids
