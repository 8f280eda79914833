"""The aux-hidden-state layer convention: the only place that converts layer ids.

Canonical form: id j is the output of decoder layer j (0-based); -1 is the embedding output.
The tensor is always the pre-norm residual stream. Every other convention is converted here.
"""

from __future__ import annotations

import re
from enum import Enum
from numbers import Integral
from typing import Any

from draftsmith.errors import DraftsmithError

CANONICAL_WORDS = "output of decoder layer j (0-based); -1 = embedding output"


class Convention(str, Enum):
    CANONICAL = "draftsmith"
    EAGLE = "eagle"  # SafeAILab reference: input of layer j
    VLLM = "vllm"  # input of layer j; 0 = embedding, L = final layer output
    SPECULATORS = "speculators"  # as vLLM
    # SGLang's Llama/Qwen/Mistral classes: explicit ids are outputs of layer j (it adds 1) on
    # every version; PR #25454's "add 1 only when ids[0] == 1" changed the DeepSeek-V2 family
    SGLANG = "sglang"
    SGLANG_LEGACY = "sglang-legacy"  # an older name kept for records: the same reading
    SPECFORGE = "specforge"  # output of layer j (forward hooks)
    MODELOPT = "modelopt"  # output of layer j


_OUTPUT_OF = {
    Convention.CANONICAL,
    Convention.SGLANG,
    Convention.SGLANG_LEGACY,
    Convention.SPECFORGE,
    Convention.MODELOPT,
}

