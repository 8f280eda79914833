"""Consistency checks between the data manifest, the drafter and the live target."""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from draftsmith.doctor.artifacts import DrafterInfo
from draftsmith.doctor.report import Finding
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS, engine_limits

COVERAGE_WARN = 0.9


def _manifest_path(data: Path) -> str:
    return str(data / "manifest.json")


def _cfg_path(info: DrafterInfo) -> str:
    return str(info.folder / ("draftsmith.json" if info.layout == "draftsmith" else "config.json"))


def target_identity(target: Any, manifest: dict | None, data: Path | None,
                    info: DrafterInfo | None, recorded: bool = False) -> list[Finding]:
    """`recorded`: the live target is the one this manifest or drafter records (no --target),
    so a fingerprint that differs is that path's weights changed since, not another target."""
    from draftsmith.targets.tokenizer import template_hash, tokenization_hash, tokenizer_hash

    out: list[Finding] = []
    live = {"fingerprint": target.fingerprint, "tokenizer_hash": tokenizer_hash(target.tokenizer),
            "tokenization_hash": tokenization_hash(target.tokenizer),
            "chat_template_hash": template_hash(target.tokenizer)}
    if manifest is not None and data is not None:
        out += _hashes(manifest.get("target") or {}, live, target.source, "data",
                       _manifest_path(data), recorded)
    fp = info.recorded("target_fingerprint") if info is not None else None
    if info is not None and fp and fp != live["fingerprint"]:  # exported folders record it too
        out.append(_drafter_fingerprint(fp, target, info, recorded))
    if info is not None and info.layout == "draftsmith":
        trained = (info.meta.get("data") or {}).get("target_fingerprint")
        if manifest is not None and trained and trained != (manifest.get("target") or {}).get(
                "fingerprint"):
            out.append(Finding(
                "error", "target", f"the drafter was trained on data of target {trained}, "
                f"the given data is of {(manifest.get('target') or {}).get('fingerprint')}",
                _cfg_path(info), "check the pair: --data and --drafter belong to different "
                "targets"))
        out += _training_data_hashes(info, live, target.source)
    return out


def _drafter_fingerprint(fp: str, target: Any, info: DrafterInfo, recorded: bool) -> Finding:
    if recorded:
        return Finding(
            "error", "target", f"the target the drafter config records, {target.source!r}, now "
            f"has fingerprint {target.fingerprint}, not the {fp} the drafter was trained for: "
            "the same name, other weights", _cfg_path(info),
            "pass the target it was trained for with --target PATH, or retrain for this one")
    return Finding(
        "error", "target", f"the drafter was trained for target fingerprint {fp}, the "
        f"live target {target.source!r} has {target.fingerprint}", _cfg_path(info),
        "pass the drafter's own target with --target, or retrain for this one")


def _hashes(recorded: dict, live: dict, source: str, who: str, where: str,
            taken: bool = False) -> list[Finding]:
    """`taken`: the live target is the one `recorded` names, loaded from there."""
    from draftsmith.targets import is_default

    src = recorded.get("source")
    named = "default" if src and is_default(str(src)) else src
    fixes = {
        "fingerprint": (f"pass the target the {who} was captured with as --target PATH, or "
                        "recapture with this one") if taken else
                       f"pass the {who}'s target with --target ({named!r}), or recapture with "
                       "this one",
        "tokenizer_hash": "the token ids mean different text for this target: recapture the data "
                          "with this target's tokenizer",
        # the same vocabulary split otherwise (one fingerprint): train refuses it
        # (`targets.check_tokenization`); older data without the hash passes
        "tokenization_hash": "the same ids stand for other text: recapture the data with this "
                             "target",
        "chat_template_hash": "the drafter learns the template's tokens too: recapture with the "
                              "template you serve, or serve with the one the data used",
    }
    out, differ = [], set()
    for key, fix in fixes.items():
        got = recorded.get(key)
        if key == "tokenization_hash" and "tokenizer_hash" in differ:
            continue  # another vocabulary splits otherwise too: one finding says it
        if got and got != live[key]:
            differ.add(key)
            words = key.replace("_hash", "").replace("_", " ")
            what = (f"the target the {who} manifest records, {source!r}, now has {words} "
                    f"{live[key]}, not the {got} the {who} was captured with: the same name, "
                    "other weights" if taken and key == "fingerprint" else
                    f"{who} {words} {got} differs from the live target's {live[key]} "
                    f"({source!r})")
            out.append(Finding("error", "target", what, where, fix))
    return out


