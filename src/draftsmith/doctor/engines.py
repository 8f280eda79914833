"""What each engine will feed a drafter: where it reads the ids, how it reads them, its defaults.

Every id conversion goes through `draftsmith.layers`; this module only knows which key each
engine reads and what it does when the key is missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.export.layout import (
    default_feed,
    default_repeat,
    engine_feed,
    engine_ids,
    imported_ids,
)
from draftsmith.layers import (
    Convention,
    default_aux_layers,
    engine_limits,
    from_convention,
    to_convention,
)

ENGINES = ("draftsmith", "sglang", "vllm")
CONVENTION = {
    "draftsmith": Convention.CANONICAL,
    "sglang": Convention.SGLANG,
    "vllm": Convention.VLLM,
}
KEY = {
    "draftsmith": "config.aux_layer_ids in draftsmith.json",
    "sglang": "eagle_config.eagle_aux_hidden_state_layer_ids in config.json",
    "vllm": "eagle_aux_hidden_state_layer_ids (top level) in config.json",
}
# earlier names: SGLang's Llama-family classes read explicit ids alike on every version
ENGINE_NAMES = {"speculators": "vllm", "sglang-new": "sglang", "sglang-old": "sglang",
                "sglang-legacy": "sglang"}


def engine_name(name: str) -> str:
    name = ENGINE_NAMES.get(name.lower(), name.lower())
    if name not in ENGINES:
        raise DraftsmithError(f"--engine {name!r}: use one of {', '.join(ENGINES)}")
    return name


def engine_defaults(num_layers: int) -> list[int]:
    """SGLang's and vLLM's ids when none are given: inputs of 2, L//2, L-3, in canonical form,
    in the (ascending) order they feed them, as `draftsmith import` reads them."""
    return default_feed(num_layers)


@dataclass
class Feed:
    engine: str
    key: str
    written: list[int] | None  # ids as the config holds them for this engine (None: missing)
    canonical: list[int] | None  # what the engine captures, canonical, in the order it feeds them
    note: str = ""
    version_dependent: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feed_from_canonical(ids: list[int], engine: str, num_layers: int) -> Feed:
    """A draftsmith drafter exported for `engine`: export writes `to_convention(ids)` in the
    engine's convention, which `engine` reads in its own."""
    try:
        written = to_convention(ids, export_convention(engine), num_layers)
    except DraftsmithError as e:
        return Feed(engine, KEY[engine], None, None, f"cannot be written: {e}")
    return feed_from_written(written, engine, num_layers, KEY[engine])


def export_convention(engine: str) -> Convention:
    """The convention `draftsmith export` writes for `engine`."""
    return CONVENTION[engine]


def feed_from_written(written: list[int] | None, engine: str, num_layers: int,
                      key: str | None = None, missing_note: str = "") -> Feed:
    """`written`: the ids at the key `engine` reads (None when the key is missing)."""
    key = key or KEY[engine]
    if written is None:
        if engine == "draftsmith":
            return Feed(engine, key, None, None, "no aux layer ids in the drafter config")
        ids = engine_defaults(num_layers)
        note = missing_note or f"key missing: {engine} silently uses its defaults"
        return Feed(engine, key, None, ids, "; ".join(filter(None, [note, default_repeat(
            num_layers)])))
    try:
        ids = (from_convention(written, CONVENTION[engine], num_layers) if engine == "draftsmith"
               else engine_feed(written, CONVENTION[engine], num_layers))
    except DraftsmithError as e:
        return Feed(engine, key, list(written), None, no_layer_words(written, engine, num_layers)
                    or str(e))
    limits = engine_limits(ids, num_layers) if engine == "sglang" else []
    return Feed(engine, key, list(written), ids, "; ".join(limits))


READS = {"sglang": "SGLang", "vllm": "vLLM", "draftsmith": "draftsmith"}


def no_layer_words(written: list[int], engine: str, num_layers: int) -> str:
    """How `engine` reads ids of which some name no state of the target, in the user's own
    numbers ("" where none does): the canonical id a conversion refuses was never written."""
    conv = CONVENTION[engine]
    outputs = conv in (Convention.CANONICAL, Convention.SGLANG)
    lo, hi = (-1, num_layers - 1) if outputs else (0, num_layers)
    bad = [i for i in written if not lo <= i <= hi]
    if not bad:
        return ""
    how = "outputs" if outputs else "inputs"
    words = (f"{READS[engine]} reads {list(written)} as the {how} of layers {list(written)}"
             f": id{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} "
             f"{'are' if len(bad) > 1 else 'is'} out of range for this target ({num_layers} "
             "layers: it would fail to load the drafter)")
    if -1 in bad:
        words += "; the embedding output is id 0 for vLLM; SGLang cannot capture it"
    return words


