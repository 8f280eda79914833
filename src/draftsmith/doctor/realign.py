"""Datasets read realigned for the wiring match (`wiring.match`): input_ids shifted against their
states (`Shifted`, `views`), states re-paired with another sample's tokens (`Paired`), and the
screen every shift passes before its probe (`screened`): the first stored states must be those
of the view's own first tokens, so a wrong dropped token is never probed (where the first
tokens weigh little on the rest, as an attention sink's, its probe passed and was named)."""

from __future__ import annotations

from typing import Any

import torch

WIDE_SHIFT = 32  # a chat template's system header (Llama 3.1's default is ~27 tokens)


class Shifted:
    """A dataset read with its input_ids realigned with the states: `by` k > 0, the ids k tokens
    behind (drop the first k ids and the last k states); -k, k ahead (`first` put back in
    front). A sample of at most k tokens reads as its states' first tokens (behind: none)."""

    def __init__(self, dataset: Any, by: int, first: tuple[int, ...] = ()) -> None:
        self.dataset, self.by, self.first, self.manifest = dataset, by, first, dataset.manifest

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = dict(self.dataset[i])
        ids, k, t = s["input_ids"], abs(self.by), int(s["input_ids"].numel())
        if self.by > 0:
            s["input_ids"], s["loss_mask"] = ids[k:], s["loss_mask"][k:]
            s["aux"], s["hidden"] = s["aux"][:max(t - k, 0)], s["hidden"][:max(t - k, 0)]
        else:
            s["input_ids"] = torch.cat([ids.new_tensor(self.first), ids[:max(t - k, 0)]])[:t]
        return s


class Subset:
    """The samples `idx` of a dataset (a probe's)."""

    def __init__(self, dataset: Any, idx: list[int]) -> None:
        self.dataset, self.idx, self.manifest = dataset, idx, dataset.manifest

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.idx[k]]


class Paired:
    """The compared samples whose states another sample's tokens were found to make, each read
    with those tokens (and their loss mask) beside its states."""

    def __init__(self, dataset: Any, pairs: dict[int, int]) -> None:
        self.dataset, self.items, self.manifest = dataset, list(pairs.items()), dataset.manifest

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        i, j = self.items[k]
        s, other = dict(self.dataset[i]), self.dataset[j]
        n = min(int(s["input_ids"].numel()), int(other["input_ids"].numel()))
        s["input_ids"], s["loss_mask"] = other["input_ids"][:n], other["loss_mask"][:n]
        s["aux"], s["hidden"] = s["aux"][:n], s["hidden"][:n]
        return s


def views(dataset: Any, first_ids: tuple[int, ...], lead: tuple[int, ...],
          most: int = WIDE_SHIFT) -> list[Shifted]:
    """The realignments tried, nearest first: ids k tokens behind, then k ahead with each
    candidate for the k tokens dropped (one of `first_ids` before the template's opening)."""
    out = []
    for k in range(1, most + 1):
        out.append(Shifted(dataset, k))
        heads = [(f, *lead[:k - 1]) for f in first_ids] + [lead[:k]]
        out += [Shifted(dataset, -k, h) for h in dict.fromkeys(heads) if len(h) == k]
    return out


@torch.no_grad()
def screened(model: Any, sample: dict[str, torch.Tensor], tried: list[Shifted],
             num_layers: int, tol: float) -> list[Shifted]:
    """`tried`'s views `sample` can be probed in (states left beside their ids) whose first
    stored states some live state of their tokens matches: the states of ids[k] alone (k
    behind), of the k dropped tokens (k ahead). A few forwards of at most WIDE_SHIFT tokens
    for every view, where a probe of each costs a sample's."""
    t = int(sample["input_ids"].numel())
    wide = [v for v in tried if abs(v.by) < t]
    stored = torch.cat([sample["aux"], sample["hidden"][:, None]], 1).float()
    ok = _behind_fits(model, sample["input_ids"], stored[0],
                      [v.by for v in wide if v.by > 0], num_layers, tol)
    heads = _longest_first([v.first for v in wide if v.by < 0])
    live: dict[tuple[int, ...], torch.Tensor] = {}
    for h in heads:  # a shorter head's states are a longer one's first (causal)
        longer = next((x for x in live if x[:len(h)] == h), None)
        states = live[longer][:len(h)] if longer else _live(model, h, num_layers)
        live[h] = states
        if _states_fit(stored[:len(h)], states, tol):
            ok.add(h)
    return [v for v in wide if (v.by if v.by > 0 else v.first) in ok]


def _longest_first(heads: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return sorted(dict.fromkeys(heads), key=len, reverse=True)


def _behind_fits(model: Any, ids: torch.Tensor, first: torch.Tensor, shifts: list[int],
                 num_layers: int, tol: float) -> set[Any]:
    """The shifts k whose token ids[k], alone, makes the stored first states `first` [C, H]."""
    if not shifts:
        return set()
    live = _live(model, ids[shifts].tolist(), num_layers, alone=True)
    fits = [_states_fit(first[None], row[None], tol) for row in live]
    return {k for k, fit in zip(shifts, fits, strict=True) if fit}


def _live(model: Any, ids: Any, num_layers: int, alone: bool = False) -> torch.Tensor:
    """Every live residual row and the final hidden [T, L + 2, H] of `ids` as one sequence, or
    (`alone`) of each token as a sequence of its own."""
    dev = next(model.parameters()).device
    x = torch.tensor(list(ids), device=dev).view(-1, 1) if alone else \
        torch.tensor(list(ids), device=dev).view(1, -1)
    pos = torch.arange(x.shape[1], device=dev).expand_as(x)
    fo = model(x, pos, aux_ids=tuple(range(-1, num_layers)), want_logits=False)
    rows = torch.cat([fo.aux, fo.hidden[:, :, None]], 2).float().cpu()
    return rows[:, 0] if alone else rows[0]


def _states_fit(stored: torch.Tensor, live: torch.Tensor, tol: float) -> bool:
    """Each token's stored states [T, C, H] hold one within `tol` of a live row [T, R, H]."""
    norm = live.norm(dim=-1).clamp(min=1e-12)
    rel = torch.stack([(stored[:, c, None] - live).norm(dim=-1) / norm  # a slot at a time
                       for c in range(stored.shape[1])], -1)  # [T, R, C]
    best = rel.nan_to_num(torch.inf).flatten(1).amin(1)
    return bool(best.numel()) and bool((best <= tol).all())