def _training_data_hashes(info: DrafterInfo, live: dict, source: str) -> list[Finding]:
    from draftsmith.data.shards import read_manifest

    folder = (info.meta.get("data") or {}).get("folder")
    if not folder or not (Path(folder) / "manifest.json").is_file():
        return []
    try:
        m = read_manifest(Path(folder))
    except DraftsmithError:
        return []
    rec = {k: v for k, v in (m.get("target") or {}).items() if k != "fingerprint"}
    return _hashes(rec, live, source, "the drafter's training data", str(Path(folder)))


def sizes(target: Any, manifest: dict | None, data: Path | None,
          info: DrafterInfo | None, data_ids: list[int] | None) -> list[Finding]:
    c, out = target.cfg, []
    if manifest is not None and data is not None:
        where = _manifest_path(data)
        for key, live in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)):
            if manifest.get(key) is not None and int(manifest[key]) != live:
                out.append(Finding("error", "sizes", f"data {key} {manifest[key]} != target's "
                           f"{live}", where, "recapture the data with this target"))
        layers = (manifest.get("target") or {}).get("num_layers")
        if layers is not None and int(layers) != c.num_layers:
            out.append(Finding("error", "sizes", f"data was captured from a {layers}-layer "
                       f"target, this one has {c.num_layers}", where, "use the data's target"))
    if info is not None:
        out += _drafter_sizes(target, info, data_ids)
    return out


def _drafter_sizes(target: Any, info: DrafterInfo, data_ids: list[int] | None) -> list[Finding]:
    c, out, where = target.cfg, [], _cfg_path(info)
    pairs = [("target_hidden_size", info.target_hidden_size, c.hidden_size),
             ("vocab_size", info.vocab_size, c.vocab_size)]
    layers = info.recorded("target_num_layers")
    if layers and not (type(layers) is int and layers > 0):
        out.append(Finding("error", "sizes", f"drafter target_num_layers {layers!r} is not a "
                           "layer count", where, f"set it to the target's {c.num_layers} where "
                           "the drafter was trained for this target"))
    elif layers:
        pairs.append(("target_num_layers", layers, c.num_layers))
    for key, got, live in pairs:
        if got != live:
            out.append(Finding("error", "sizes", f"drafter {key} {got} != the target's {live}",
                               where, "this drafter belongs to another target"))
    n = info.fc_inputs()
    if n is not None and data_ids is not None and n != len(data_ids):
        shape = list(info.shapes()["fc.weight"][0])
        out.append(Finding("error", "sizes", f"fc.weight {shape} reads {n} aux states, the "
                           f"data holds {len(data_ids)}", where,
                           "retrain on this data (the fc input width cannot change)"))
    return out


def draft_vocab(info: DrafterInfo, vocab: int, data: Path | None) -> list[Finding]:
    from draftsmith.data.vocab import map_problem

    d2t, t2d, where = info.tensor("d2t"), info.tensor("t2d"), _cfg_path(info)
    if d2t is None:
        if info.draft_vocab_size != info.vocab_size:
            return [Finding("error", "vocab", f"no d2t tensor but draft vocab "
                            f"{info.draft_vocab_size} != vocab {info.vocab_size}", where,
                            "re-export the drafter with its d2t mapping")]
        return []
    used, problem = map_problem(d2t, t2d, vocab)
    out = []
    if d2t.numel() != info.draft_vocab_size:
        out.append(Finding("error", "vocab", f"d2t has {d2t.numel()} entries, draft_vocab_size "
                           f"is {info.draft_vocab_size}", where, "re-export the drafter"))
    if problem and problem[0] == "t2d":
        out.append(Finding("warning", "vocab", problem[1], where,
                           "SGLang and vLLM ignore t2d; rebuild it from d2t for others"))
    elif problem:
        fix = "rebuild the draft vocabulary" + (" for this target" if problem[0] == "outside"
                                                else "")
        out.append(Finding("error", "vocab", problem[1], where, fix))
    if (not problem or problem[0] != "outside") and data is not None:
        out += _coverage(used, vocab, data)
    return out