WORDS = {
    Convention.CANONICAL: CANONICAL_WORDS,
    Convention.EAGLE: "input of decoder layer j (EAGLE reference code)",
    Convention.VLLM: "input of decoder layer j (vLLM); 0 = embedding, L = final layer output",
    Convention.SPECULATORS: "input of decoder layer j (speculators, as vLLM)",
    Convention.SGLANG: "output of decoder layer j (SGLang's Llama/Qwen/Mistral classes add 1)",
    Convention.SGLANG_LEGACY: "output of decoder layer j (SGLang's Llama/Qwen/Mistral classes "
                              "add 1)",
    Convention.SPECFORGE: "output of decoder layer j (SpecForge forward hooks)",
    Convention.MODELOPT: "output of decoder layer j (NVIDIA Model Optimizer)",
}


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's usual low/mid/high choice, canonical: outputs of 1, L//2-1, L-4. EAGLE-3
    fuses three states, so a short target gets three distinct ids all the same: on 2-3 layers
    [-1, 0, 1] (what vLLM's default 2, L//2, L-3 means on 3 layers); one layer has only two."""
    if num_layers < 1:  # only the embedding: -1,0 would name a layer it lacks
        raise DraftsmithError(
            f"a {num_layers}-layer target has no decoder layer, so no aux layers to capture: "
            "use a target with 2 or more layers")
    if num_layers < 2:
        raise DraftsmithError(
            f"a {num_layers}-layer target has fewer than the three hidden states EAGLE-3 "
            "fuses, so no default aux layers: give --aux-layers -1,0 to use the two it has")
    if num_layers < 4:
        return [-1, 0, 1]
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 5 or len(set(ids)) < 3:  # e.g. L=6 would give [1, 2, 2]
        ids = sorted({0, max(0, num_layers // 2 - 1), max(0, num_layers - 2)})
        return validate(ids, num_layers)
    return ids


def parse_ids(text: str | None, flag: str = "--aux-layers") -> list[int] | None:
    """'1,14,26' -> [1, 14, 26]; None or '' -> None (the default ids)."""
    if not text:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    # int() read "1_0" as 10 and other scripts' digits as ASCII ones; "1 2" is no id, not 12
    ok = items and all(re.fullmatch(r"[+-]?[0-9]+", x) for x in items)
    ids = [int(x) for x in items] if ok else []
    if not ids:  # ' ' or ',' is no list of ids, not the defaults
        raise DraftsmithError(f"{flag} {text!r}: expected comma-separated integers")
    return ascending(ids, flag)


def ascending(ids: list[int], flag: str = "--aux-layers") -> list[int]:
    """`ids` if strictly ascending. Data is captured in the order given, and a drafter's fc
    learns that order, but SGLang and vLLM feed the states ascending: `export` would refuse it."""
    if len(set(ids)) < len(ids):
        raise DraftsmithError(f"{flag}: aux layer ids {ids} repeat a layer: give "
                              f"{flag} {','.join(map(str, sorted(set(ids))))}")
    if ids != sorted(ids):
        raise DraftsmithError(
            f"{flag}: aux layer ids {ids} are not ascending; SGLang and vLLM feed captured "
            f"states in ascending layer order, so `draftsmith export` would refuse a drafter "
            f"trained on them: give {flag} {','.join(map(str, sorted(ids)))}")
    return ids


def whole(ids: list[Any]) -> list[int]:
    """`ids` as ints; True, 1.5 or "1" refused, not read as layer 1."""
    if not all(isinstance(i, Integral) and not isinstance(i, bool) for i in ids):
        raise DraftsmithError(f"aux layer ids {list(ids)!r} are not all whole numbers: give "
                              "integer layer ids")
    return [int(i) for i in ids]


def convention(conv: Convention | str) -> Convention:
    try:
        return Convention(conv)
    except ValueError:
        raise DraftsmithError(f"unknown aux layer convention {conv!r}: use one of "
                              f"{', '.join(c.value for c in Convention)}") from None


def validate(ids: list[int], num_layers: int) -> list[int]:
    ids = whole(ids)
    if not ids:
        raise DraftsmithError("aux layer ids: the list is empty")
    bad = [i for i in ids if i < -1 or i >= num_layers]
    if bad:
        raise DraftsmithError(
            f"aux layer ids {bad} out of range: canonical ids ({CANONICAL_WORDS}) "
            f"must lie in [-1, {num_layers - 1}] for a target with {num_layers} layers"
        )
    return ids


def to_convention(ids: list[int], conv: Convention | str, num_layers: int) -> list[int]:
    """Canonical ids -> the ids an engine using `conv` must be given."""
    conv = convention(conv)
    ids = validate(ids, num_layers)
    if conv in _OUTPUT_OF:
        return list(ids)
    return [i + 1 for i in ids]


def from_convention(ids: list[int], conv: Convention | str, num_layers: int) -> list[int]:
    """Ids written in `conv` -> canonical ids; ids naming no layer refused as written."""
    conv, ids = convention(conv), whole(ids)
    if conv is Convention.CANONICAL:
        return validate(ids, num_layers)
    lo, hi = (-1, num_layers - 1) if conv in _OUTPUT_OF else (0, num_layers)
    if bad := [i for i in ids if not lo <= i <= hi]:
        raise DraftsmithError(
            f"{conv.value} aux layer ids {bad} out of range: {conv.value} ids ({WORDS[conv]}) "
            f"must lie in [{lo}, {hi}] for a target with {num_layers} layers")
    return validate(ids if conv in _OUTPUT_OF else [i - 1 for i in ids], num_layers)


# SGLang's Qwen2Model loop (Qwen3's subclasses it) appends the embedding where no residual
# exists yet; its Llama loop (Mistral's too) adds a residual that layer 0 lacks.
SGLANG_EMBEDDING_FAMILIES = ("qwen2", "qwen3")


def engine_limits(ids: list[int], num_layers: int, family: str | None = None) -> list[str]:
    """Problems SGLang would have capturing these canonical ids; `family` (the target's HF
    model_type) names the classes that read them, None when unknown."""
    fam = family.lower() if family else None
    notes = []
    if -1 in ids and fam not in SGLANG_EMBEDDING_FAMILIES:
        whose = f"a {fam} target" if fam else "Llama or Mistral targets"
        notes.append(f"id -1 (embedding output): SGLang's capture hook cannot provide it for "
                     f"{whose} (its Qwen2/Qwen3 classes can)")
    if num_layers - 1 in ids:
        notes.append(
            f"id {num_layers - 1} (last layer output): SGLang cannot capture it through its hook"
        )
    return notes
