"""Which hidden states a dataset really holds: every stored tensor against every live layer.

A few samples go through the live target with every residual stream captured (embedding output,
each decoder layer's output) plus the final normed hidden, and each layer's parts: its stream after
the attention's residual add, before the MLP (SGLang's `residual` alone), and its MLP's output
(SGLang's `hidden_states` alone), both easy to store instead of their sum. Each stored aux slot and
the stored final hidden is compared with each of those rows per token (relative error, cosine);
the median over tokens is robust to attention-sink tokens whose norms dwarf the rest. A slot is
matched among the residual rows as before; a part row takes it only where it is clearly closer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.doctor.realign import Paired, Subset, screened, views
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS

TOL = 0.05  # median relative error of a clear match (bf16 storage alone gives ~0.004)
LOOSE = 0.25  # a nearest layer this close with a clear margin still counts, with a warning
MARGIN = 2.0  # the runner-up must be at least this many times further than the best
# a layer's parts, as rows after the residual ones: (kind, row name suffix, slot status)
PARTS = (("after attention", "after attention", "mid-layer"),
         ("MLP output", "MLP output alone", "mlp-output"))
# a state after one of a layer's norms (what its attention or MLP reads): compared apart from
# the rows, named only for a slot that matches no row
NORMS = ("input norm", "post-attention norm")


@dataclass
class SlotMatch:
    slot: str  # "aux[k]" or "hidden"
    claimed: int | None  # what the manifest says (canonical); None for the final hidden
    best_row: int  # index into MatchMatrix.rows
    rel: float
    cos: float
    runner_up_rel: float
    status: str  # exact | approximate | tied | ambiguous | none | nonfinite, or PARTS' status
    tied: list[int] = field(default_factory=list)  # rows as close as the best (it included)
    residual_row: int | None = None  # for a part's match: the nearest residual row (runner-up)
    normed: int | None = None  # for status "normed": the index into MatchMatrix.normed_rows

    @property
    def matched(self) -> bool:
        return self.status in ("exact", "approximate", "tied")


@dataclass
class MatchMatrix:
    rows: list[str]  # "embedding", "layer 0", ..., "final norm", then each layer's parts
    row_ids: list[int | None]  # canonical id of each row; None for the final norm and parts
    cols: list[str]
    rel: torch.Tensor  # [rows, cols] median per-token relative error
    cos: torch.Tensor  # [rows, cols] mean per-token cosine
    tokens: int
    samples: list[int]
    token_set: str  # "loss-masked" or "all"
    slots: list[SlotMatch]
    nonfinite: list[int] = field(default_factory=list)  # per column: tokens holding NaN/inf
    sample_tokens: int = 0  # every token of the compared samples (nonfinite counts over these)
    row_kinds: list[str] = field(default_factory=list)  # "residual", "final norm", PARTS' kinds
    row_layers: list[int | None] = field(default_factory=list)  # the layer a part row is of
    normed_rows: list[str] = field(default_factory=list)  # `normed_names`
    normed_rel: torch.Tensor | None = None  # [normed rows, cols] median relative error
    token_shift: int | None = None  # the stored ids lie this many tokens off the states
    dropped: tuple[int, ...] = ()  # the first tokens put back where the ids run ahead
    paired: dict[int, int] = field(default_factory=dict)  # sample -> the one its states are of

    def true_ids(self) -> list[int | None]:
        """Canonical id each aux slot best matches (None: the final norm or no clear match)."""
        return [self.row_ids[s.best_row] if s.matched else None for s in self.slots[:-1]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "convention": CANONICAL_WORDS,
            "rows": self.rows, "row_ids": self.row_ids, "row_kinds": self.row_kinds,
            "row_layers": self.row_layers, "cols": self.cols,
            "rel_err": _rounded(self.rel), "cosine": _rounded(self.cos),
            "tokens": self.tokens, "samples": self.samples, "token_set": self.token_set,
            "sample_tokens": self.sample_tokens,
            "slots": [
                {"slot": s.slot, "claimed": s.claimed, "best": self.rows[s.best_row],
                 "best_id": self.row_ids[s.best_row], "best_kind": self.row_kinds[s.best_row],
                 "rel_err": _finite(s.rel),
                 "cosine": _finite(s.cos), "runner_up_rel_err": _finite(s.runner_up_rel),
                 "status": s.status, "tied_ids": [self.row_ids[i] for i in s.tied],
                 "nonfinite_tokens": self.nonfinite[k] if self.nonfinite else 0,
                 "nearest_residual": None if s.residual_row is None
                 else self.rows[s.residual_row],
                 "normed": None if s.normed is None else self.normed_rows[s.normed]}
                for k, s in enumerate(self.slots)
            ],
            "true_ids": self.true_ids(), "token_shift": self.token_shift,
            "states_of_sample": {str(i): j for i, j in self.paired.items()} or None,
        }


def normed_names(num_layers: int) -> list[str]:
    """The normed states compared besides the rows: each layer's input norm's output (its
    attention's input), then each layer's post-attention norm's output (its MLP's input)."""
    return [f"layer {j} {norm} output" for norm in NORMS for j in range(num_layers)]


def _rounded(t: torch.Tensor) -> list[list[float | None]]:
    return [[_finite(round(float(x), 5)) for x in row] for row in t]


def _finite(x: float) -> float | None:
    """None for NaN/inf: strict JSON readers (jq, JavaScript) refuse those literals."""
    return x if math.isfinite(x) else None


def pick_samples(n_total: int, n: int) -> list[int]:
    """`n` indices spread evenly over the dataset (first and last included)."""
    if n >= n_total:
        return list(range(n_total))
    if n <= 1:
        return [0]
    return sorted({round(i * (n_total - 1) / (n - 1)) for i in range(n)})


def row_names(num_layers: int) -> tuple[list[str], list[int | None], list[str],
                                           list[int | None]]:
    """Every live row's name, canonical id, kind and (for a part) layer, in match's order."""
    rows = ["embedding"] + [f"layer {j}" for j in range(num_layers)] + ["final norm"]
    ids: list[int | None] = [*range(-1, num_layers), None]
    kinds = ["residual"] * (num_layers + 1) + ["final norm"]
    layers: list[int | None] = [None] * (num_layers + 2)
    for kind, suffix, _ in PARTS:
        rows += [f"layer {j} {suffix}" for j in range(num_layers)]
        ids += [None] * num_layers
        kinds += [kind] * num_layers
        layers += list(range(num_layers))
    return rows, ids, kinds, layers


@contextmanager
def _parts_tapped(model: Any, keep: Callable[[str, int, torch.Tensor], None]) -> Iterator[None]:
    """Hand each layer's stream after attention (the post-attention norm's input), its MLP's
    output and its two norms' outputs to `keep` during one eager forward (the doctor's: no
    fused norms)."""
    kind_mid, kind_mlp = PARTS[0][0], PARTS[1][0]
    handles = []
    for j, layer in enumerate(model.layers):
        handles.append(layer.post_norm.register_forward_pre_hook(
            lambda _m, args, j=j: keep(kind_mid, j, args[0])))
        handles.append(layer.mlp.register_forward_hook(
            lambda _m, _args, out, j=j: keep(kind_mlp, j, out)))
        for norm, module in zip(NORMS, (layer.input_norm, layer.post_norm), strict=True):
            handles.append(module.register_forward_hook(
                lambda _m, _args, out, j=j, norm=norm: keep(norm, j, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def live_errors(model: Any, input_ids: torch.Tensor, stored: torch.Tensor,
                num_layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """stored [T, C, H] against every live row (`row_names`' order) -> relative error and
    cosine [T, R, C], and the relative error against each normed state (`normed_names`' order)
    [T, N, C]. The parts are compared as the forward makes them: no [T, 3L, H] copy."""
    dev = next(model.parameters()).device
    t = input_ids.numel()
    parts: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(kind: str, j: int, x: torch.Tensor) -> None:
        parts[kind, j] = token_errors(stored, x[0, :, None].float().cpu())

    with _parts_tapped(model, keep):
        fo = model(input_ids.view(1, t).to(dev), torch.arange(t, device=dev).view(1, t),
                   aux_ids=tuple(range(-1, num_layers)), want_logits=False)
    if len(parts) != (len(PARTS) + len(NORMS)) * num_layers:
        raise DraftsmithError(f"the live target ran {len(parts)} of its "
                              f"{(len(PARTS) + len(NORMS)) * num_layers} layer parts (a fused "
                              "forward?)")
    rel, cos = token_errors(stored, torch.cat([fo.aux[0], fo.hidden[0][:, None]], 1).float()
                            .cpu())
    order = [parts[kind, j] for kind, _, _ in PARTS for j in range(num_layers)]
    normed = [parts[norm, j][0] for norm in NORMS for j in range(num_layers)]
    return (torch.cat([rel, *(r for r, _ in order)], 1),
            torch.cat([cos, *(c for _, c in order)], 1), torch.cat(normed, 1))


def token_errors(stored: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """stored [T, C, H], live [T, R, H] -> per-token relative error and cosine [T, R, C]."""
    rel, cos = [], []
    live_norm = live.norm(dim=-1).clamp(min=1e-12)
    for c in range(stored.shape[1]):
        s = stored[:, c : c + 1].float()
        rel.append((s - live).norm(dim=-1) / live_norm)
        cos.append(torch.nn.functional.cosine_similarity(s, live, dim=-1))
    return torch.stack(rel, -1), torch.stack(cos, -1)


def match(
    model: Any,
    dataset: Any,
    num_layers: int,
    n_samples: int = 4,
    max_tokens: int = 256,
    loss_only: bool = True,
    first_ids: tuple[int, ...] = (),
    lead: tuple[int, ...] = (),
) -> MatchMatrix:
    """`first_ids`: tokens a sample may begin with (BOS, the chat template's first), tried as
    the token dropped from ids stored one ahead of their states; `lead`: the chat template's
    opening tokens, whose first k are tried as those dropped from ids stored k ahead."""
    mm = _match(model, dataset, num_layers, n_samples, max_tokens, loss_only)
    if all(s.status in ("exact", "tied", "nonfinite") for s in mm.slots):
        return mm
    if _unmatched(mm) and (shifted := _realigned(model, dataset, num_layers, n_samples,
                                                  max_tokens, loss_only, first_ids, lead)):
        return shifted
    if mm.slots[-1].status == "exact":  # the final hidden is each sample's own: no mixup
        return mm
    pairs = _mixups(model, dataset, mm.samples, max_tokens)
    if not pairs:
        return mm
    paired = _match(model, Paired(dataset, pairs), num_layers, len(pairs), max_tokens,
                    loss_only)
    paired.samples, paired.paired = list(pairs), pairs
    return paired


def _realigned(model: Any, dataset: Any, num_layers: int, n_samples: int, max_tokens: int,
               loss_only: bool, first_ids: tuple[int, ...],
               lead: tuple[int, ...]) -> MatchMatrix | None:
    """The match of the first realignment whose states all match, probed on the longest
    compared sample (None: none does)."""
    idx = pick_samples(len(dataset), n_samples)
    i = max(idx, key=lambda j: int(dataset[j]["input_ids"].numel()))
    for view in screened(model, dataset[i], views(dataset, first_ids, lead), num_layers, LOOSE):
        try:
            probe = _match(model, Subset(view, [i]), num_layers, 1, min(max_tokens, 64),
                           loss_only)
            if not _all_matched(probe):
                continue
            shifted = _match(model, view, num_layers, n_samples, max_tokens, loss_only)
        except (RuntimeError, ValueError, IndexError):  # a view some sample cannot be read in
            continue
        if _all_matched(shifted):  # not the probe sample's alone
            shifted.token_shift, shifted.dropped = view.by, view.first
            return shifted
    return None


def _all_matched(mm: MatchMatrix) -> bool:
    """Some aux slot and the final hidden match a live state."""
    return not _unmatched(mm) and mm.slots[-1].matched


NEIGHBOURS = 4  # other samples tried as the one a sample's states were captured from


@torch.no_grad()
def _mixups(model: Any, dataset: Any, idx: list[int], max_tokens: int) -> dict[int, int]:
    """Compared sample -> the sample whose tokens its stored states clearly make where its own
    do not (states paired with another conversation's tokens: sample ids shuffled), judged past
    the opening both share (the template's, whose states any sample makes) by its first aux
    slot and its final hidden (`_source_errors`), so a final hidden stored before the norm
    still pairs."""
    out = {}
    for i in idx:
        s = dataset[i]
        n = min(max_tokens, int(s["input_ids"].numel()))
        stored = torch.stack([s["aux"][:n, 0], s["hidden"][:n]], 1) if s["aux"].shape[1] \
            else s["hidden"][:n, None]
        own = _source_errors(model, s["input_ids"][:n], stored)
        if _best(own) <= TOL:
            continue
        for j in _candidates(i, idx, len(dataset)):
            ids = dataset[j]["input_ids"]
            m = min(n, int(ids.numel()))
            p = _shared(s["input_ids"][:m], ids[:m])
            if p == m:  # j's tokens are i's own opening: nothing tells them apart
                continue
            e = _best(_source_errors(model, ids[:m], stored[:m])[p:])
            if e <= TOL and _clear(_best(own[p:m]), e):
                out[i] = j
                break
        else:  # no shuffle nearby: more samples would cost forwards of a target found wrong
            return out
    return out


def _shared(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first tokens `a` and `b` (of one length) share."""
    differ = (a != b).nonzero()
    return int(differ[0]) if differ.numel() else int(a.numel())


def _best(rel: torch.Tensor) -> float:
    """The least median over tokens of any stored column against any live row [T, R, C]."""
    return float(rel.nan_to_num(math.inf).median(0).values.min()) if rel.numel() else math.inf


def _candidates(i: int, idx: list[int], total: int) -> list[int]:
    near = [i + 1, i - 1, i + 2, i - 2, *idx]
    return [j for j in dict.fromkeys(near) if j != i and 0 <= j < total][:NEIGHBOURS + len(idx)]


def _source_errors(model: Any, ids: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per-token relative error [T, R, C] of stored states [T, C, H] (an aux slot, the final
    hidden) against every live residual row and the final hidden of `ids`: the forward the
    final hidden alone needs, its rows kept."""
    dev = next(model.parameters()).device
    t = ids.numel()
    fo = model(ids.view(1, t).to(dev), torch.arange(t, device=dev).view(1, t),
               aux_ids=tuple(range(-1, len(model.layers))), want_logits=False)
    live = torch.cat([fo.aux[0], fo.hidden[0][:, None]], 1).float().cpu()
    rel, _ = token_errors(stored.float(), live)
    return rel


def _unmatched(mm: MatchMatrix) -> bool:
    """No stored state matches a live one: the final hidden and every aux slot (other
    targets' data, or ids stored off their states)."""
    return all(s.status in ("none", "ambiguous") for s in mm.slots)


def _match(model: Any, dataset: Any, num_layers: int, n_samples: int, max_tokens: int,
           loss_only: bool) -> MatchMatrix:
    idx = pick_samples(len(dataset), n_samples)
    rels, coss, norms, masked, bad, total = [], [], [], [], 0, 0
    for i in idx:
        s = dataset[i]
        if not s["input_ids"].numel():  # realigned by more than its length: nothing to compare
            continue
        full = torch.cat([s["aux"], s["hidden"][:, None]], 1)
        ok = full.isfinite().all(-1)  # [T, C]: a stored state with NaN/inf compares with nothing
        bad, total = bad + (~ok).sum(0), total + int(ok.shape[0])
        n = min(max_tokens, int(s["input_ids"].numel()))  # causal: a prefix is exact
        r, c, nr = live_errors(model, s["input_ids"][:n], full[:n], num_layers)
        rels.append(r.masked_fill(~ok[:n, None], math.nan))
        coss.append(c.masked_fill(~ok[:n, None], math.nan))
        norms.append(nr.masked_fill(~ok[:n, None], math.nan))
        masked.append(s["loss_mask"][:n].bool())
    rel, cos, normed, mask = torch.cat(rels), torch.cat(coss), torch.cat(norms), torch.cat(masked)
    use_mask = loss_only and bool(mask.any())
    if use_mask:
        rel, cos, normed = rel[mask], cos[mask], normed[mask]
    claimed = list(dataset.manifest.get("aux_layer_ids") or [])
    n_aux = rel.shape[-1] - 1
    cols = [f"aux[{k}]" for k in range(n_aux)] + ["hidden"]
    rows, row_ids, kinds, layers = row_names(num_layers)
    med, mean_cos, normed_med = rel.nanmedian(0).values, cos.nanmean(0), normed.nanmedian(0).values
    said = [claimed[k] if k < len(claimed) and k < n_aux else None for k in range(n_aux + 1)]
    main = num_layers + 2  # the residual rows and the final norm; the parts follow
    slots = []
    for k in range(n_aux + 1):
        at = row_ids.index(said[k]) if said[k] in row_ids[:main - 1] else None
        m = _verdict(cols[k], said[k], med[:main, k], mean_cos[:main, k], at)
        m = _part_verdict(m, med[:, k], mean_cos[:, k], main, kinds)
        slots.append(_normed_verdict(m, normed_med[:, k], num_layers) if k < n_aux else m)
    return MatchMatrix(rows, row_ids, cols, med, mean_cos, int(rel.shape[0]), idx,
                       "loss-masked" if use_mask else "all", slots,
                       [int(x) for x in bad], total, kinds, layers, normed_names(num_layers),
                       normed_med)


def _part_verdict(m: SlotMatch, rel: torch.Tensor, cos: torch.Tensor, main: int,
                  kinds: list[str]) -> SlotMatch:
    """`m` (the residual rows' verdict), or the part row clearly closer than any residual row:
    on deep targets a layer's stream after attention lies near its output and read as it."""
    if m.status == "nonfinite" or rel.numel() <= main:
        return m
    part = rel[main:].nan_to_num(math.inf)
    best = main + int(part.argmin())
    b = float(rel[best])
    if not (b <= LOOSE and _clear(m.rel, b)):
        return m
    status = next(st for kind, _, st in PARTS if kind == kinds[best])
    return SlotMatch(m.slot, m.claimed, best, round(b, 6), round(float(cos[best]), 6),
                     m.rel, status, [], m.best_row)


def _normed_verdict(m: SlotMatch, rel: torch.Tensor, num_layers: int) -> SlotMatch:
    """`m`, or for a slot that matches no row, the normed state it clearly holds (a capture
    hooked on what a layer's attention or MLP reads, after the norm): the rows' scale is the
    residual stream's, so such a slot was read as data of another target. Its row is the state
    the norm read: the stream entering that layer, or the layer's stream after attention."""
    if m.status not in ("none", "ambiguous") or not rel.numel():
        return m
    errs = rel.nan_to_num(math.inf)
    order = torch.argsort(errs)
    best, b = int(order[0]), float(errs[order[0]])
    runner = float(errs[order[1]]) if errs.numel() > 1 else math.inf
    if not (b <= LOOSE and _clear(runner, b) and _clear(m.rel, b)):
        return m
    post, j = divmod(best, num_layers)
    row = num_layers + 2 + j if post else j  # the "after attention" part row, or layer j - 1
    return SlotMatch(m.slot, m.claimed, row, round(b, 6), math.nan, round(runner, 6), "normed",
                     [], None, best)


def _verdict(col: str, claimed: int | None, rel: torch.Tensor, cos: torch.Tensor,
             claimed_row: int | None = None) -> SlotMatch:
    order = torch.argsort(rel)
    best = int(order[0])
    b = float(rel[best])
    if math.isnan(b):  # every stored state of this slot holds NaN/inf: nothing to match
        row = claimed_row if claimed_row is not None else rel.numel() - 1
        return SlotMatch(col, claimed, row, math.nan, math.nan, math.nan, "nonfinite")
    r = float(rel[order[1]]) if rel.numel() > 1 else float("inf")
    tied = [int(i) for i in order if not _clear(float(rel[i]), b)]
    clear = len(tied) == 1  # two layers of equal states (both 0) are no match
    if not clear and claimed_row in tied and float(rel[claimed_row]) <= TOL:
        # layers whose states are near-identical here: feeding any of them feeds the same
        best, status = claimed_row, "tied"
    elif b <= TOL and clear:
        status = "exact"
    elif b <= LOOSE and clear:
        status = "approximate"
    elif b <= LOOSE:
        status = "ambiguous"
    else:
        status = "none"
    return SlotMatch(col, claimed, best, round(float(rel[best]), 6), round(float(cos[best]), 6),
                     round(r, 6), status, [] if clear else sorted(tied))


def _clear(x: float, best: float) -> bool:
    """A row with relative error `x` is clearly further than the best's."""
    return x >= MARGIN * best and x > best
