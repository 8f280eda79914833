"""A drafter folder as the doctor sees it: draftsmith layout, SGLang/SpecForge or speculators.

Only the config is parsed here (sizes, and the ids exactly as each key holds them); what an
engine makes of those ids is `engines`' job, every conversion `layers`'.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.layers import validate
from draftsmith.targets.hf import read_config

IDS = "eagle_aux_hidden_state_layer_ids"
LAYOUTS = ("draftsmith", "sglang", "speculators")
SECTIONS = ("eagle_config", "draftsmith", "speculators_config", "transformer_layer_config")


@dataclass
class DrafterInfo:
    folder: Path
    layout: str
    config: dict[str, Any]  # draftsmith: Eagle3Config dict; else config.json
    meta: dict[str, Any] = field(default_factory=dict)  # draftsmith.json, when present
    _pickles: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    # ---- sizes, whatever the layout -----------------------------------------------------------

    def layer_config(self) -> dict[str, Any]:
        if self.layout == "speculators":
            return dict(self.config.get("transformer_layer_config") or {})
        return self.config

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if self.layout == "draftsmith":
            return default
        aliases = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                   "num_layers": "num_hidden_layers"}
        value = self.layer_config().get(aliases.get(key, key))
        return default if value is None else value

    def size(self, key: str) -> int | None:
        """A size the config holds, None where it holds none; one error naming the file and
        key where it is no positive whole number (the engines would fail on it)."""
        v = self.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
            raise DraftsmithError(f"{self.config_path}: {key} is {v!r}, not a positive whole "
                                  "number; set it to the drafter's size")
        return int(v)

    @property
    def config_path(self) -> Path:
        return self.folder / ("draftsmith.json" if self.layout == "draftsmith" else "config.json")

    @property
    def hidden_size(self) -> int:
        return int(self.size("hidden_size") or 0)

    @property
    def target_hidden_size(self) -> int:
        return self.size("target_hidden_size") or self.hidden_size

    @property
    def vocab_size(self) -> int:
        return int(self.size("vocab_size") or 0)

    @property
    def draft_vocab_size(self) -> int:
        if self.layout == "draftsmith":
            return self.size("draft_vocab_size") or self.vocab_size
        from draftsmith.export.layout import draft_vocab_of

        return draft_vocab_of(self.config, self.vocab_size,
                              str(self.folder / "config.json"))

    @property
    def max_position_embeddings(self) -> int | None:
        return self.size("max_position_embeddings")

    # ---- ids as written -----------------------------------------------------------------------

    def recorded(self, key: str) -> Any:
        """What draftsmith recorded about the target (`target_fingerprint`, `target_num_layers`):
        in the config of its own layout, in the `draftsmith` section of an exported one."""
        section = self.config if self.layout == "draftsmith" else self.config.get("draftsmith")
        return (section or {}).get(key)

    def canonical_ids(self) -> list[int] | None:
        """draftsmith layout only: its ids are canonical by construction."""
        if self.layout != "draftsmith":
            return None
        return list(self.config.get("aux_layer_ids") or [])

    def exported_ids(self, num_layers: int) -> list[int] | None:
        """An exported folder's canonical ids as `draftsmith export` recorded them: the layers
        the drafter was trained on, whatever an edit to the engines' keys says since."""
        ids = self.recorded("aux_layer_ids_canonical") if self.layout != "draftsmith" else None
        if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
            return None
        try:
            return validate(ids, num_layers)
        except DraftsmithError:  # of another target: the sizes and target checks say so
            return None

    def written(self, engine: str) -> tuple[list[int] | None, str, str]:
        """(ids at the key `engine` reads or None, that key, what the engine does if missing);
        vLLM's ids are None when empty too, as vLLM reads them."""
        nested = (self.config.get("eagle_config") or {}).get(IDS)
        top = self.config.get(IDS)
        name = "config.json" if self.layout != "draftsmith" else "draftsmith.json"
        if engine == "draftsmith":
            return self.canonical_ids(), "config.aux_layer_ids in draftsmith.json", ""
        if engine.startswith("sglang"):
            note = ""
            if nested is None:
                note = ("SGLang reads only eagle_config." + IDS + "; "
                        + ("a top-level key is ignored and " if top is not None else "")
                        + "it silently uses its defaults")
            return _ints(nested), f"eagle_config.{IDS} in {name}", note
        if self.layout == "speculators" and not top and (inner := self._inner_ids()):
            return inner
        note = ""
        if not top:  # vLLM tests the list for truth: an empty one is as good as none
            what = "is an empty list, which vLLM treats as missing" if top == [] else "is missing"
            note = (f"the top-level {IDS}, the key vLLM reads, {what}: "
                    + ("some versions fall back to eagle_config, others silently use" if nested
                       else "vLLM silently uses")
                    + " the target's defaults (vLLM issue 50170)")
        return _ints(top or None), f"{IDS} (top level) in {name}", note

    def _inner_ids(self) -> tuple[list[int], str, str] | None:
        """A speculators config's ids inside transformer_layer_config, vLLM's draft config, at
        their full key path, where the top level holds none (`export.layout.speculators_lists`,
        vLLM's order, as import reads them); speculators itself reads the top level only."""
        from draftsmith.export.layout import speculators_lists

        for key, ids, _ in speculators_lists(self.config)[1:]:
            if ids:
                return list(ids), f"{key} in config.json", (
                    f"vLLM reads the ids at {key} (its draft config), but speculators reads "
                    f"only the top level and takes its defaults there; move the list to {IDS} "
                    "at the top level, where every reader takes it")
        return None

    # ---- tensors ------------------------------------------------------------------------------

    def weight_files(self) -> list[Path]:
        """The files `draftsmith import` reads (safetensors, by its index where there is one,
        else PyTorch .bin)."""
        from draftsmith.export.layout import weight_files

        return weight_files(self.folder)

    def tensor(self, name: str) -> torch.Tensor | None:
        for tensors in self._each_file():
            for key in (name, "model." + name):
                if key in tensors:
                    return tensors[key]
        return None

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name (without a `model.` prefix) -> (shape, safetensors dtype code)."""
        out = {}
        for tensors in self._each_file():
            for k in tensors.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                shape, dtype = _shape(tensors, k)
                out[k.removeprefix("model.")] = (shape, dtype)
        return out

    def fc_inputs(self) -> int | None:
        """How many aux states fc.weight reads (None without one): its width, which no id
        written in a config changes."""
        fc = self.shapes().get("fc.weight")
        return None if fc is None else fc[0][1] // max(1, self.target_hidden_size)

    def _each_file(self) -> Iterator[Any]:
        """Each weights file as a mapping of its tensors: a safetensors file opened lazily (its
        header alone for shapes), a PyTorch pickle loaded once and kept."""
        from safetensors import safe_open

        from draftsmith.weightsfile import read_weights_file

        for f in self.weight_files():
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as h:
                    yield _Lazy(h)
            else:
                if f not in self._pickles:
                    self._pickles[f] = read_weights_file(f)
                yield self._pickles[f]


class _Lazy:
    """A safetensors handle read as a mapping (`in`, `[]`, `keys`)."""

    def __init__(self, h: Any) -> None:
        self.h, self.names = h, set(h.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.names

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.h.get_tensor(key)

    def keys(self) -> list[str]:
        return list(self.h.keys())


def _shape(tensors: Any, key: str) -> tuple[tuple[int, ...], str]:
    from draftsmith.data.shards import SAFETENSORS_DTYPES

    if isinstance(tensors, _Lazy):
        sl = tensors.h.get_slice(key)
        return tuple(sl.get_shape()), str(sl.get_dtype())
    t = tensors[key]
    name = str(t.dtype).removeprefix("torch.")
    code = {v: k for k, v in SAFETENSORS_DTYPES.items()}.get(name, name)
    return tuple(t.shape), code


def _ints(v: Any) -> list[int] | None:
    return None if v is None else list(v)


def read_drafter(folder: str | Path) -> DrafterInfo:
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"{folder}: no such drafter folder")
    from draftsmith.export import detect_format

    _refuse_other_folder(folder)
    layout = detect_format(folder)
    if layout == "draftsmith":
        from draftsmith.models.eagle3 import read_drafter_meta

        meta = read_drafter_meta(folder)
        if "config" not in meta:
            raise DraftsmithError(f"{folder / 'draftsmith.json'}: no 'config' section")
        info = DrafterInfo(folder, layout, dict(meta["config"]), meta)
    else:
        info = DrafterInfo(folder, layout, read_config(folder))
    if not info.weight_files():
        raise DraftsmithError(f"{folder}: no *.safetensors (or pytorch_model*.bin) weight file")
    _require(info)
    return info


def _refuse_other_folder(folder: Path) -> None:
    """A folder holding neither draftsmith.json nor config.json named as what it is where it is
    draftsmith's own (a dataset, a training run stopped at a checkpoint): "no config.json (not
    a Hugging Face checkpoint folder)" named no way on."""
    from draftsmith.data.shards import MANIFEST
    from draftsmith.models.eagle3 import CONFIG_FILE
    from draftsmith.train.checkpoint import stopped_at

    if (folder / CONFIG_FILE).is_file() or (folder / "config.json").is_file():
        return
    if (latest := stopped_at(folder)) is not None:
        raise DraftsmithError(
            f"{folder}: a training run stopped at {latest.name}, with no final drafter yet; "
            f"pass its checkpoint {latest} as the drafter, or finish that run first (its train "
            "command with --resume)")
    if (folder / MANIFEST).is_file():
        raise DraftsmithError(f"{folder}: a dataset folder ({MANIFEST}), not a drafter; pass "
                              "the drafter trained on it (`draftsmith doctor` takes a dataset "
                              "as --data)")


