"""On-device sampling with no host sync: greedy, temperature, top-k, top-p, top-nσ.

Sampling uses the exponential trick, argmax(p / E) with E ~ Exponential(1), which draws from p
without a cumulative sum or a sync and is CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# SamplingParams, KINDS and widest live in params.py (no torch); imported from here too
from draftsmith.engine.params import KINDS, SamplingParams, widest  # noqa: F401
from draftsmith.errors import DraftsmithError

# A setting past what its device tensor holds means what the largest held value means: top-k and
# top-nσ past any vocabulary keep every token; past 1e30 a temperature leaves the tempered logits
# as even as they get while still apart (near float32's largest they tie, and top-k kept them all)
HOTTEST, WIDEST_K, WIDEST_SIGMA = 1e30, 1 << 62, 1e30


def held(p: SamplingParams) -> tuple[float, float, int, float]:
    """p's temperature, top-p, top-k and top-nσ as device tensors hold them: a top-k past int64
    or a value past float32 was a traceback (`HOTTEST`)."""
    return (min(float(p.temperature), HOTTEST), float(p.top_p), min(int(p.top_k), WIDEST_K),
            min(float(p.top_n_sigma), WIDEST_SIGMA))


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampler with these settings draws from (float32, last dim)."""
    t, top_p, top_k, n_sigma = held(p)
    x = logits.float() / max(t, 1e-6)
    if p.filters:
        shape = (*x.shape[:-1], 1)
        x = filtered(x, torch.full(shape, top_k, device=x.device),
                     torch.full(shape, top_p, device=x.device),
                     torch.full(shape, n_sigma, device=x.device))
    return x.softmax(-1)


# Eager even inside a compiled step (still capturable in a CUDA graph): torch 2.11's inductor
# split the vocab-long cumsum at batch 256 and failed in codegen (H200, 2026-12-01), and the
# sort dominates this block anyway. One sort serves every row's k and p, so top-k alone sorts
# too (it took torch.topk before per-row settings; not timed on a GPU since).
@torch.compiler.disable
def filtered(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             n_sigma: torch.Tensor | None = None) -> torch.Tensor:
    """x with -inf below each row's top-nσ floor, max(x) - n * std(x) over the whole row (ties
    kept; n <= 0: none) and outside its top-k (ties with the k-th kept; 0: no limit), then outside
    the smallest set of top tokens whose probability (over what those kept) reaches top_p (1: no
    limit). top_k, top_p, n_sigma: [..., 1], one value a row of x [..., V] (tempered logits)."""
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    v = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), v).long().expand(*x.shape[:-1], 1)
    cut = sorted_x.gather(-1, k - 1)
    if n_sigma is not None:
        cut = torch.fmax(cut, sigma_floor(x, sorted_x[..., :1], n_sigma))
    sorted_x = sorted_x.masked_fill(sorted_x < cut, float("-inf"))
    sp = sorted_x.softmax(-1)
    # a token goes once the tokens above it reach top_p (ties at exactly top_p too, as HF's and
    # vLLM's top-p do); a row at top_p 1 drops nothing: its sum may round past 1 before the tail
    drop = (sp.cumsum(-1) - sp >= top_p) & (top_p < 1)
    drop[..., 0] = False  # the top token stays where top_p rounds to 0 in float32 (1e-50)
    return x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))


def sigma_floor(x: torch.Tensor, top: torch.Tensor, n_sigma: torch.Tensor) -> torch.Tensor:
    """Top-nσ's floor of each row of x [..., V] (top: its max [..., 1]): top - n * std (torch's
    std, N - 1, as the paper's code); -inf where n <= 0. A row whose std is NaN (an -inf logit,
    one token) gets NaN, which `torch.fmax` reads as no floor."""
    floor = top - n_sigma * x.std(-1, keepdim=True)
    return torch.where(n_sigma > 0, floor, float("-inf"))


