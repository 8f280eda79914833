"""Read a Hugging Face checkpoint folder: config.json + safetensors (sharded or not), or
PyTorch .bin weights where a folder holds no safetensors."""

from __future__ import annotations

import re
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
    """The files HF's from_pretrained reads: model.safetensors, else the shards its index names
    (Mistral's folders also hold the same weights as consolidated.safetensors, which would double
    the memory a load takes), else pytorch_model.bin or its index's shards, in that order; only
    where none of those four names is there, one unindexed file or one whole set of shards
    (safetensors first, then pytorch_model*.bin; not training_args.bin). A stray safetensors
    file (Mistral's consolidated.safetensors, an adapter) beside HF's .bin files is not read."""
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file() or (folder / f"{single}.index.json").is_file():
            return _pick(folder, single, single)
    return (_pick(folder, "model.safetensors", "*.safetensors")
            or _pick(folder, "pytorch_model.bin", "pytorch_model*.bin"))


_SHARD = re.compile(r"(.+)-\d{5}-of-(\d{5})\.[a-z]+")
_SHARD_NAME = "{}-{:05d}-of-{:05d}{}"  # _SHARD's names, as save_pretrained writes them


def _pick(folder: Path, single: str, pattern: str) -> list[Path]:
    index = folder / f"{single}.index.json"
    if index.is_file():
        files = _indexed(folder, index)
        if (folder / single).is_file() and folder / single not in files:  # HF reads it, vLLM not
            raise DraftsmithError(f"{folder}: holds {single} and {index.name} naming other files, "
                                  "which loaders read differently; remove the one that is stale")
        return files
    if (folder / single).is_file():  # as HF, a consolidated copy or an adapter beside it unread
        return [folder / single]
    found = sorted(folder.glob(pattern))
    if _one_model(found):
        return found
    if missing := _missing_shards(found):  # an interrupted download, its index not yet there
        raise DraftsmithError(f"{folder}: shards {missing} are missing, and no {index.name} "
                              "saying which hold the model; download the checkpoint again")
    raise DraftsmithError(f"{folder}: {[f.name for f in found]} and no {index.name} saying which "
                          "hold the model; keep its files only, or add its index")


def _one_model(files: list[Path]) -> bool:
    """Whether files are one unsharded file, or one whole set of shards (NAME-0000i-of-0000n)
    whose index was left behind."""
    shards = [_SHARD.fullmatch(f.name) for f in files]
    if len(files) <= 1 and not any(shards):
        return True
    return (all(shards) and len({(m.group(1), m.group(2)) for m in shards}) == 1
            and int(shards[0].group(2)) == len(files))


def _missing_shards(files: list[Path]) -> list[str]:
    """The names a set of shards (NAME-0000i-of-0000n, all of one set) lacks; [] for files
    that are no one set."""
    shards = [_SHARD.fullmatch(f.name) for f in files]
    if not files or not all(shards) or len({(m.group(1), m.group(2)) for m in shards}) != 1:
        return []
    n, have = int(shards[0].group(2)), {f.name for f in files}
    names = [_SHARD_NAME.format(shards[0].group(1), i, n, files[0].suffix) for i in range(1, n + 1)]
    return [name for name in names if name not in have]


def _indexed(folder: Path, index: Path) -> list[Path]:
    meta = read_json(index, "")
    weight_map = meta.get("weight_map") if isinstance(meta, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DraftsmithError(f"{index}: no weight_map object of tensor names to file names")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    if missing := [f.name for f in files if not f.is_file()]:
        raise DraftsmithError(f"{index} names weight files that are missing: {missing}; "
                              "download them again (an interrupted download?)")
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