def read_checked(folder: str | Path) -> DrafterInfo:
    """`read_drafter`, a draftsmith folder then checked whole as generate and bench check their
    --drafter (`eagle3.check_drafter`: every config value, the weights' header), so the doctor
    and compare refuse it in one line before a target's minutes of loading, not after. An
    engine's folder is read as `read_drafter` reads it, its safetensors headers read too."""
    from draftsmith.models.eagle3 import check_drafter, check_weights_header

    info = read_drafter(folder)
    if info.layout == "draftsmith":
        check_drafter(info.folder)  # its weights' header too
        return info
    for path in info.weight_files():  # a cut one was a traceback after the target loaded
        if path.suffix == ".safetensors":
            check_weights_header(path)
    return info


def _require(info: DrafterInfo) -> None:
    where = info.folder / ("draftsmith.json" if info.layout == "draftsmith" else "config.json")
    for key in SECTIONS:
        if info.config.get(key) is not None and not isinstance(info.config[key], dict):
            raise DraftsmithError(f"{where}: {key} is not a JSON object")
    missing = [k for k in ("hidden_size", "vocab_size") if info.get(k) is None]
    if missing:
        raise DraftsmithError(f"{where}: missing {missing}")
    sized = ("hidden_size", "vocab_size", "target_hidden_size", "max_position_embeddings",
             *(("draft_vocab_size",) if info.layout == "draftsmith" else ()))
    for key in sized:
        info.size(key)  # each named here, before a check reads it
    nested = (info.config.get("eagle_config") or {}).get(IDS)
    lists = [("aux_layer_ids", info.config.get("aux_layer_ids")), (IDS, info.config.get(IDS)),
             (f"eagle_config.{IDS}", nested)]
    from draftsmith.export.layout import check_id_list, speculators_lists

    if info.layout == "speculators":  # vLLM's inner lists, which the doctor reads too
        lists += [(key, ids) for key, ids, _ in speculators_lists(info.config)[1:]]
    for key, ids in lists:
        check_id_list(where, key, ids)


def load_noted(info: DrafterInfo, target: Any, device: str,
               dtype: torch.dtype) -> tuple[Any, list[Any]]:
    """`load_any`, and what `draftsmith import`'s reading warned (`ImportNote`s: a replaced
    embedding, unsorted ids, defaults that repeat a layer) for the caller's report; any other
    warning goes on as it was raised."""
    import warnings

    from draftsmith.export.layout import ImportNote

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter = load_any(info, target, device, dtype)
    notes = []
    for w in caught:
        if isinstance(w.message, ImportNote):
            notes.append(w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return drafter, notes


def load_any(info: DrafterInfo, target: Any, device: str, dtype: torch.dtype) -> Any:
    """Any layout -> Eagle3Drafter on `device`; the target supplies the embedding."""
    from draftsmith.export.layout import TargetInfo
    from draftsmith.export.sglang import read_sglang
    from draftsmith.export.speculators import read_speculators
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.train.sources import target_head

    if info.layout == "draftsmith":
        return load_drafter(info.folder, device, dtype, embed=target_head(target)[0])
    read = read_sglang if info.layout == "sglang" else read_speculators
    return read(info.folder, TargetInfo.of_target(target)).to(device, dtype)