def _coverage(used: torch.Tensor, vocab: int, data: Path) -> list[Finding]:
    from safetensors import SafetensorError

    from draftsmith.data.vocab import count_dataset

    try:
        counts = count_dataset(data, vocab)
    except (DraftsmithError, SafetensorError):  # a damaged shard: the shard check names it
        return []
    if counts.numel() > vocab:
        over = int(counts[vocab:].nonzero().flatten()[0]) + vocab
        return [Finding("error", "vocab", f"the data holds token id {over} >= target vocab "
                        f"{vocab}", _manifest_path(data), "recapture with this target")]
    total = int(counts.sum())
    cov = float(counts[used].sum()) / total if total else 1.0
    if cov < COVERAGE_WARN:
        what = (f"the drafter's draft vocab ({used.numel()} tokens) holds {cov:.1%} of the "
                f"{total} loss-masked (assistant) tokens in {data}'s shards; the rest can never "
                "be drafted (train's cover(target) counts the target's own next tokens instead)")
        own = _data_vocab(used, counts, vocab, data)
        return [Finding("warning", "vocab", what + (own[0] if own else ""),
                        _manifest_path(data), own[1] if own else
                        "train with a larger --draft-vocab-size")]
    return []


def _data_vocab(used: torch.Tensor, counts: torch.Tensor, vocab: int,
                data: Path) -> tuple[str, str] | None:
    """Where the dataset holds a vocab of its own (`data make`'s) other than the drafter's:
    its coverage of the same tokens, which `data make` printed, and --vocab as the fix."""
    from draftsmith.data.vocab import existing_vocab, map_problem

    path = data / "vocab.safetensors"
    if (found := existing_vocab(path)) is None:
        return None
    own, problem = map_problem(*found, vocab)
    if problem or torch.equal(own.sort().values, used.sort().values):
        return None
    cov = float(counts[own].sum()) / max(1, int(counts.sum()))
    return (f"; the drafter does not use the dataset's own {path.name} ({own.numel()} tokens, "
            f"{cov:.1%} of them, the figure `data make` printed)",
            f"train with --vocab {path}, or a larger --draft-vocab-size")


def data_files(data: Path, manifest: dict, hashed: Collection[int] | None) -> list[Finding]:
    """Every shard against the manifest; the sha256 only of those at the positions `hashed`
    (None: all)."""
    from draftsmith.data.shards import verify

    where = _manifest_path(data)
    try:
        verify(data, hashed)
        out = []
    except DraftsmithError as e:
        out = [_shard_finding(e, where)] + _later_shards(data, str(e))
    if not manifest.get("complete", True):
        out.append(Finding("warning", "shards", "the capture is not complete", where,
                           "rerun the capture command (it resumes)"))
    conv = manifest.get("aux_convention")
    if conv and conv != CANONICAL_WORDS:
        out.append(Finding("error", "shards", f"aux ids recorded as {conv!r}: `draftsmith "
                           "train` reads only its canonical form", where,
                           f"set aux_convention in manifest.json to {CANONICAL_WORDS!r} and "
                           "aux_layer_ids to the canonical layers the live match names"))
    return out


def _shard_finding(e: DraftsmithError, where: str) -> Finding:
    from draftsmith.data.shards import ShardDtypeError

    if isinstance(e, ShardDtypeError):
        return Finding("error", "dtype", str(e), where, "recapture into a fresh folder (or set "
                       "dtype in manifest.json to what aux and hidden hold)")
    return Finding("error", "shards", f"shard does not match the manifest: {e}", where,
                   "recapture into a fresh folder (or drop that shard's entry from "
                   "manifest.json and rerun the same capture command to rewrite it)")


