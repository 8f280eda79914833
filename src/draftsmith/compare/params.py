"""Parameter counts under each convention people publish, from safetensors headers alone.

The frozen embedding is the target's: some layouts store it (draftsmith, speculators), SGLang's
drops it. `all` counts it either way, `stored` counts what the files hold. The lm_head is what
the engine serves: a tied SGLang folder's is its embedding (counted once, and frozen), an
untied one without draft_vocab_size serves the target's, and vLLM shares the target's with a
speculators folder that stores none (`HEADS`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError

BUFFERS = ("d2t", "t2d")
CONVENTIONS = {
    "stored": "every tensor in the files (d2t/t2d buffers included)",
    "all": "all parameters, the frozen embedding counted (stored or not)",
    "trainable": "all but the frozen embedding (lm_head counted)",
    "core": "without the embedding and lm_head (fc, decoder layer(s), norms)",
}
# where the lm_head an engine serves comes from -> how the tables say it
HEADS = {"stored": "",
         "tied": "tied: the embedding serves as lm_head (counted once, frozen)",
         "target": "the target's lm_head, not stored (SGLang loads it from the target)",
         "shared": "the target's lm_head, not stored (vLLM shares the target's)",
         "shared_misfit": "none stored: vLLM shares the target's lm_head and keeps its first "
                          "N logits, target ids 0..N-1, but d2t maps the draft ids away from "
                          "0..N-1, so it does not fit the smaller draft vocabulary (it would "
                          "draft wrong tokens; store the drafter's own lm_head)"}
TAKEN = ("target", "shared", "shared_misfit")  # heads served from the target: vocab x hidden


@dataclass
class ParamCounts:
    stored: int
    all: int
    trainable: int
    core: int
    embedding: int
    lm_head: int
    buffers: int
    embedding_stored: bool
    bytes_on_disk: int
    lm_head_source: str = "stored"  # a key of HEADS

    def by_convention(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in CONVENTIONS}

    def to_dict(self) -> dict[str, int | bool]:
        return dict(vars(self))


def kind(name: str) -> str:
    base = name.removeprefix("model.")
    if base in BUFFERS:
        return "buffer"
    if base.startswith("embed_tokens."):
        return "embedding"
    if base.startswith("lm_head."):
        return "lm_head"
    if base.startswith("verifier_"):
        return "verifier"
    return "core"


def count(shapes: dict[str, tuple[int, ...]], vocab: int, hidden: int,
          bytes_on_disk: int, head: str = "stored") -> ParamCounts:
    """shapes: tensor name -> shape; vocab, hidden: the drafter's (for an absent embedding or a
    head the engine takes from the target); head: where its served lm_head comes from (HEADS)."""
    sums = {"buffer": 0, "embedding": 0, "lm_head": 0, "core": 0, "verifier": 0}
    for name, shape in shapes.items():
        sums[kind(name)] += math.prod(shape)
    stored = sum(sums.values())
    has_embed = sums["embedding"] > 0
    embedding = sums["embedding"] if has_embed else vocab * hidden
    lm_head = vocab * hidden if head in TAKEN else {"stored": sums["lm_head"],
                                                     "tied": embedding}[head]
    # tied: the head is the frozen embedding itself, in neither `trainable` nor twice in `all`
    trainable = sums["core"] + (0 if head == "tied" else lm_head)
    return ParamCounts(stored, trainable + embedding, trainable, sums["core"], embedding,
                       lm_head, sums["buffer"], has_embed, bytes_on_disk, head)


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_number(text: str) -> float:
    """'1e9', '1B', '2.6b', '500M', '1,200,000' -> float; a comma that groups no thousands
    ('1,5B', a decimal comma) refused, not dropped."""
    t = text.strip().lower().replace("_", "")
    m = re.fullmatch(r"([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)", t.replace(",", "")) \
        if "," not in t or _thousands(t) else None
    try:
        value = float(m.group(1)) * _SUFFIX[m.group(2)] if m else math.nan
    except ValueError:  # '1.2.3', '.'
        value = math.nan
    if not math.isfinite(value):
        raise DraftsmithError(f"{text!r}: not a number (try 1e9, 1.2B, 500M)")
    return value


def _thousands(t: str) -> bool:
    """Whether every comma in `t` groups the thousands of its whole part ('1,200,000.5')."""
    m = re.match(r"\d{1,3}(,\d{3})+(?![\d,])", t)
    return m is not None and "," not in t[m.end():]


def likely_convention(claimed: float, counts: ParamCounts) -> tuple[str, int, float]:
    """(convention whose count is nearest to `claimed` in log scale, that count, relative gap)."""
    options = counts.by_convention()
    name = min(options, key=lambda k: abs(math.log(max(options[k], 1) / claimed)))
    return name, options[name], options[name] / claimed - 1.0


def human(n: float) -> str:
    """3 significant figures in the largest unit the rounded count reaches: 999,600 is 1M,
    not 1e+03K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(float(f"{n:.3g}")) >= size:
            return f"{float(f'{n / size:.3g}'):g}{unit}"
    return f"{n:.0f}"