def vllm_fallback(nested: list[int], num_layers: int, key: str) -> Feed:
    """No top-level ids (or an empty list) but nested ones: vLLM then reads eagle_config's list,
    in its own convention (input of layer j); versions without that fallback use the target's
    defaults."""
    feed = feed_from_written(nested, "vllm", num_layers, key)
    older = engine_defaults(num_layers)
    if feed.canonical != older:
        feed.version_dependent = True
        feed.note = "; ".join(filter(None, [feed.note, (
            f"version dependent: vLLM reads eagle_config's {nested} as inputs of those layers "
            f"(canonical {feed.canonical}) when the top-level key is missing or empty; versions "
            f"before that fallback use the target's defaults (canonical {older}, vLLM issue "
            "50170)")]))
    return feed


def feed_from_import(config: dict[str, Any], layout: str, num_layers: int, where: str) -> Feed:
    """What `draftsmith import` (and the doctor's and compare's own runs, which load through it)
    makes of an exported folder's ids: `export.layout.imported_ids`, the engines' defaults when
    the folder names none."""
    try:
        written, key, _ = engine_ids(config, layout, num_layers, where)
        key = f"{key} in {where}, as `draftsmith import` reads it"
        ids = imported_ids(config, layout, num_layers, "")
    except DraftsmithError as e:
        return Feed("draftsmith", where, None, None, str(e))
    missing = "key missing: `draftsmith import` takes the engines' defaults"
    note = "" if written else "; ".join(filter(None, [missing, default_repeat(num_layers)]))
    return Feed("draftsmith", key, written, ids, note)


def what_to_write(true_ids: list[int], engine: str, num_layers: int) -> tuple[list[int] | None,
                                                                               str]:
    """(ids to write for `engine` so it feeds `true_ids`, or None; words for the fix)."""
    key = KEY[engine]
    if engine != "draftsmith" and list(true_ids) != sorted(true_ids):
        return None, (
            f"the drafter was trained on layers {true_ids} in that order, but {engine} feeds "
            f"them ascending: permute the {len(true_ids)} column blocks of fc.weight to "
            f"ascending layer order (no retraining), then write the sorted ids"
        )
    if engine != "draftsmith" and len(set(true_ids)) < len(true_ids):
        return None, (f"canonical layers {list(true_ids)} repeat a layer, which {engine} "
                      f"captures once (its fc would get {len(set(true_ids))} states, not "
                      f"{len(true_ids)}): no ids written for it feed them; "
                      + _retrain(engine, num_layers, len(true_ids)))
    limits = _limits(true_ids, engine, num_layers)
    if limits:
        return None, (f"{engine} cannot capture canonical layers {true_ids} ({'; '.join(limits)})"
                      ": " + _retrain(engine, num_layers, len(true_ids)))
    written = to_convention(true_ids, CONVENTION[engine], num_layers)
    return written, f"write {key}: {written}"


def _limits(ids: list[int], engine: str, num_layers: int) -> list[str]:
    """Why `engine` cannot be given canonical `ids` (none: it can); each reason once."""
    limits = engine_limits(ids, num_layers) if engine.startswith("sglang") else []
    try:
        to_convention(ids, CONVENTION[engine], num_layers)
    except DraftsmithError as e:
        if not (limits and "-1" in str(e)):  # the embedding is named by engine_limits already
            limits.append(str(e))
    return limits


def capturable_ids(engine: str, num_layers: int, n: int) -> list[int] | None:
    """`n` distinct ascending canonical ids `engine` can be given for this target: data
    capture's default where it fits, else `n` spread over the widest range it captures; None
    where the target has too few such layers."""
    first = default_aux_layers(num_layers) if num_layers >= 2 else []  # 1 layer: no default
    if len(first) == n and not _limits(first, engine, num_layers):
        return first
    for lo, hi in sorted(((lo, hi) for lo in (-1, 0, 1) for hi in (num_layers - 1,
                          num_layers - 2)), key=lambda r: r[0] - r[1]):
        span = hi - lo
        if span + 1 < n:
            continue
        ids = [lo + k * span // max(n - 1, 1) for k in range(n)]
        if not _limits(ids, engine, num_layers):
            return ids
    return None


def _retrain(engine: str, num_layers: int, n: int) -> str:
    ids = capturable_ids(engine, num_layers, n)
    if ids is None:
        return (f"{engine} cannot be given {n} distinct layers of this {num_layers}-layer "
                "target: serve the drafter with vLLM (`draftsmith export --format speculators`)"
                if engine.startswith("sglang") else
                f"this {num_layers}-layer target has fewer than {n} layers to feed")
    return ("retrain on distinct layers it can capture, e.g. `draftsmith data capture "
            f"--aux-layers {','.join(map(str, ids))}`")