# A vocabulary-long argmax in two stages: compiled as one, it was a looped reduction of one
# program a row, 8.5 us of the H200's one-token decode step and 10.2 of a 25-token accept (run
# 25's probe), where the slices' maxes take a program each.
ARGMAX_SLICE = 1024


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), ties to the first (NaN counts as the largest, as in torch): for a last dim
    of at least two slices, each ARGMAX_SLICE-wide slice's max first, then the first slice
    holding the largest. A last dim of no whole number of slices is padded with its dtype's
    least value, which never comes before an equal value of its own."""
    v = x.shape[-1]
    if v < 2 * ARGMAX_SLICE:
        return x.argmax(-1)
    if pad := -v % ARGMAX_SLICE:
        least = float("-inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
        x = torch.nn.functional.pad(x, (0, pad), value=least)
    best, at = x.unflatten(-1, (-1, ARGMAX_SLICE)).max(-1)
    s = best.argmax(-1, keepdim=True)
    return s[..., 0] * ARGMAX_SLICE + at.gather(-1, s)[..., 0]


def draw(prob: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    e = torch.empty_like(prob).exponential_(1, generator=generator)
    return argmax(prob / e)


class RowSampling:
    """Each row's sampling settings as device tensors: rows of `like`'s kind or a kind before it
    (`KINDS`), at any temperature, top-p, top-k or top-nσ, share one decode graph, so a server
    batches requests of different settings together instead of one batch per setting. A greedy
    row among sampled ones (temperature 0) takes the argmax. Idle rows hold `like`."""

    def __init__(self, rows: int, device: torch.device | str, like: SamplingParams) -> None:
        self.kind = like.kind
        t, p, k, n = held(like)
        self.temp = torch.full((rows,), t, device=device)
        self.top_p = torch.full((rows,), p, device=device)
        self.top_k = torch.full((rows,), k, dtype=torch.long, device=device)
        self.n_sigma = torch.full((rows,), n, device=device)

    def set(self, idx: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        """Rows idx take these settings, one each, each of this state's kind or one before it."""
        check_kinds(self.kind, params)
        if len(params) != len(idx):
            raise DraftsmithError(f"{len(params)} sampling settings for {len(idx)} rows")
        if self.kind == "greedy" or not params:
            return
        t, p, k, n = zip(*map(held, params), strict=True)
        dev = self.temp.device
        self.temp[idx] = torch.tensor(t, device=dev)
        self.top_p[idx] = torch.tensor(p, device=dev)
        self.top_k[idx] = torch.tensor(k, device=dev)
        self.n_sigma[idx] = torch.tensor(n, device=dev)

    def sample(self, logits: torch.Tensor, idx: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """A token from each row's logits [R, ..., V] under its own settings (rows idx of this
        state where logits hold only those)."""
        if self.kind == "greedy":
            return argmax(logits)
        t = self.temp if idx is None else self.temp[idx]
        return draw_or_argmax(logits, t, draw(self.probs(logits, idx), generator))

    def probs(self, logits: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The distributions the sampled rows draw from (a greedy row's: near one-hot)."""
        t, p, k, n = (v if idx is None else v[idx]
                      for v in (self.temp, self.top_p, self.top_k, self.n_sigma))
        shape = (-1,) + (1,) * (logits.dim() - 1)
        x = logits.float() / t.clamp(min=1e-6).view(shape)
        if self.kind == "filtered":
            x = filtered(x, k.view(shape), p.view(shape), n.view(shape))
        return x.softmax(-1)


def check_kinds(kind: str, params: Sequence[SamplingParams]) -> None:
    """Every setting of `kind` or a kind before it (`KINDS`): what rows of `kind` can take."""
    if bad := [p for p in params if KINDS.index(p.kind) > KINDS.index(kind)]:
        raise DraftsmithError(f"rows of {kind} sampling cannot take {bad[0]} ({bad[0].kind}): "
                              f"make the decoder with a setting of that kind")


def draw_or_argmax(logits: torch.Tensor, temp: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """`drawn` [R, ...] tokens, but the argmax of logits [R, ..., V] in rows at temperature 0
    (temp [R]): greedy requests batched with sampled ones decode as greedy ones alone."""
    return torch.where((temp == 0).view(-1, *(1,) * (drawn.dim() - 1)), argmax(logits), drawn)
