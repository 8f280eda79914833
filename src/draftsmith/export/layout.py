"""What the engine writers and readers share: target facts, the HF layer config, folder I/O."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.layers import Convention, from_convention
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import Eagle3Config
from draftsmith.options import check_folder
from draftsmith.targets import local_path, served_folder
from draftsmith.targets.hf import (
    read_config,  # noqa: F401 - one reader, re-exported
    weight_files,  # noqa: F401 - one finder, re-exported
)
from draftsmith.targets.hf import read_weights as read_checkpoint

WEIGHTS = "model.safetensors"
IDS = "eagle_aux_hidden_state_layer_ids"
TMP_FILES = frozenset({WEIGHTS, "config.json"})  # what `write_folder` puts in its tmp folder
MOST_PID_DIGITS = 7  # Linux's pid_max is at most 2**22; a longer number names no process


class ExportWriteError(DraftsmithError, OSError):
    """An export that could not be written (a full disk, a read-only folder): one line at the
    CLI, and still an OSError to callers that catch one."""


class ImportNote(UserWarning):
    """A warning about how an engine folder reads (the doctor reports each as a finding, with
    its fix)."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix


def note(message: str, fix: str, stacklevel: int = 3) -> None:
    """Warn with an ImportNote; `stacklevel` as warnings.warn counts it from the caller."""
    warnings.warn(ImportNote(message, fix), stacklevel=stacklevel + 1)


@dataclass
class TargetInfo:
    num_layers: int
    max_position_embeddings: int
    vocab_size: int
    name_or_path: str = ""
    architectures: list[str] = field(default_factory=list)
    fingerprint: str = ""
    embed: torch.Tensor | None = None
    head: torch.Tensor | None = None  # the target's lm_head (SGLang's draft without one takes it)
    dtype: str = ""  # the dtype the target's config.json names ("" where unknown)

    @classmethod
    def of_target(cls, target: Any) -> TargetInfo:
        from draftsmith.train.sources import target_head

        embed, head = target_head(target)
        return cls(
            target.cfg.num_layers, target.cfg.max_position_embeddings, target.cfg.vocab_size,
            served_folder(target),
            list(target.hf_config.get("architectures") or []),
            target.fingerprint, embed, head, config_dtype(target.hf_config),
        )

    @classmethod
    def of_drafter(cls, cfg: Eagle3Config) -> TargetInfo:
        if cfg.target_num_layers < 1:
            raise DraftsmithError(
                "the drafter does not record its target's layer count; pass --target"
            )
        where, dtype = _recorded_where(cfg.target_source)
        return cls(cfg.target_num_layers, cfg.max_position_embeddings, cfg.vocab_size,
                   where, list(cfg.target_architectures), cfg.target_fingerprint, dtype=dtype)


def _recorded_where(source: str) -> tuple[str, str]:
    """(the name an export gives the target a drafter records, that target's dtype). The
    embedded default ("default", or its long name) and a GGUF file are named by the HF folder
    they load from, as an export given --target names them, so an engine can load it; where
    that fails, the default by its long name (draftsmith reads it back as the default) and a
    GGUF by its file."""
    from draftsmith.targets import DEFAULT_NAME, is_default, load_target

    default = bool(source) and is_default(source)  # a default's conversion cache folder too
    if not default and not (source.endswith(".gguf") and Path(source).is_file()):
        return local_path(source), _recorded_dtype(source)
    try:
        t = load_target("default" if default else source)
    except DraftsmithError:
        return (DEFAULT_NAME if default else local_path(source)), ""
    return local_path(str(t.folder)), config_dtype(t.hf_config)


HALF = ("bfloat16", "float16")


