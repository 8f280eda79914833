"""Export a draftsmith drafter for SGLang or speculators/vLLM; import external EAGLE-3 folders.

Aux layer ids are written in each engine's own convention through `draftsmith.layers` and read
back to canonical ids the same way; nothing here adds or subtracts one.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.export.layout import (
    TargetInfo,
    check_apart,
    check_out,
    read_config,
    section,
)
from draftsmith.export.sglang import is_sglang, read_sglang, write_sglang
from draftsmith.export.speculators import (
    is_speculators,
    read_speculators,
    verifier_of,
    write_speculators,
)
from draftsmith.models.eagle3 import CONFIG_FILE, Eagle3Drafter, load_drafter, save_drafter
from draftsmith.targets import portable, portable_source

FORMATS = ("sglang", "speculators")


def target_info(drafter: Eagle3Drafter, target: str | None) -> tuple[TargetInfo, str]:
    """Facts about the drafter's target (from the target itself if given, else as recorded),
    and the target's portable name for draftsmith's own record in the export."""
    if target is None:
        return TargetInfo.of_drafter(drafter.cfg), portable(drafter.cfg.target_source)
    from draftsmith.targets import load_target

    t = load_target(target)
    want = drafter.cfg.target_fingerprint
    if want and t.fingerprint != want:
        raise DraftsmithError(
            f"--target {target} has fingerprint {t.fingerprint}, but the drafter was trained "
            f"for {want} ({drafter.cfg.target_source or 'unknown source'})"
        )
    if t.cfg.vocab_size != drafter.cfg.vocab_size:
        raise DraftsmithError(f"--target {target}: vocabulary {t.cfg.vocab_size} != the "
                              f"drafter's {drafter.cfg.vocab_size}")
    _check_fits(t, drafter, target)
    return TargetInfo.of_target(t), portable_source(t)


def _check_fits(t: Any, drafter: Eagle3Drafter, target: str) -> None:
    """A drafter without a fingerprint (imported without --target) is checked by its sizes, as
    import checks it: the export records --target's fingerprint, so a target it does not fit
    would be named as its own."""
    from draftsmith.engine.speculative import check_pair

    try:
        check_pair(t.cfg, drafter.cfg)
    except DraftsmithError as e:
        raise DraftsmithError(f"--target {target} does not fit the drafter: {e}") from None
    n = drafter.cfg.target_num_layers
    if n > 0 and n != t.cfg.num_layers:
        raise DraftsmithError(
            f"--target {target} has {t.cfg.num_layers} layers, but the drafter's aux layers "
            f"{drafter.cfg.aux_layer_ids} were read for a target of {n}; pass that target")


def export_drafter(
    drafter_dir: str | Path,
    fmt: str,
    out: str | Path,
    target: str | None = None,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    overwrite: bool = False,
) -> Path:
    """Write the drafter at `drafter_dir` (draftsmith layout) in an engine's layout at `out`."""
    return export_served(drafter_dir, fmt, out, target, dtype, speculative_tokens, overwrite)[0]


def export_served(
    drafter_dir: str | Path,
    fmt: str,
    out: str | Path,
    target: str | None = None,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    overwrite: bool = False,
) -> tuple[Path, str]:
    """`export_drafter`, and the target as the engines load it beside the export (an HF folder:
    a GGUF's or the default's conversion), "" where the drafter records none."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"unknown export format {fmt!r}: use one of {list(FORMATS)}")
    if speculative_tokens < 1:
        raise DraftsmithError(f"--speculative-tokens must be >= 1, got {speculative_tokens}")
    out = Path(out)
    check_out(out, overwrite)
    check_apart(out, Path(drafter_dir), "the drafter folder")
    if target is not None and Path(target).exists():
        check_apart(out, Path(target), "the --target")
    check_replaceable(out)
    drafter = load_drafter(drafter_dir)
    info, source = target_info(drafter, target)
    ids = list(drafter.cfg.aux_layer_ids)
    if len(set(ids)) < len(ids):  # an import of the engines' defaults on a short target
        raise DraftsmithError(
            f"{drafter_dir}: aux layers {ids} repeat a layer, which SGLang and vLLM capture "
            f"once: their fc, made for {len(ids)} states, would get {len(set(ids))}; write the "
            "ids the drafter was trained on into the folder it was imported from (`draftsmith "
            "doctor --data DIR` finds them) and import it again")
    if ids != sorted(ids):  # SGLang and vLLM append captured states walking the layers
        raise DraftsmithError(
            f"{drafter_dir}: aux layers {ids} are not ascending, and {fmt} feeds them in "
            "ascending order to an fc trained on this order; capture and train on ascending "
            "--aux-layers (`draftsmith doctor --engine` names the fix)")
    if fmt == "sglang":
        return write_sglang(drafter, out, info, dtype, overwrite, source), info.name_or_path
    return (write_speculators(drafter, out, info, dtype, speculative_tokens, overwrite, source),
            info.name_or_path)


def check_replaceable(out: Path) -> None:
    """--overwrite replaces an earlier export, never a folder of something else (the export
    replaces --out whole: a folder holding the target, or anything else, would be lost)."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        c = read_config(out)
    except DraftsmithError:
        c = None
    if not (isinstance(c, dict) and (is_speculators(c) or is_sglang(c))):
        raise DraftsmithError(f"--out {out}: not an exported drafter folder (no SGLang or "
                              "speculators config.json); --overwrite replaces only an earlier "
                              "export; choose another --out")


