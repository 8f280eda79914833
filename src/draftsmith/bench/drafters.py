"""The drafter a benchmark runs: a draftsmith drafter folder, or a random one (machinery check)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import draftsmith
from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

PACKAGE = Path(draftsmith.__file__).parent


def get_drafter(spec: str, target: Any, model: Any) -> tuple[Eagle3Drafter, list[str]]:
    p = model.embed.weight
    if not spec:
        raise DraftsmithError("give --drafter DIR (a draftsmith drafter folder) or 'random'")
    if spec == "random":
        warn = "a random drafter: acceptance is near zero; this measures the machinery only"
        return random_drafter(target.cfg, p.device, p.dtype, p), [warn]
    from draftsmith.models.eagle3 import load_drafter

    folder = Path(spec)
    if not folder.is_dir():
        raise DraftsmithError(f"--drafter {folder}: not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter = load_drafter(folder, p.device, p.dtype, embed=p)
    said = _own_warnings(caught)
    from draftsmith.engine.speculative import other_target

    if other := other_target(drafter.cfg, target.fingerprint):
        said.append(other)
    return drafter.eval(), said


def _own_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """draftsmith's warnings, each once, for meta.warnings (the run says them); a library's
    passed on as raised."""
    own = []
    for w in caught:
        if Path(w.filename).is_relative_to(PACKAGE):
            own.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return list(dict.fromkeys(own))


def random_drafter(cfg: Any, device: torch.device, dtype: torch.dtype,
                   embed: torch.Tensor | None = None, seed: int = 0) -> Eagle3Drafter:
    dcfg = Eagle3Config.for_target(cfg, min(cfg.vocab_size, 32000),
                                   default_aux_layers(cfg.num_layers))
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Drafter(dcfg)
    with torch.no_grad():
        for p in d.parameters():
            rand = torch.randn(p.shape, generator=g) * 0.02
            p.copy_(torch.ones_like(p) if p.dim() == 1 else rand)
        if embed is not None:
            d.embed_tokens.weight.copy_(embed)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: dcfg.draft_vocab_size] = True
        d.set_vocab(torch.zeros(dcfg.draft_vocab_size, dtype=torch.long), t2d)
    d.to(device=device, dtype=dtype)
    d.inv_freq = torch.tensor(d.lc.inv_freq(), device=device)
    return d.eval()