def config_dtype(hf: dict[str, Any]) -> str:
    """The dtype an HF config names (`torch_dtype`, or transformers 5's `dtype`; a multimodal
    one's text_config), "" where it names none the engines read."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    for c in (hf, text):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in (*HALF, "float32"):
                return str(c[key])
    return ""


def _recorded_dtype(source: str) -> str:
    """The dtype of the target folder a drafter records, "" where it is not at hand."""
    try:
        return config_dtype(read_config(Path(source))) if source else ""
    except (DraftsmithError, OSError):
        return ""


def run_dtype(tensors: dict[str, torch.Tensor], info: TargetInfo) -> str:
    """The dtype an export's config names, which SGLang runs the draft in under its default
    `--dtype auto`: the target's, since the draft is fed the target's hidden states and shares
    its embedding (a float32 config runs as float16 there, beside a bfloat16 target: dtype
    mismatches). Without the target's: the weights' own half dtype, else bfloat16."""
    if info.dtype:
        run = info.dtype
    else:
        stored = dtype_name(tensors)
        run = stored if stored in HALF else "bfloat16"
    if run == "float16":
        _warn_past_half(tensors)
    return run


def overflow(v: torch.Tensor, dtype: torch.dtype, cast: torch.Tensor | None = None) -> float | None:
    """The largest finite magnitude in `v` where `dtype` turns one of its finite values into
    inf (`cast`: `v` already in `dtype`), else None."""
    if not v.is_floating_point():
        return None
    cast = v.to(dtype) if cast is None else cast
    if not bool((torch.isinf(cast) & torch.isfinite(v)).any()):
        return None
    return float(v[torch.isfinite(v)].abs().max())


def _warn_past_half(tensors: dict[str, torch.Tensor]) -> None:
    """The engines load the drafter in the float16 its config names: a stored value past
    float16's range becomes inf there."""
    for k, v in tensors.items():
        if (most := overflow(v, torch.float16)) is not None:
            warnings.warn(f"{k} holds values up to {most:.6g} in magnitude, past float16's "
                          f"{torch.finfo(torch.float16).max:.6g}: the engines load the drafter "
                          "in float16 (the target's dtype, which its config names) and would "
                          "hold inf there; serve it with --dtype bfloat16", stacklevel=3)
            return