def detect_format(folder: str | Path) -> str:
    folder = Path(folder)
    if (folder / CONFIG_FILE).is_file():
        return "draftsmith"
    c = read_config(folder)
    if is_speculators(c):
        return "speculators"
    if is_sglang(c):
        return "sglang"
    raise DraftsmithError(
        f"{folder}/config.json: neither speculators (speculators_model_type eagle3) nor "
        f"SGLang/SpecForge/EAGLE (architectures {c.get('architectures')}, no draft_vocab_size) "
        "EAGLE-3 layout; pass an EAGLE-3 drafter folder, not a target's"
    )


def read_any(folder: str | Path, target: str | None = None) -> Eagle3Drafter:
    """A drafter from any supported layout; `target` supplies layer count and embedding and
    must fit the drafter (vocab, hidden size, aux layers)."""
    fmt = detect_format(folder)
    if target is None and fmt == "draftsmith":
        return load_drafter(folder)
    if target is None:
        drafter, needs = _read_untold(folder, fmt)
        if drafter is not None:
            return drafter
        t, target = recorded_target(folder, needs)
    else:
        from draftsmith.targets import load_target

        t = load_target(target)
    return _read_for(folder, fmt, t, target)


def _read_untold(folder: str | Path, fmt: str) -> tuple[Eagle3Drafter | None, DraftsmithError]:
    """An engine folder read without a target, or the refusal that asks for one. Its notes are
    passed on only where it reads: a read with the recorded target says them again."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return _read_engine(folder, fmt, None), DraftsmithError("")
    except DraftsmithError as e:
        if "pass --target" not in str(e):
            raise
        caught = []
        return None, e
    finally:
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def recorded_target(folder: str | Path, refusal: DraftsmithError) -> tuple[Any, str]:
    """The target an exported folder records (`draftsmith.target`, else speculators' verifier),
    where it loads and its fingerprint is the recorded one: an export's SGLang folder holds no
    embedding, but says whose it is. Else `refusal`, with why the recorded one was not taken."""
    from draftsmith.targets import is_default, load_target

    c, where = read_config(folder), f"{folder}/config.json"
    record = section(c, "draftsmith", where)
    src = str(record.get("target") or verifier_of(c, where).get("name_or_path") or "")
    src = "default" if src and is_default(src) else src  # a default's cache folder, even cleared
    want = record.get("target_fingerprint")
    if not src or not want:
        raise refusal
    if src != "default" and not Path(src).exists():
        why = "moved or deleted" if Path(src).is_absolute() else \
            "a hub id, or a path relative to where the folder was made; draftsmith loads local " \
            "folders and GGUF files"
        raise DraftsmithError(f"{refusal}; the target config.json records, {src}, is not here "
                              f"({why})") from None
    try:
        t = load_target(src)
    except DraftsmithError as e:
        raise DraftsmithError(f"{refusal}; the target config.json records, {src}, does not "
                              f"load ({e})") from None
    if t.fingerprint != want:
        raise DraftsmithError(f"{refusal}; the target config.json records, {src}, now has "
                              f"fingerprint {t.fingerprint}, not the recorded {want}") from None
    print(f"draftsmith: {folder}: no --target given; using the target its config.json records, "
          f"{src} (fingerprint {want} matches)", file=sys.stderr)
    return t, src


def _read_for(folder: str | Path, fmt: str, t: Any, target: str) -> Eagle3Drafter:
    """The drafter at `folder` read and checked against the loaded target `t`."""
    from draftsmith.engine.speculative import check_pair

    info = None if fmt == "draftsmith" else TargetInfo.of_target(t)
    if info is None:
        drafter = load_drafter(folder)
    elif _other_fingerprint(t, read_config(folder).get("draftsmith")):
        with warnings.catch_warnings():  # notes comparing another target's tensors: the
            warnings.simplefilter("ignore")  # refusal below (shapes, else fingerprint) says all
            drafter = _read_engine(folder, fmt, info)
    else:
        drafter = _read_engine(folder, fmt, info)
    try:
        check_pair(t.cfg, drafter.cfg)
    except DraftsmithError as e:
        raise DraftsmithError(f"--target {target} does not fit the drafter {folder}: {e}") from None
    want = drafter.cfg.target_fingerprint
    _check_fingerprint(t, target, folder, {"target_fingerprint": want})
    if info is not None:  # the engine's verifier name is a loadable folder, not a portable one
        drafter.cfg.target_source = portable_source(t)
        if not want:
            _record_target(drafter, info)
    return drafter


def _other_fingerprint(t: Any, recorded: Any) -> bool:
    want = recorded.get("target_fingerprint") if isinstance(recorded, dict) else None
    return bool(want) and t.fingerprint != want


def _check_fingerprint(t: Any, target: str, folder: str | Path, recorded: Any) -> None:
    """As export refuses it: a target of the drafter's shapes but other weights."""
    if _other_fingerprint(t, recorded):
        want = recorded["target_fingerprint"]
        raise DraftsmithError(f"--target {target} has fingerprint {t.fingerprint}, but the "
                              f"drafter {folder} records its target as {want}; pass that target")


def _record_target(drafter: Eagle3Drafter, info: TargetInfo) -> None:
    """A foreign folder (no draftsmith record) that fits --target is recorded as that target's
    drafter, so doctor, serve, compare and export check the pairing as for a trained one."""
    drafter.cfg.target_fingerprint = info.fingerprint
    drafter.cfg.target_architectures = list(info.architectures)
    # Engines size the draft's rope cache by it; a SpecForge config's 2048 beside a 128K
    # target, written again by a later export without --target, collapses long prompts.
    drafter.cfg.max_position_embeddings = max(drafter.cfg.max_position_embeddings,
                                              info.max_position_embeddings)


def _read_engine(folder: str | Path, fmt: str, info: TargetInfo | None) -> Eagle3Drafter:
    if fmt == "speculators":
        return read_speculators(Path(folder), info)
    return read_sglang(Path(folder), info)


def import_drafter(src: str | Path, out: str | Path, target: str | None = None,
                   overwrite: bool = False) -> Path:
    """Convert an external EAGLE-3 folder into the draftsmith layout at `out` (new or empty;
    with `overwrite`, a draftsmith drafter folder too, whose files are replaced)."""
    out = Path(out)
    check_out(out, overwrite, "pass --overwrite to replace a drafter there, or choose another "
              "--out")
    if overwrite and out.is_dir() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise DraftsmithError(f"--out {out}: not a draftsmith drafter folder (no {CONFIG_FILE}); "
                              "--overwrite replaces only a drafter; choose another --out")
    if overwrite and (out / "checkpoints").is_dir():  # a resume there would undo the import
        raise DraftsmithError(f"--out {out}: a training run's folder (its checkpoints/ would "
                              "outlive the imported drafter); choose another --out")
    check_apart(out, Path(src), "the source folder")
    drafter = read_any(src, target)
    try:
        saved = save_drafter(drafter, out, imported={"from": str(Path(src).resolve()),
                                                     "format": detect_format(src)})
    except OSError as e:  # a full disk, a read-only folder: save_drafter kept what was there
        raise DraftsmithError(f"--out {out}: cannot write the drafter ({e.strerror or e}); "
                              "what was there is kept: make room and rerun the import") from None
    _drop_training_record(saved)
    return saved


def _drop_training_record(out: Path) -> None:
    """The replaced drafter's training log and curves go with it: the doctor would otherwise
    hold the imported drafter to the acceptance that log promised for another one."""
    from draftsmith.train.report import LOG, PLOT

    for name in (LOG, PLOT):
        (out / name).unlink(missing_ok=True)


__all__ = ["FORMATS", "detect_format", "export_drafter", "export_served", "import_drafter",
           "read_any"]