def _later_shards(data: Path, first: str) -> list[Finding]:
    """The shards after the first bad one (`verify` stops there), each checked by size, shapes
    and dtypes, not hashed again: a dataset found damaged is recaptured whatever the rest
    hash to, but a fix of one shard must not meet the next only on the rerun."""
    from draftsmith.data.shards import _verify_shard, read_manifest

    m = read_manifest(data)
    at = next((k for k, s in enumerate(m["shards"]) if first.startswith(f"{data / s['file']}:")),
              None)
    out, seen = [], {_after_path(first)}  # a manifest-wide fault (its dtype) said once
    for s in m["shards"][at + 1:] if at is not None else []:
        try:
            _verify_shard(data, m, s, hashed=False)
        except DraftsmithError as e:
            if _after_path(str(e)) not in seen:
                seen.add(_after_path(str(e)))
                out.append(_shard_finding(e, _manifest_path(data)))
    return out


def _after_path(said: str) -> str:
    return said.split(": ", 1)[-1]


def positions(target: Any, info: DrafterInfo) -> list[Finding]:
    mine, theirs = info.max_position_embeddings, target.cfg.max_position_embeddings
    out = []
    if mine is not None and mine < theirs:
        out.append(Finding(
            "error", "positions", f"drafter max_position_embeddings {mine} < the target's "
            f"{theirs}: acceptance collapses on longer prompts (SpecForge issues 249/271)",
            _cfg_path(info), f"set max_position_embeddings to {theirs} (no retraining)"))
    theta = info.get("rope_theta")
    if theta is not None and not _number(theta):
        out.append(Finding("error", "positions", f"drafter rope_theta {theta!r} is not a "
                           "number: the engines cannot build its rotary embedding",
                           _cfg_path(info), f"set rope_theta to {target.cfg.rope_theta}, the "
                           "target's, unless it was trained with another"))
    elif theta is not None and float(theta) != float(target.cfg.rope_theta):
        out.append(Finding("warning", "positions", f"drafter rope_theta {theta} != the target's "
                           f"{target.cfg.rope_theta}", _cfg_path(info),
                           "fine only if it was trained that way; engines use the config's"))
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def capturable(ids: list[int], num_layers: int, engine: str | None, where: str) -> list[Finding]:
    from draftsmith.export.speculators import vllm_edge_fix, vllm_edge_notes

    vllm = engine == "vllm"
    notes = vllm_edge_notes(ids, num_layers) if vllm else engine_limits(ids, num_layers)
    # SGLang's limits fail SGLang; for --engine draftsmith, which captures any layer, they
    # are advice that must not fail --strict
    sev = ("error" if engine and engine.startswith("sglang") else
           "info" if engine == "draftsmith" else "warning")
    fix = "" if not notes else (vllm_edge_fix(num_layers, len(ids)) if vllm else
                                _capturable_fix(num_layers, len(ids)))
    return [Finding(sev, "capturable", n, where, fix) for n in notes]


def _capturable_fix(num_layers: int, n: int) -> str:
    """Layers to retrain on that SGLang captures: on a short target the default ids hold the
    embedding or the last layer's output, what it cannot capture."""
    from draftsmith.doctor.engines import capturable_ids

    ids = capturable_ids("sglang", num_layers, n)
    if ids is None:
        return (f"SGLang cannot be given {n} distinct layers of this {num_layers}-layer target:"
                " serve the drafter with vLLM (`draftsmith export --format speculators`)")
    return ("retrain on layers every engine can capture, e.g. `draftsmith data capture "
            f"--aux-layers {','.join(map(str, ids))}`")


def training_ids(info: DrafterInfo) -> list[Finding]:
    """The drafter config against the ids its own training data recorded (the seed's edit)."""
    if info.layout != "draftsmith":
        return []
    trained = (info.meta.get("data") or {}).get("aux_layer_ids")
    mine = info.canonical_ids()
    if trained is None or list(trained) == mine:
        return []
    return [Finding("error", "wiring", f"the drafter config says aux layers {mine} but it was "
                    f"trained on data recorded as {list(trained)} ({CANONICAL_WORDS})",
                    _cfg_path(info), f"set config.aux_layer_ids to {list(trained)} (confirm "
                    "with --data: the doctor matches the data against the live target)")]