def hf_layer_config(cfg: Eagle3Config, info: TargetInfo, num_layers: int) -> dict[str, Any]:
    """An HF LlamaConfig dict for the drafter's decoder layer(s). Rope is written both the
    transformers-4 way (rope_theta/rope_scaling) and the transformers-5 way (rope_parameters),
    both naming the kind as `rope_type`: an old config's `type` alone under a `rope_type` of
    "default" reads back unscaled."""
    rope = dict(cfg.rope_scaling or {})
    if rope:
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope or None,
        "rope_parameters": {"rope_type": "default", **rope, "rope_theta": cfg.rope_theta},
        "max_position_embeddings": info.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def model_config_of(layer: dict[str, Any]) -> ModelConfig:
    """Parse an engine's HF-style layer config (any Llama-like model_type) with our reader."""
    return ModelConfig.from_hf({**layer, "model_type": "llama"})


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The floating tensors in `dtype` (None: as they are). A NaN or inf, stored or made by a
    `dtype` too narrow for a value (past float16's 65504), is refused by name: the engines
    would serve it."""
    out = {}
    for k, v in tensors.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise DraftsmithError(f"the drafter's {k} holds NaN or inf values, which the engines "
                                  "would serve; export a drafter whose weights are finite")
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        if dtype is not None and (most := overflow(v, dtype, out[k])) is not None:
            raise DraftsmithError(
                f"--dtype {str(dtype).removeprefix('torch.')}: the drafter's {k} holds values up "
                f"to {most:.6g} in magnitude, past its largest ({torch.finfo(dtype).max:.6g}), "
                "which would be written as inf; export with --dtype bf16 (or keep)")
    return out


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(tensors["fc.weight"].dtype).removeprefix("torch.")


def write_folder(
    out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], overwrite: bool = False
) -> Path:
    """config.json + model.safetensors into `out`, built in a tmp folder beside it, then renamed
    to `out` or, where `out` is a folder already (`.`, a link), moved into it."""
    from safetensors.torch import save_file

    out = Path(out)
    check_out(out, overwrite)
    real = out.resolve()  # `.` has no name to put a tmp folder beside
    tmp = tmp_folder(real, os.getpid())
    clear_stale_tmps(real)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except BaseException as e:  # a full disk, ^C: no half-written weights left beside --out
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a read-only folder: one line, as import's
            raise ExportWriteError(f"--out {out}: cannot write the export ({e.strerror or e}); "
                                  "what was there is kept: make room or choose a writable "
                                  "--out, and export again") from None
        raise
    try:
        if real.is_dir():
            _move_into(tmp, real)
        else:
            tmp.rename(real)
    except OSError as e:
        raise ExportWriteError(f"--out {out}: cannot move the export in from {tmp} "
                              f"({e.strerror or e}); export again with --overwrite") from None
    return out


def tmp_folder(real: Path, pid: int) -> Path:
    """Where process `pid` builds an export of `real` (a resolved --out) before moving it in."""
    return real.with_name(f"{_tmp_prefix(real)}{pid}")


def _tmp_prefix(real: Path) -> str:
    return f".{real.name}.tmp-"


def clear_stale_tmps(real: Path) -> None:
    """Remove the tmp folders of exports into `real` that were killed (SIGKILL, power loss: their
    own cleanup never ran), each said in one line. Only a folder named as `tmp_folder` names one,
    of a process no longer alive on this host, holding nothing an export does not write."""
    prefix = _tmp_prefix(real)
    for p in sorted(real.parent.glob(f"{glob.escape(prefix)}*")):
        if not _killed_tmp(p, p.name.removeprefix(prefix)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            print(f"removed {p}: the unfinished tmp folder of an export into {real} that was "
                  "killed (its process is gone)", file=sys.stderr)


def _killed_tmp(p: Path, pid: str) -> bool:
    from draftsmith.targets import pid_alive

    if not (pid.isascii() and pid.isdigit()) or len(pid) > MOST_PID_DIGITS or p.is_symlink() \
            or not p.is_dir():  # ascii: `isdigit` passes "²", which int() refuses
        return False
    try:
        return not pid_alive(int(pid)) and all(f.name in TMP_FILES for f in p.iterdir())
    except OSError:  # a folder it may not read is not one it wrote
        return False


def _move_into(tmp: Path, out: Path) -> None:
    """Each new file replaces its old namesake (os.replace), then the rest of `out` goes; the
    folder itself stays, so a shell standing in it sees the new files."""
    new = {p.name for p in tmp.iterdir()}
    for p in tmp.iterdir():
        os.replace(p, out / p.name)
    for p in out.iterdir():
        if p.name in new:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    tmp.rmdir()


def check_out(out: Path, overwrite: bool, hint: str = "pass --overwrite to replace it") -> None:
    """An --out that can be written: a folder (or nothing yet), empty unless `overwrite`."""
    check_folder(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DraftsmithError(f"--out {out}: exists and is not empty; {hint}")


def check_apart(out: Path, src: Path, what: str) -> None:
    """Refuse an --out that is `src` or holds it or lies in it: writing it would destroy what
    is read (the export replaces --out whole)."""
    a, b = Path(out).resolve(), Path(src).resolve()
    if a == b:
        rel = f"is {what} itself"
    elif b in a.parents:
        rel = f"lies inside {what} {src}"
    elif a in b.parents:
        rel = f"holds {what} {src}"
    else:
        return
    raise DraftsmithError(f"--out {out}: {rel}; choose another --out")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint folder's weights as a target's are read (safetensors, sharded by an index or
    not, else PyTorch .bin), `model.` prefixes dropped."""
    return {k.removeprefix("model."): v for k, v in read_checkpoint(Path(folder)).items()}


def vocab_tensors(
    w: dict[str, torch.Tensor], vocab: int, draft_vocab: int, where: str
) -> dict[str, torch.Tensor]:
    """d2t and t2d, derived from each other (or the identity) where a checkpoint omits them; a
    d2t of another length than the draft vocab, or mapping outside the target's, is refused (an
    engine would index past its vocabulary)."""
    from draftsmith.data.vocab import map_problem

    d2t, t2d = w.get("d2t"), w.get("t2d")
    if d2t is None and t2d is None:
        if draft_vocab != vocab:
            raise DraftsmithError(f"{where}: no d2t/t2d but draft vocab {draft_vocab} != {vocab}")
        return {"d2t": torch.zeros(vocab, dtype=torch.long),
                "t2d": torch.ones(vocab, dtype=torch.bool)}
    if t2d is not None and t2d.numel() != vocab:
        raise DraftsmithError(
            f"{where}: t2d has {t2d.numel()} entries, not one per target token ({vocab}); "
            "t2d is a boolean mask over the target vocabulary marking the draft's tokens")
    if d2t is None:
        used = torch.nonzero(t2d.bool()).flatten()
        d2t = used - torch.arange(used.numel())
        _note_unmapped(d2t, draft_vocab, where)
    if d2t.numel() != draft_vocab:
        raise DraftsmithError(f"{where}: d2t has {d2t.numel()} entries but the config says draft "
                              f"vocab {draft_vocab}: one offset per draft token")
    d2t = d2t.flatten().long()
    _refuse_absolute(d2t, t2d, vocab, where)
    used, problem = map_problem(d2t, None, vocab)
    if problem is not None and problem[0] == "outside":
        raise DraftsmithError(f"{where}: d2t: {problem[1]}")
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[used] = True
    return {"d2t": d2t, "t2d": t2d.bool()}


def _note_unmapped(d2t: torch.Tensor, draft_vocab: int, where: str) -> None:
    """Without d2t, SGLang (no hot_token_id) and vLLM (draft_id_to_target_id left at 0) give
    draft id i target id i, whatever t2d marks (both skip t2d): the import takes the map t2d
    marks, which the engines serving the folder as it is never apply; named."""
    if d2t.numel() == draft_vocab and bool(d2t.ne(0).any()):
        note(f"{where}: no d2t, so SGLang and vLLM serving this folder draft target ids "
             f"0..{draft_vocab - 1} (they skip t2d), but t2d marks other tokens; the import "
             "takes the map t2d marks",
             "store d2t = nonzero(t2d) - arange(draft vocab), the offsets both engines read "
             "(`draftsmith export` of the import writes it)", stacklevel=4)


def _refuse_absolute(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int,
                     where: str) -> None:
    """A d2t of absolute target ids (target = d2t[draft]) instead of offsets (target = draft +
    d2t[draft], as SGLang's hot_token_id and vLLM's compute_logits read it) would draft other
    tokens without a word: refused where read as offsets it fails (outside the vocabulary, or
    off the t2d mask) but read as ids it is the map t2d marks (or, without t2d, a valid map)."""
    from draftsmith.data.vocab import map_problem

    if t2d is None and map_problem(d2t, None, vocab)[1] is None:
        return
    if t2d is not None and map_problem(d2t, t2d, vocab)[1] is None:
        return
    as_offsets = d2t - torch.arange(d2t.numel())
    if map_problem(as_offsets, t2d, vocab)[1] is None:
        raise DraftsmithError(
            f"{where}: d2t holds absolute target ids, not the offsets SGLang and vLLM read "
            "(target id = draft id + d2t[draft id]); store d2t - arange(draft vocab) instead")


def draft_vocab_of(config: dict[str, Any], vocab: int, where: str) -> int:
    """The draft vocabulary the engines read from `config`: its draft_vocab_size, else the
    target's vocab (SGLang's LlamaForCausalLMEagle3 and vLLM's Eagle3LlamaForCausalLM both fall
    back so; speculators' own 32000 default is not what vLLM serves)."""
    return _size(config, "draft_vocab_size", vocab, where)


def target_hidden_of(config: dict[str, Any], hidden: int, where: str) -> int:
    """The target_hidden_size the engines read (fc's inputs over 3), the drafter's hidden size
    where absent."""
    return _size(config, "target_hidden_size", hidden, where)


def _size(config: dict[str, Any], key: str, default: int, where: str) -> int:
    """config[key] as a whole number >= 1 (a string or a float named), `default` where absent."""
    v = config.get(key)
    if v is None:
        return default
    if type(v) is not int or v < 1:
        raise DraftsmithError(f"{where}: {key} is {v!r}, not a whole number >= 1")
    return v


def drafter_config(where: str, **kw: Any) -> Eagle3Config:
    """An engine folder's Eagle3Config, a value it refuses named with the folder's config."""
    try:
        return Eagle3Config(**kw)
    except DraftsmithError as e:
        raise DraftsmithError(f"{where}: {e}") from None


def check_flags(config: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Flags the engines test for truth must be JSON true/false (0/1, which every reader takes
    alike, pass too; null or absent: the engine's default). Text is refused naming the key:
    bool("false") is true, as vLLM's `if config.norm_before_residual` reads it, while
    speculators' pydantic config reads the word; the import would take the opposite flag."""
    for k in keys:
        v = config.get(k)
        if v is None or isinstance(v, bool) or (type(v) is int and v in (0, 1)):
            continue
        kind = "text" if isinstance(v, str) else type(v).__name__
        raise DraftsmithError(f"{where}: {k} is {json.dumps(v)[:40]} ({kind}), not true or "
                              f"false; write {k} as JSON true or false")


def section(config: dict[str, Any], key: str, where: str, name: str = "") -> dict[str, Any]:
    """`config[key]` as a JSON object, {} where the key is absent; null or another value is
    refused naming the file and key (`name`: the key's dotted path where nested)."""
    if key not in config:
        return {}
    value = config[key]
    if isinstance(value, dict):
        return value
    raise DraftsmithError(f"{where}: {name or key} is {json.dumps(value)[:60]}, not a JSON "
                          "object; remove the key or write the object the layout holds there")


def recorded_layers(config: dict[str, Any], info: TargetInfo | None,
                    where: str = "config.json") -> int | None:
    """The target's layer count: from the live target, else as draftsmith recorded it."""
    if info is not None:
        return info.num_layers
    n = section(config, "draftsmith", where).get("target_num_layers")
    if n is not None and (type(n) is not int or n < 1):
        raise DraftsmithError(f"{where}: draftsmith.target_num_layers is {n!r}, not a whole "
                              "number >= 1; fix it or pass --target")
    return n or None


def engine_feed(written: list[int], conv: Convention | str, num_layers: int,
                where: str = "", repeats: bool = False) -> list[int]:
    """Canonical ids an engine feeds for `written`, the list at the key it reads: the one
    reading every import, doctor and compare make of an engine folder's ids. The engines convert
    each id alike (SGLang's Llama-family classes add 1 to every one, whatever the first), capture
    each layer once and append the states walking the layers (`for i in range(...): if i in
    layers_to_capture`), so they feed them ascending whatever order the list is in. `repeats`
    keeps a repeated layer (the engines' own defaults on a short target, which `default_repeat`
    names) instead of refusing it."""
    ids, at = [int(i) for i in written], f"{where}: " if where else ""
    if len(set(ids)) < len(ids) and not repeats:
        raise DraftsmithError(f"{at}aux layer ids {ids} repeat a layer, which the engines "
                              "capture once: the drafter's fc would get too few states")
    try:
        return sorted(from_convention(ids, conv, num_layers))
    except DraftsmithError as e:
        raise DraftsmithError(f"{at}{ids} out of range for this target: {e}") from None


def engine_ids(config: dict[str, Any], layout: str, num_layers: int,
               where: str) -> tuple[list[int] | None, str, Convention]:
    """(the ids `draftsmith import` reads, None for the engines' defaults; their key; their
    convention). SGLang's layout: eagle_config's list, else the top-level one only vLLM reads;
    speculators': as vLLM reads it (`speculators_lists`). An empty list is as good as none (the
    engines test it for truth). A list that is not of integers is refused here, not with a
    traceback."""
    nested = (config.get("eagle_config") or {}) if layout == "sglang" else {}
    if not isinstance(nested, dict):
        raise DraftsmithError(f"{where}: eagle_config is not a JSON object")
    lists = ((f"eagle_config.{IDS}", nested.get(IDS), Convention.SGLANG),
             (f"{IDS} (top level)", config.get(IDS), Convention.VLLM))
    if layout == "speculators":
        lists = speculators_lists(config)
    for key, ids, conv in lists:
        check_id_list(where, key, ids)
        if ids:
            return list(ids), key, conv
    return None, f"eagle_config.{IDS}" if layout == "sglang" else f"{IDS} (top level)", \
        Convention.EAGLE


def check_id_list(where: str | Path, key: str, ids: Any) -> None:
    """An aux id list as written (None: absent) refused in one line where it is not a list of
    integers: the engines' readers would fail on it with a traceback."""
    if ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)):
        raise DraftsmithError(f"{where}: {key} is {ids!r}, not a list of integer layer ids")


LAYER = "transformer_layer_config"


def speculators_lists(config: dict[str, Any]) -> tuple[tuple[str, Any, Convention], ...]:
    """The id lists of a speculators folder in the order vLLM reads them: its draft config is
    transformer_layer_config with a non-empty top-level list copied over it
    (`algos.update_eagle3`), and its model runner reads that config's list, else its
    eagle_config's (`_get_eagle3_aux_layers_from_config`). speculators reads the top level
    only."""
    layer = config.get(LAYER) if isinstance(config.get(LAYER), dict) else {}
    inner = layer.get("eagle_config") if isinstance(layer.get("eagle_config"), dict) else {}
    return ((f"{IDS} (top level)", config.get(IDS), Convention.VLLM),
            (f"{LAYER}.{IDS}", layer.get(IDS), Convention.VLLM),
            (f"{LAYER}.eagle_config.{IDS}", inner.get(IDS), Convention.VLLM))


def imported_ids(config: dict[str, Any], layout: str, num_layers: int, where: str,
                 folder: Path | None = None) -> list[int]:
    """Canonical ids of an engine folder as `draftsmith import` (and the doctor's and compare's
    runs, which load through it) reads them: as its engine feeds them, or the engines' default
    [2, L//2, L-3] (inputs of those layers) where the folder names none. Given the `folder`
    (import's readers), ids naming no layer of the target are refused in the ids as written
    there, as the doctor words them (`no_layer`), not in a converted id never written."""
    written, key, conv = engine_ids(config, layout, num_layers, where)
    if written is None:
        return default_feed(num_layers, where)
    at = f"{where}: {key}" if where else key
    try:
        return engine_feed(written, conv, num_layers, at)
    except DraftsmithError:
        if folder is None or not (words := no_layer(written, conv, num_layers)):
            raise
    raise DraftsmithError(f"{at}: {words} (fix: write there the ids of the layers the drafter "
                          f"was trained on; `draftsmith doctor --drafter {folder}` names them)")


def no_layer(written: list[int], conv: Convention, num_layers: int) -> str:
    """The doctor's words for engine ids of which some name no layer of the target, in the ids
    as written ("" where all do): `doctor.engines.no_layer_words` for the engine reading `conv`,
    imported here when called (the doctor imports this module)."""
    from draftsmith.doctor.engines import CONVENTION, no_layer_words

    engine = next(e for e, c in CONVENTION.items() if c is conv)
    return no_layer_words(written, engine, num_layers)


def default_ids(num_layers: int) -> list[int]:
    """SGLang's and vLLM's ids when a folder names none, as they list them: inputs of
    [2, L//2, L-3] ([2, 1, 0] of a 3-layer target, [2, 2, 1] of a 4-layer one)."""
    return [2, num_layers // 2, num_layers - 3]


def default_feed(num_layers: int, where: str = "") -> list[int]:
    """Canonical ids the engines feed from their defaults: ascending like any list they read,
    a repeated layer kept (a target under 8 layers repeats one, [2, 3, 3] of 6; `default_repeat`
    names it)."""
    what = "the engines' default ids"
    return engine_feed(default_ids(num_layers), Convention.EAGLE, num_layers,
                       f"{where}: {what}" if where else what, repeats=True)


def default_repeat(num_layers: int) -> str:
    """Words for a target whose engine default ids ([2, L//2, L-3], inputs of those layers)
    repeat a layer, else "": SGLang (`LlamaModel.forward`) and vLLM (`LlamaModel.forward`) test
    each layer once (`if i in layers_to_capture`), so they feed fewer states than the fc takes."""
    ids = default_ids(num_layers)
    if len(set(ids)) == len(ids):
        return ""
    return (f"the engines' default aux layers for this {num_layers}-layer target, inputs of "
            f"layers {ids}, repeat a layer, which SGLang and vLLM capture once: their fc gets "
            f"{len(set(ids))} states instead of {len(ids)} and fails; write the ids the drafter "
            "was trained on")


def warn_default_repeat(num_layers: int, where: str) -> None:
    if words := default_repeat(num_layers):
        note(f"{where}: names no aux layer ids; {words} (`draftsmith export` refuses the "
             "imported drafter until then)",
             "write the ids the drafter was trained on at the key the engine reads "
             "(`draftsmith doctor --data DIR` finds them)")


def warn_unsorted(written: list[int], canonical: list[int], where: str) -> None:
    if list(written) != sorted(written):
        note(f"{where}: aux layer ids {list(written)} are not ascending; SGLang and vLLM feed "
             f"the states in layer order, so they are read as canonical {canonical} (a drafter "
             "trained on the listed order gets its states in another order there)",
             f"write the ids sorted; if the drafter was trained on the listed order, first "
             f"permute the {len(written)} column blocks of fc.weight to ascending layer order")
