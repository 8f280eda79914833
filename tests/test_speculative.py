"""Speculative decoding on CPU, fp32: output identical to plain greedy decoding, chain and tree,
batch 1 and 4; oracle and never drafters; caches identical to a full forward's."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import generate
from draftsmith.engine.graphs import Graphs, LateFlag
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_state import SpecResult
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import RankCounts
from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.models.llama import Transformer

PROMPTS = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20]]
NEW = 40
SETTINGS = [(1, 1, None), (3, 1, None), (5, 1, None), (3, 2, 6), (4, 4, 10), (2, 3, 4)]


def init_(module: torch.nn.Module, std: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * std)


def tiny_target(vocab: int = 128, seed: int = 0, **over) -> Transformer:
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=16)
    shape.update(over)
    model = Transformer(ModelConfig(arch="llama", vocab_size=vocab, **shape))
    init_(model, 0.15)
    return model.eval()


def make_drafter(target: Transformer, dvocab: int, cls=None, seed: int = 1,
                 std: float = 0.1, layers: int = 1) -> Eagle3Drafter:
    """A random drafter over the first ids of the target vocab minus a few (d2t non-trivial)."""
    cfg = target.cfg
    dcfg = Eagle3Config.for_target(cfg, dvocab, default_aux_layers(cfg.num_layers))
    dcfg = dataclasses.replace(dcfg, num_layers=layers)
    torch.manual_seed(seed)
    d = (cls or Eagle3Drafter)(dcfg)
    init_(d, std)
    used = torch.sort(torch.randperm(cfg.vocab_size)[:dvocab]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embed.weight)
        d.set_vocab(used - torch.arange(dvocab), t2d)
    return d.eval()


class Steered(Eagle3Drafter):
    """A real drafter whose logits are pushed toward (sign +1) or away from (sign -1) the target's
    greedy continuation `seq` [B, T] at a fraction `rate` of (row, position) pairs; its logits
    are not its head's, so the engine never applies that head itself."""

    plain_head = False

    def steer(self, seq: torch.Tensor, rate: float, sign: float = 1.0) -> Steered:
        dev = self.fc.weight.device
        self.seq, self.rate, self.sign, self.row0 = seq.to(dev), rate, sign, 0
        vd = self.cfg.draft_vocab_size
        self.index = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=dev)
        self.index[torch.arange(vd, device=dev) + self.d2t] = torch.arange(vd, device=dev)
        return self

    def wanted(self, tokens, positions, at) -> tuple[torch.Tensor, torch.Tensor]:
        """(the draft id of the target's next token, whether this position is steered)."""
        rows = self.row0 + torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        if at is not None:
            positions = positions.gather(1, at[:, None])
        want = self.index[self.seq[rows, (positions + 2).clamp(max=self.seq.shape[1] - 1)]]
        on = (((rows * 7919 + positions * 104729) % 97) < self.rate * 97) & (want >= 0)
        return want, on

    def forward(self, tokens, hidden, positions, caches=None, slots=None, mask=None, at=None):
        logits, h = super().forward(tokens, hidden, positions, caches, slots, mask, at)
        want, on = self.wanted(tokens, positions, at)
        bump = torch.nn.functional.one_hot(want.clamp(min=0), logits.shape[-1])
        return logits + 30.0 * self.sign * bump * on[..., None], h


class Decoyed(Steered):
    """Steered at every position, with a decoy ten logits above the target's token: the
    target's token is always its parent's rank-1 child."""

    def forward(self, tokens, hidden, positions, caches=None, slots=None, mask=None, at=None):
        logits, h = super().forward(tokens, hidden, positions, caches, slots, mask, at)
        want, on = self.wanted(tokens, positions, at)
        decoy = torch.nn.functional.one_hot((want + 1) % logits.shape[-1], logits.shape[-1])
        return logits + 40.0 * decoy * on[..., None], h


def greedy_seq(rt: Runtime, prompts: list[list[int]], new: int) -> torch.Tensor:
    ref = generate(rt, prompts, new, eos_ids=[])
    seq = torch.zeros(len(prompts), max(map(len, prompts)) + new, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, ref, strict=True)):
        seq[i, : len(p) + len(r)] = torch.tensor(p + r)
    return seq




@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    ref = generate(rt, PROMPTS, NEW, eos_ids=[])
    seq = greedy_seq(rt, PROMPTS, NEW + 8)
    return target, rt, ref, seq


@pytest.mark.parametrize("steps,topk,n", SETTINGS)
def test_greedy_equals_plain_greedy(setup, steps, topk, n):
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert res.mean_accept_length > 1.2  # partial acceptance was exercised
    assert 0 < res.accepted[0] < res.reached[0]  # first drafts both accepted and rejected
    one = dec.generate(PROMPTS[2:3], NEW, eos_ids=[])
    assert one.tokens == ref[2:3]


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 6)])
def test_two_layer_drafter_equals_plain_greedy(setup, steps, topk, n):
    """A deeper drafter (train --num-layers 2, or a deepened --init-from) drafts through every
    layer's cache and still only speeds up plain greedy decoding."""
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered, layers=2).steer(seq, 0.7)
    res = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref and res.mean_accept_length > 1.2


def test_random_drafter_and_eos(setup):
    target, rt, ref, _ = setup
    dec = SpecDecoder(rt, make_drafter(target, 128), 3, 2, 5)
    cut = next(i for i in range(5, NEW) if ref[0][i] not in ref[0][:i])
    eos = ref[0][cut]
    got = dec.generate(PROMPTS, NEW, eos_ids=[eos]).tokens
    want = generate(rt, PROMPTS, NEW, eos_ids=[eos])
    assert got == want and len(got[0]) == cut


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (4, 3, 8)])
def test_oracle_accepts_everything(setup, steps, topk, n):
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 128, Steered).steer(seq, 1.0)
    res = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref
    assert sum(res.accept_hist) == res.accept_hist[steps + 1] > 0
    assert res.accepted == res.reached and res.mean_accept_length == steps + 1


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 3, 7)])
def test_never_drafter_emits_one_token_per_cycle(setup, steps, topk, n):
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 128, Steered).steer(seq, 1.0, sign=-1.0)
    res = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS[:1], NEW, eos_ids=[])
    assert res.tokens == ref[:1]
    assert res.cycles == NEW - 1 and res.accept_hist[1] == NEW - 1 and sum(res.accepted) == 0


def _rank_counted(dec: SpecDecoder, prompts: list) -> tuple[SpecResult, list, list]:
    dec.rank_counts = counts = RankCounts(dec.steps, dec.topk, dec.device)
    res = dec.generate(prompts, NEW, eos_ids=[])
    return (res, *counts.counts())


def test_rank_counts_name_the_sibling_each_cycle_accepted(setup):
    """A decoy above the target's token makes every accepted node a rank-1 child: a
    tree 3 deep, 2 wide, all 10 candidates verified, accepts depths 1 and 2 (rank 1 both) and
    never depth 3 (the rank-1 path leaves the frontier). The oracle accepts rank 0 throughout.
    Either way the counts add up to the engine's own accepted counts per depth."""
    target, rt, ref, seq = setup
    decoyed = make_drafter(target, 128, Decoyed).steer(seq, 1.0)
    res, reached, accepted = _rank_counted(SpecDecoder(rt, decoyed, 3, 2, 11), PROMPTS)
    assert res.tokens == ref
    cycles = res.reached[0]
    assert cycles > 0 and res.accepted == [cycles, cycles, 0]
    assert accepted == [[0, cycles], [0, cycles], [0, 0]]
    assert reached[:2] == [[cycles, cycles], [cycles, cycles]]
    oracle = make_drafter(target, 128, Steered).steer(seq, 1.0)
    res, reached, accepted = _rank_counted(SpecDecoder(rt, oracle, 4, 3, 8), PROMPTS)
    assert [row[0] for row in accepted] == res.accepted == [row[0] for row in reached]
    assert all(row[1:] == [0, 0] for row in accepted)
    partial = make_drafter(target, 96, Steered).steer(seq, 0.7)
    res, reached, accepted = _rank_counted(SpecDecoder(rt, partial, 4, 4, 10), PROMPTS)
    assert [sum(row) for row in accepted] == res.accepted and sum(res.accepted) > 0
    assert all(a <= r for ra, rr in zip(accepted, reached, strict=True)
               for a, r in zip(ra, rr, strict=True))


def test_rank_counts_are_kept_per_row(setup):
    """Each row's counts are its prompt's: those of the prompt decoded alone; the rows sum to
    the batch's counts, and a decoder counts one batch's rows, not another's."""
    target, rt, ref, seq = setup
    partial = make_drafter(target, 96, Steered).steer(seq, 0.7)
    dec = SpecDecoder(rt, partial, 4, 4, 10)
    dec.rank_counts = counts = RankCounts(4, 4, dec.device)
    dec.generate(PROMPTS, NEW, eos_ids=[])
    rows = counts.row_counts()
    assert len(rows) == len(PROMPTS) and any(sum(map(sum, a)) for _, a in rows)
    for j, total in enumerate(counts.counts()):
        assert total == [[sum(r[j][d][k] for r in rows) for k in range(4)] for d in range(4)]
    for i, (prompt, row) in enumerate(zip(PROMPTS, rows, strict=True)):
        partial.row0 = i  # steered as in its batch row
        _, *alone = _rank_counted(dec, [prompt])
        assert tuple(alone) == row
    partial.row0 = 0
    with pytest.raises(DraftsmithError, match="sized for 1 rows"):
        dec.generate(PROMPTS, NEW, eos_ids=[])


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 6)])
def test_committed_caches_equal_a_full_forward(setup, steps, topk, n):
    """Target and drafter K/V at every committed position equal those of one forward over the
    final sequence: the accepted path was copied by position and the drafter re-extended over
    (x_{p+1}, aux_p) pairs."""
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    full = [p + t for p, t in zip(PROMPTS, res.tokens, strict=True)]
    ref_rt, ref_drt = Runtime(target, 4, 128), DrafterRuntime(drafter, 4, 128)
    longest = max(map(len, full))
    toks = torch.tensor([f + [0] * (longest - len(f)) for f in full])
    pos = torch.arange(longest - 1).repeat(4, 1)
    with torch.no_grad():
        out = ref_rt.forward(toks[:, :-1], pos, aux_ids=dec.aux_ids)
        ref_drt.forward(toks[:, 1:], drafter.fuse(out.aux), pos)
    for got, want in ((rt.caches, ref_rt.caches), (dec.drt.caches, ref_drt.caches)):
        for b, f in enumerate(full):
            k = len(f) - 1
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g.k[b, :, :k], w.k[b, :, :k], atol=1e-4)
                assert torch.allclose(g.v[b, :, :k], w.v[b, :, :k], atol=1e-4)


def reference_drafts(target, drafter, seq: list[int], steps: int, row: int) -> list[int]:
    """The chain a drafter proposes after committed tokens `seq`, recomputed without caches."""
    drafter.row0 = row
    with torch.no_grad():
        ids = torch.tensor([seq])
        aux = target(ids[:, :-1], torch.arange(len(seq) - 1)[None],
                     aux_ids=tuple(drafter.cfg.aux_layer_ids)).aux
        toks, hid = ids[:, 1:], drafter.fuse(aux)
        out = []
        for _ in range(steps):
            logits, h = drafter(toks, hid, torch.arange(toks.shape[1])[None])
            d = drafter.to_target(logits[:, -1].argmax(-1))
            out.append(int(d))
            toks, hid = torch.cat([toks, d[:, None]], 1), torch.cat([hid, h[:, -1:]], 1)
    drafter.row0 = 0
    return out


def test_chain_drafts_match_a_cacheless_reference(setup):
    target, rt, _, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    dec = SpecDecoder(rt, drafter, 4)
    st = dec._state(2)
    with torch.no_grad():
        dec._prefill(st, PROMPTS[:2], NEW, [])
        for _ in range(3):
            dec._run(st, "draft")
            for b in range(2):
                committed = seq[b, : int(st.L[b]) + 1].tolist()
                assert st.vtok[b, 1:].tolist() == reference_drafts(target, drafter, committed, 4, b)
            for phase in ("verify", "accept", "extend"):
                dec._run(st, phase)
    assert int(st.hist.sum()) == 6 and int(st.accepted.sum()) > 0


def test_bad_settings_are_clear_errors(setup):
    target, rt, _, _ = setup
    drafter = make_drafter(target, 96)
    for kw in (dict(steps=0), dict(topk=2), dict(topk=1, num_draft_tokens=7),
               dict(steps=2, topk=2, num_draft_tokens=8), dict(topk=2, num_draft_tokens=1)):
        with pytest.raises(DraftsmithError):
            SpecDecoder(rt, drafter, **kw)
    dec = SpecDecoder(rt, drafter, 3)
    with pytest.raises(DraftsmithError, match="capacity"):
        dec.generate([[1] * 100], 40)
    with pytest.raises(DraftsmithError):
        dec.generate([[1], []], 4)
    with pytest.raises(DraftsmithError, match="max_batch"):
        dec.generate([[1]] * 5, 4)
    other = make_drafter(tiny_target(vocab=64), 32)
    with pytest.raises(DraftsmithError, match="vocab"):
        SpecDecoder(rt, other, 3)


def test_bad_prompts_and_trees_are_clear_errors(setup):
    """Token ids past the target's embedding were an IndexError (on a GPU a device-side assert
    that ends the CUDA context), a tree wider than the draft vocabulary failed mid-draft, and
    negative refill rows a tensor of negative size."""
    from draftsmith.engine.spec_refill import generate_refill

    target, rt, _, _ = setup
    dec = SpecDecoder(rt, make_drafter(target, 96), 3, 2, 5)
    for prompts in ([[1, 2], [3, 128]], [[-1, 4]]):
        with pytest.raises(DraftsmithError, match="outside the target's vocabulary"):
            dec.generate(prompts, 4)
        with pytest.raises(DraftsmithError, match="outside the target's vocabulary"):
            generate_refill(dec, prompts, 4)
    with pytest.raises(DraftsmithError, match="rows must be >= 1"):
        generate_refill(dec, [[1, 2]], 4, rows=-2)
    with pytest.raises(DraftsmithError, match="topk 5 exceeds the drafter's draft vocabulary of 4"):
        SpecDecoder(rt, make_drafter(target, 4), 2, 5, 6)


def test_a_first_calls_state_is_made_before_the_prefill_is_timed(setup, monkeypatch):
    """The baseline captures its decode step before its clock starts; a decoder's first call at a
    batch size made (on a GPU: captured, compiled) its state inside `prefill_s`."""
    from draftsmith.engine import speculative
    from draftsmith.engine.spec_state import SpecState

    class Slow(SpecState):
        def __init__(self, dec, b):
            time.sleep(1.0)  # far past a tiny prefill, even on a loaded machine
            super().__init__(dec, b)

    target, rt, ref, _ = setup
    monkeypatch.setattr(speculative, "SpecState", Slow)
    res = SpecDecoder(rt, make_drafter(target, 96), 3).generate(PROMPTS[:3], NEW, eos_ids=[])
    assert res.tokens == ref[:3] and res.prefill_s < 0.9


def test_drafter_runtime_cached_forward_matches_uncached(setup):
    target, _, _, _ = setup
    drafter = make_drafter(target, 96)
    drt = DrafterRuntime(drafter, 2, 32)
    torch.manual_seed(2)
    tok = torch.randint(0, 128, (2, 10))
    hid = torch.randn(2, 10, drafter.cfg.hidden_size)
    pos = torch.arange(10).repeat(2, 1)
    with torch.no_grad():
        full, fh = drafter(tok, hid, pos)
        a, ah = drt.forward(tok[:, :6], hid[:, :6], pos[:, :6])
        b, bh = drt.forward(tok[:, 6:], hid[:, 6:], pos[:, 6:])
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
    assert torch.allclose(torch.cat([ah, bh], 1), fh, atol=1e-5)
    with pytest.raises(DraftsmithError, match="max_batch"):
        drt.caches_for(3)


def test_late_flag_reads_the_previous_post():
    flag, count, done = torch.tensor(False), torch.tensor([3, 4]), torch.tensor([False, True])
    late, now = LateFlag(flag, extra=(count, done)), LateFlag(flag, late=False)
    assert late.seen() is False and late.extra_seen is None  # nothing posted before
    flag.fill_(True)
    count += 10
    done.fill_(True)
    assert now.seen() is True and late.seen() is False  # the late one saw the old value
    assert [t.tolist() for t in late.extra_seen] == [[3, 4], [False, True]]  # the same post's
    assert late.seen() is True and late.extra_seen[0].tolist() == [13, 14]


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 6)])
def test_late_done_check_changes_nothing(setup, steps, topk, n):
    """The timed loop reads 'all done' a cycle late and runs one inert cycle at the end; the
    profiled loop reads it at once. Same tokens, cycles and accept counts, sampled with EOS."""
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    eos = [ref[0][7], ref[3][20]]  # rows stop at different cycles
    runs = []
    for profile in (False, True):
        torch.manual_seed(11)
        dec = SpecDecoder(rt, drafter, steps, topk, n, SamplingParams(0.7), profile=profile)
        runs.append(dec.generate(PROMPTS, NEW, eos_ids=eos))
    late, exact = runs
    assert late.tokens == exact.tokens and late.cycles == exact.cycles
    assert late.accept_hist == exact.accept_hist and late.accepted == exact.accepted
    assert len(late.tokens[0]) < NEW and exact.phases.cycles == exact.cycles


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 6)])
def test_rows_ending_at_max_new_cost_no_inert_cycle(setup, monkeypatch, steps, topk, n):
    """When the late counts say this cycle may bring every row to max_new, the loop reads the
    flag at once instead of launching a cycle that would change nothing (H200 run 11: one such
    cycle of ~35 cost ~3 % at batch 1). Rows ended by EOS still end on the late read."""
    from draftsmith.engine import speculative

    target, rt, ref, seq = setup
    dec = SpecDecoder(rt, make_drafter(target, 96, Steered).steer(seq, 0.7), steps, topk, n)
    launched = []
    plain = dec.cycle
    dec.cycle = lambda st, prof=None: (launched.append(1), plain(st, prof))
    res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref and len(launched) == res.cycles
    launched.clear()  # row 0 ends by EOS early, the others at max_new: still no inert cycle
    stop = next(t for t in ref[0][3:] if all(t not in r for r in ref[1:]))  # row 0's alone
    eos = dec.generate(PROMPTS, NEW, eos_ids=[stop])
    assert len(eos.tokens[0]) < NEW and {len(t) for t in eos.tokens[1:]} == {NEW}
    assert len(launched) == eos.cycles
    launched.clear()  # the prefill's token ends every row: no cycle at all
    assert dec.generate(PROMPTS, 1, eos_ids=[]).cycles == 0 and not launched
    no, yes = torch.tensor([False, False]), torch.tensor([True, False])
    assert dec.may_end_all(torch.tensor([NEW - steps - 1, NEW]), no, NEW)
    assert not dec.may_end_all(torch.tensor([NEW - steps - 2, NEW]), no, NEW)
    assert dec.may_end_all(torch.tensor([1, NEW - steps - 1]), yes, NEW)  # row 0 ended by EOS
    assert not dec.may_end_all(torch.tensor([1, 2]), torch.tensor([True, True]), NEW)
    monkeypatch.setattr(speculative, "EXACT_END", False)  # the A/B switch: the old ending
    launched.clear()
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref and len(launched) == res.cycles + 1


def test_engine_switches_read_1_or_0_and_refuse_the_rest(monkeypatch):
    from draftsmith.switches import env_flag

    monkeypatch.setenv("DRAFTSMITH_X", " 0 ")
    assert not env_flag("DRAFTSMITH_X", "1") and env_flag("DRAFTSMITH_UNSET_X", "1")
    monkeypatch.setenv("DRAFTSMITH_X", "off")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_X='off': use 1 or 0"):
        env_flag("DRAFTSMITH_X", "1")


def test_merged_results_add_up(setup):
    target, rt, ref, seq = setup
    dec = SpecDecoder(rt, make_drafter(target, 96, Steered).steer(seq, 0.7), 3)
    parts = [dec.generate(PROMPTS[:2], NEW, eos_ids=[]), dec.generate(PROMPTS[2:], NEW, eos_ids=[])]
    m = SpecResult.merged(parts)
    assert m.tokens == ref and m.cycles == sum(p.cycles for p in parts)
    assert m.accept_hist == [a + b for a, b in zip(*(p.accept_hist for p in parts), strict=True)]
    assert m.reached == [a + b for a, b in zip(*(p.reached for p in parts), strict=True)]
    whole = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert sum(m.accepted) > 0 and m.new_tokens == whole.new_tokens


def _compiled_entries(fn) -> int:
    import torch._dynamo.eval_frame as ef

    return len(ef._debug_get_cache_entry_list(fn.__code__))


@pytest.mark.slow
@pytest.mark.parametrize("steps,topk,n,rows,method,whole", [
    (3, 1, None, 4, "topk", True), (4, 4, 10, 4, "topk", False), (2, 3, 4, 1, "topk", True),
    (4, 4, 10, 4, "max", True), (4, 4, 10, 4, "chunk", False), (4, 4, 10, 4, "chunk", True)])
def test_compiled_bookkeeping_equals_eager_cycle_by_cycle(setup, steps, topk, n, rows, method,
                                                          whole, monkeypatch):
    """The torch.compile'd accept arithmetic and tree bookkeeping (what the GPU's compiled engine
    runs) build the same trees and commit the same tokens as the eager code at every cycle, with
    a random drafter whose hidden states shape the trees, and equal plain greedy decoding.
    whole: each phase compiled as one function (the fused engine: a tree's draft, not under
    max; the accept; the extend), else the drafter and each pick compiled apart."""
    from draftsmith.engine import speculative, tree

    monkeypatch.setattr(tree, "TREE_TOPK", method)
    monkeypatch.setattr(tree, "CHUNK", 16)  # chunk: 16-wide slices of the 96-token draft vocab
    target, rt, _, _ = setup
    drafter = make_drafter(target, 96)
    eager, fused = (SpecDecoder(rt, drafter, steps, topk, n) for _ in range(2))
    fused.compile_bookkeeping(speculative.fused_phases("all" if whole else "0"))
    draft = {"draft"} if whole and topk > 1 and method != "max" else set()
    assert fused.fused == ({"accept", "extend"} | draft if whole else set())
    prompts = PROMPTS[:rows]
    torch.set_grad_enabled(False)  # as generate() runs; the step API leaves it to the caller
    try:
        _lockstep(eager, fused, prompts, topk)
    finally:
        torch.set_grad_enabled(True)
    # each fused phase ran whole every cycle: none fell back to parts (that only warns)
    assert fused.states and not any(st.unfused for st in fused.states.values())
    if not whole:
        assert _compiled_entries(speculative.commit_values) > 0
    if topk == 1:
        assert _compiled_entries(speculative.chain_child) > 0
    if not draft and topk > 1:
        assert all(_compiled_entries(f) > 0 for f in (tree.grow_greedy, tree.pick_nodes))
        roots = [st.tree.fns[0] for st in fused.states.values()]
        if method == "max":  # the root pick stays eager (grow_greedy inlines greedy_children)
            assert roots and all(r is tree.greedy_children for r in roots)
        else:
            assert _compiled_entries(tree.greedy_children) > 0
    ref_rows = generate(rt, prompts, NEW, eos_ids=[])
    assert fused.generate(prompts, NEW, eos_ids=[]).tokens == ref_rows


@pytest.mark.parametrize("topk,n", [(1, None), (4, 8)])
def test_fused_phases_that_fail_to_compile_fall_back_to_parts(setup, topk, n):
    """Where inductor fails to compile a fused phase (2.11: the tree 3/4/8 draft at batch 32 on
    the H200, run 9), that batch size warns once a phase and runs it in parts, keeping plain
    greedy output: torch.compile raises before the phase has written anything."""
    from draftsmith.engine import speculative

    calls = []

    def failing_backend(gm, example_inputs):  # as inductor's AssertionError reached dynamo
        calls.append(1)
        raise AssertionError("tiling")

    target, rt, _, _ = setup
    dec = SpecDecoder(rt, make_drafter(target, 96), 3, topk, n)
    phases = {"accept", "extend"} | ({"draft"} if topk > 1 else set())
    fns = {"draft": speculative.greedy_tree_phase, "accept": speculative.greedy_accept,
           "extend": speculative.extend_phase}
    dec.fused = frozenset(phases)  # as compile_bookkeeping sets it, with a failing compiler
    dec.phase_fns = {p: torch.compile(fns[p], fullgraph=True, dynamic=False,
                                      backend=failing_backend) for p in phases}
    b = len(PROMPTS)
    with pytest.warns(UserWarning, match=f"failed to compile at batch {b}") as seen:
        res = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == generate(rt, PROMPTS, NEW, eos_ids=[])
    assert len(calls) == len(seen) == len(phases) and dec.states[b].unfused == phases
    with pytest.warns(UserWarning, match="failed to compile at batch 1"):
        assert dec.generate(PROMPTS[:1], NEW, eos_ids=[]).tokens == res.tokens[:1]
    assert len(calls) == 2 * len(phases)  # each batch size tries each phase once


def test_fused_phases_setting():
    from draftsmith.engine.speculative import PHASES_FUSABLE, fused_phases

    assert fused_phases("all") == set(PHASES_FUSABLE) and fused_phases(" 0 ") == set()
    assert fused_phases("draft, accept") == {"draft", "accept"} and fused_phases("none") == set()
    with pytest.raises(DraftsmithError, match="unknown phase"):
        fused_phases("draft,verify")


def _lockstep(eager: SpecDecoder, fused: SpecDecoder, prompts: list, topk: int) -> None:
    a, b = eager.start(prompts, NEW, []), fused.start(prompts, NEW, [])
    names = ["out", "L", "count", "done", "hist", "accepted", "reached", "last", "root_hidden"]
    nodes = ["node_tok", "node_parent", "node_depth", "anc"] if topk > 1 else []
    for _ in range(NEW):
        eager.cycle(a), fused.cycle(b)
        for name in nodes:
            assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
        for name in names:
            assert torch.allclose(getattr(a, name), getattr(b, name), atol=1e-5), name
        if eager.finished(a):
            break
    assert fused.finished(b)


def _same(x, y) -> bool:
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same(a, c) for a, c in zip(x, y, strict=True))
    return torch.allclose(x, y, atol=1e-6) if x.is_floating_point() else torch.equal(x, y)


@pytest.mark.slow
def test_compiled_pure_functions_equal_eager_on_random_inputs():
    """Each function the compiled engine wraps in torch.compile returns exactly what the eager
    one does, on random inputs where every output matters (trees shaped by random scores)."""
    from draftsmith.engine import speculative, tree

    root, grow, pick = tree.compiled_bookkeeping()
    chain_pick, tree_pick, commit, child = speculative.compiled_accept()
    g = torch.Generator().manual_seed(3)
    b, k, v, h, fs, steps, n = 3, 4, 50, 8, 8, 3, 8
    d2t = torch.randint(0, 5, (v,), generator=g)
    own = torch.rand(k, fs, generator=g) < 0.3
    for last in (False, True):
        args = (torch.randn(b, k, v, generator=g), torch.randn(b, k, h, generator=g),
                -torch.rand(b, k, generator=g, dtype=torch.float64) * 3,
                torch.randint(1, 9, (b, k), generator=g), torch.rand(b, k, fs, generator=g) < 0.5,
                own, d2t, 5, last)
        assert _same(grow(*args), tree.grow_greedy(*args))
    root_args = (torch.randn(b, v, generator=g), d2t, k)
    assert _same(root(*root_args), tree.greedy_children(*root_args))
    blocks = [(torch.randint(0, v, (b, w), generator=g), torch.randint(0, v, (b, w), generator=g),
               -torch.rand(b, w, generator=g, dtype=torch.float64) * (i + 1),
               torch.randint(0, w, (b, w), generator=g) * 0) for i, w in enumerate((k, k * k))]
    depth, qsrc = tree.TreeShape(k, 2, n).static(torch.device("cpu"))
    last_tok = torch.randint(0, v, (b,), generator=g)
    assert _same(pick(last_tok, blocks, depth, qsrc, n, 2), tree.pick_nodes(last_tok, blocks,
                                                                            depth, qsrc, n, 2))
    logits, tok = torch.randn(b, steps + 1, v, generator=g), torch.randint(0, v, (b, steps + 1),
                                                                          generator=g)
    tok[:, 1] = logits[:, 0].argmax(-1)  # some acceptance
    assert _same(chain_pick(logits, tok), speculative.verify.chain_greedy(logits, tok))
    assert _same(child(logits[:, 0], d2t), speculative.chain_child(logits[:, 0], d2t))
    node_parent = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]]).expand(b, n).contiguous()
    node_depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3, 3]]).expand(b, n).contiguous()
    anc = tree.ancestors(node_parent, steps)
    tl = torch.randn(b, n, v, generator=g)
    targs = (tl, torch.randint(0, v, (b, n), generator=g), node_parent, node_depth, anc, steps)
    assert _same(tree_pick(*targs), speculative.tree_pick(*targs))
    n_acc = torch.tensor([0, 2, 3])
    path = torch.arange(steps + 1).expand(b, -1)
    cargs = (tok, path, n_acc, torch.randint(0, v, (b,), generator=g),
             torch.tensor([False, False, True]), torch.tensor([1, 5, 9]), torch.tensor(8),
             torch.tensor([tok[1, 2].item(), -1]), torch.tensor([7, 9, 11]),
             torch.tensor([1, 2, 3]), torch.randn(b, steps + 1, 3, h, generator=g),
             torch.arange(steps + 1), 40)
    assert _same(commit(*cargs), speculative.commit_values(*cargs))
    # the histogram's increment: accept lengths 1 and 3 of the two running rows (the third done)
    assert speculative.commit_values(*cargs)[4].tolist() == [0, 1, 0, 1, 0]


def test_prompt_bucket_lengths():
    target = tiny_target()
    rt = Runtime(target, 4, 128, prompt_buckets=True)
    assert [rt.bucket(1, n) for n in (1, 16, 17, 33, 100, 128)] == [16, 16, 24, 48, 128, 128]
    assert rt.bucket(1, 129) is None  # longer than the cache: the exact path says why
    big = Runtime(target, 64, 128, prompt_buckets=True)
    assert big.bucket(32, 100) == 128 and big.bucket(33, 100) is None  # > 4,096 tokens: exact
    assert Runtime(target, 4, 128).bucket(1, 5) is None  # CPU default: buckets off


def test_bucketed_prompts_equal_exact_ones(setup):
    """A prompt padded to its bucket gives the exact prompt's logits, aux states and caches, and
    every decoder on it the same greedy output (CPU runs the padded forward eagerly; the GPU
    replays a graph of the same forward)."""
    target, _, ref, seq = setup
    exact, padded_rt = Runtime(target, 4, 128), Runtime(target, 4, 128, prompt_buckets=True)
    toks = torch.tensor([p + [0] * (9 - len(p)) for p in PROMPTS])
    lens = torch.tensor([len(p) for p in PROMPTS])
    a, b = exact.prompt(toks, lens, (0, 2)), padded_rt.prompt(toks, lens, (0, 2))
    assert padded_rt.bucket(4, 9) == 16 and b.aux.shape == a.aux.shape
    assert torch.allclose(a.logits, b.logits, atol=1e-5) and torch.allclose(a.aux, b.aux, atol=1e-5)
    for c, d in zip(exact.caches, padded_rt.caches, strict=True):
        for row, n in enumerate(lens.tolist()):
            assert torch.allclose(c.k[row, :, :n], d.k[row, :, :n], atol=1e-5)
    assert generate(padded_rt, PROMPTS, NEW, eos_ids=[]) == ref
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    for steps, topk, n in ((3, 1, None), (3, 2, 6)):
        assert SpecDecoder(padded_rt, drafter, steps, topk, n).generate(
            PROMPTS, NEW, eos_ids=[]).tokens == ref


@pytest.mark.parametrize("drafter_cls", [Eagle3Drafter, Steered])
def test_bucketed_drafter_prompt_pass_equals_the_chunked_one(setup, drafter_cls):
    """The drafter's prompt pass padded to the target's bucket (one graph per bucket on the GPU,
    logits only at each row's last position) leaves the first draft step the same root logits
    and hidden, and the drafter's cache the same K/V up to each row's length, as the exact,
    chunked pass over every position."""
    target, _, _, seq = setup
    drafter = make_drafter(target, 96, drafter_cls)
    if drafter_cls is Steered:
        drafter.steer(seq, 0.7)
    assert Runtime(target, 4, 128, prompt_buckets=True).bucket(4, max(map(len, PROMPTS))) == 16
    assert_same_prefill(drafter, Runtime(target, 4, 128),
                        Runtime(target, 4, 128, prompt_buckets=True), 1e-5)


def assert_same_prefill(drafter, rt_a: Runtime, rt_b: Runtime, atol: float) -> None:
    """Both runtimes' speculative prefills leave the first draft step the same root logits and
    hidden, and the drafter's cache the same K/V up to each row's length."""
    a, b = (SpecDecoder(rt, drafter, 3, 2, 6).start(PROMPTS, NEW, []) for rt in (rt_a, rt_b))
    assert torch.allclose(a.root_logits, b.root_logits, atol=atol)
    assert torch.allclose(a.root_hidden, b.root_hidden, atol=atol)
    for c, d in zip(a.dcaches, b.dcaches, strict=True):
        for row, p in enumerate(PROMPTS):
            assert torch.allclose(c.k[row, :, :len(p)], d.k[row, :, :len(p)], atol=atol)
            assert torch.allclose(c.v[row, :, :len(p)], d.v[row, :, :len(p)], atol=atol)


def test_graph_owner_tags_are_never_reused_and_die_with_their_owner(monkeypatch):
    """Decoders and drafter runtimes key their graphs by an owner tag, not id(owner): CPython
    hands a dead object's id() to a new one, and a key built from it named the dead drafter
    runtime's prompt graph, which the new one replayed over freed buffers (H200 run 15's
    device-side assert). Decoders made and dropped one after another on one runtime, as
    gpu_suite does: each prefill captures under its own tags only, a dropped decoder's graphs
    are forgotten, the runtime's own stay. On CPU a capture runs its callable once (eagerly)."""
    def capture(self, key, fn, warmup=2):
        self.graphs[key] = (None, fn())
        return self.graphs[key][1]

    monkeypatch.setattr(Graphs, "capture", capture)
    monkeypatch.setattr(Graphs, "replay", lambda self, key: self.graphs[key][1])
    target = tiny_target()
    rt = Runtime(target, 4, 128, graphs=True)
    drafter = make_drafter(target, 96)
    tags, ids = set(), set()
    for i in range(12):
        dec = SpecDecoder(rt, drafter, 3, 1 + i % 2, None if i % 2 == 0 else 6)
        dec.start(PROMPTS, NEW, [])
        mine = (dec.gkey, dec.drt.gkey)
        assert tags.isdisjoint(mine)
        tags.update(mine)
        ids.update((id(dec), id(dec.drt)))
        owned = {k[0] for k in rt.graphs.graphs if isinstance(k[0], tuple)}
        assert owned == set(mine)  # the phases' graphs and the drafter prompt pass's
        del dec
    assert len(ids) < len(tags), "CPython reused no id(), so this run could not show the hazard"
    assert all(not isinstance(k[0], tuple) for k in rt.graphs.graphs)
    assert any(k[0] == "prompt" for k in rt.graphs.graphs)  # the target's prompt graph stays


def test_forgetting_an_owner_while_another_is_forgotten_drops_both():
    """An owner's finalizer can fire in the middle of another `forget` (a collection the match
    function's allocations trigger, or another thread's): the dict it walks changes under it.
    Both owners' graphs go, every other graph stays, and nothing raises."""
    class Owner:
        pass

    g = Graphs(torch.device("cpu"))
    a, b = g.owner(Owner()), g.owner(Owner())  # owners collected at once: tags only
    g.graphs = {(a, 1): 1, (a, 2): 2, (b, 1): 3, ("prompt", 4): 4}

    def match(key):
        g.forget(b)  # b's finalizer, firing mid-walk
        return isinstance(key, tuple) and key[:1] == (a,)

    g.drop(match)
    assert list(g.graphs) == [("prompt", 4)]


def test_no_graph_is_destroyed_while_a_capture_runs():
    """Destroying a CUDA graph during another's capture invalidates the capture (H200: the
    fifth `run_bench` of one process died in a prompt graph's capture, CUBLAS_STATUS_EXECUTION_
    FAILED, after the cyclic GC collected earlier runs' decoders mid-capture). Inside the guard
    the cyclic GC waits, and graphs an owner's finalizer drops are held: gone from the dict (never
    replayed) but alive until the last nested capture ends."""
    import gc
    import weakref

    from draftsmith.engine.graphs import capture_guard

    class Graph:
        pass

    class Owner:
        pass

    g = Graphs(torch.device("cpu"))
    dead = Owner()
    dead.me = dead  # cyclic garbage, as a decoder holding its prefillers is
    tag = g.owner(dead)
    graph = Graph()
    alive = weakref.ref(graph)
    g.graphs = {(tag, 1): (graph, None), ("prompt", 4): (Graph(), None)}
    del graph, dead
    with capture_guard():
        with capture_guard():  # a nested capture (a graph's first run captures another)
            junk = [[i] for i in range(50_000)]  # would trigger collections with the GC on
            assert list(g.graphs) == [(tag, 1), ("prompt", 4)]  # the owner was not collected
            gc.collect()  # an explicit collection still runs: its finalizer drops the graph
            assert list(g.graphs) == [("prompt", 4)]
        assert alive() is not None, "destroyed while the outer capture runs"
        assert not gc.isenabled()
    assert alive() is None and gc.isenabled()
    del junk


def test_top_k_by_max_equals_torch_topk():
    """DRAFTSMITH_TREE_TOPK=max picks what torch.topk picks: the same values and indices, best
    first; ties go to the lower index."""
    from draftsmith.engine.tree import top_k_by_max

    x = torch.randn(3, 4, 500, generator=torch.Generator().manual_seed(1))
    for k in (1, 4, 8):
        v, i = top_k_by_max(x, k)
        ref = x.topk(k, dim=-1)
        assert torch.equal(v, ref.values) and torch.equal(i, ref.indices)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    v, i = top_k_by_max(tied, 4)
    assert i.tolist() == [[1, 2, 4, 0]] and v.tolist() == [[3.0, 3.0, 3.0, 1.0]]
    v, i = torch.compile(top_k_by_max, fullgraph=True)(x, 4)  # as the compiled engine runs it
    ref = x.topk(4, dim=-1)
    assert torch.equal(v, ref.values) and torch.equal(i, ref.indices)


def test_tree_topk_default_is_chunk_and_max_keeps_the_root_pick_eager(monkeypatch):
    """The default is the two-stage chunked top-k (fastest on the H200, run 8). Under max the
    compiled engine leaves the root's children to eager code (inductor 2.11 failed to fuse the
    compiled pick at batch 1), and compiles the rest as under the other methods."""
    from draftsmith.engine import tree

    assert tree.TREE_TOPK == "chunk"  # the default, unless the environment overrides it
    shape = tree.TreeShape(4, 3, 8)
    for method, root_compiled in (("chunk", True), ("topk", True), ("max", False)):
        monkeypatch.setattr(tree, "TREE_TOPK", method)
        t = tree.TreeDraft(shape, 1, 8, 32, torch.float32, torch.device("cpu"), sampling=False)
        t.compile()
        root, grow, pick = t.fns
        assert (root is not tree.greedy_children) is root_compiled, method
        assert grow is not tree.grow_greedy and pick is not tree.pick_nodes


def test_top_k_chunked_equals_torch_topk():
    """DRAFTSMITH_TREE_TOPK=chunk picks what torch.topk picks, whole slices or padded, with
    several best values in one slice, and ties across slices to the lower index."""
    from draftsmith.engine.tree import top_k_by_max, top_k_chunked

    g = torch.Generator().manual_seed(2)
    for v in (512, 500, 24576 // 64):
        x = torch.randn(2, 4, v, generator=g)
        x[0, 0, 7:11] = 9.0 + torch.arange(4.0)  # the four best in one slice
        for k in (1, 4, 8):
            got, ref = top_k_chunked(x, k, chunk=64), x.topk(k, dim=-1)
            assert torch.equal(got[0], ref.values) and torch.equal(got[1], ref.indices), (v, k)
    tied = torch.zeros(1, 300)
    tied[0, [250, 5, 130]] = 1.0
    assert top_k_chunked(tied, 3, chunk=64)[1].tolist() == [[5, 130, 250]]
    assert torch.equal(top_k_chunked(tied, 5, chunk=64)[1], top_k_by_max(tied, 5)[1])
    check_lse(top_k_chunked, torch.randn(3, 4, 1000, generator=g) * 8)


@pytest.mark.slow  # two CPU compiles (~6 s)
def test_top_k_chunked_compiled_equals_torch_topk():
    """Compiled as the engine runs it, top_k_chunked still picks torch.topk's and its lse."""
    from draftsmith.engine.tree import top_k_chunked

    x = torch.randn(3, 4, 1000, generator=torch.Generator().manual_seed(2)) * 8
    got = torch.compile(top_k_chunked, fullgraph=True)(x, 4, 128)
    ref = x.topk(4, dim=-1)
    assert torch.equal(got[0], ref.values) and torch.equal(got[1], ref.indices)
    check_lse(torch.compile(top_k_chunked, fullgraph=True), x)


def check_lse(fn, x: torch.Tensor) -> None:
    for v in (1000, 768, 200):  # padded, whole slices, one stage (too short to chunk)
        *top, lse = fn(x[..., :v], 4, 128, True)
        assert torch.allclose(lse, x[..., :v].logsumexp(-1, keepdim=True), atol=1e-5), v
        assert torch.equal(top[1], x[..., :v].topk(4, dim=-1).indices)


def assert_same_trees_each_cycle(a_dec, b_dec, before, after=lambda: None) -> None:
    """Decode PROMPTS with both decoders cycle by cycle, `before(i)` ahead of decoder i's cycle
    and `after()` behind the second's, and assert both built the same tree each cycle and end
    together."""
    torch.set_grad_enabled(False)
    try:
        a, b = a_dec.start(PROMPTS, NEW, []), b_dec.start(PROMPTS, NEW, [])
        for _ in range(NEW):
            before(0)
            a_dec.cycle(a)
            before(1)
            b_dec.cycle(b)
            after()
            for name in ("node_tok", "node_parent", "node_depth", "anc"):
                assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
            if a_dec.finished(a):
                break
        assert b_dec.finished(b)
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("steps,topk,n,method", [
    (3, 2, 6, "max"), (4, 4, 10, "max"), (4, 4, 10, "chunk")])
def test_tree_topk_by_max_builds_the_same_trees(setup, steps, topk, n, method, monkeypatch):
    """The same trees cycle by cycle under torch.topk and the masked-max methods (chunk: 16-wide
    slices of the 96-token draft vocab), and plain greedy output."""
    from draftsmith.engine import tree

    monkeypatch.setattr(tree, "CHUNK", 16)
    target, rt, ref, _ = setup
    drafter = make_drafter(target, 96)
    a_dec, b_dec = (SpecDecoder(rt, drafter, steps, topk, n) for _ in range(2))
    assert_same_trees_each_cycle(
        a_dec, b_dec, lambda i: monkeypatch.setattr(tree, "TREE_TOPK", ("topk", method)[i]))
    assert b_dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref


@pytest.mark.parametrize("steps,topk,n,root,join", [(3, 2, 6, "logits", "torch"),
                                                    (3, 2, 6, "triton", "torch"),
                                                    pytest.param(4, 4, 10, "triton", "torch",
                                                                 marks=pytest.mark.slow),
                                                    # the interpreter's join: ~80 s on CPU
                                                    pytest.param(4, 4, 10, "triton", "kernel",
                                                                 marks=pytest.mark.slow)])
def test_the_triton_draft_head_builds_the_same_trees(setup, steps, topk, n, root, join,
                                                     monkeypatch):
    """DRAFTSMITH_DRAFT_HEAD=triton (the drafter stops before its head; head and top-k in one
    Triton pass, here in its interpreter, 32-entry blocks: three over the 96-token draft vocab):
    the same trees cycle by cycle as the head in a matmul followed by the tree's top-k, batch
    4, and plain greedy output. Under DRAFTSMITH_ROOT_HEAD=triton the root's children come the
    same way, so no drafter call of such a cycle, its extend included, forms logits; under
    logits they come from the extend's logits. DRAFTSMITH_HEAD_JOIN=kernel: the kernel joins its
    blocks itself."""
    pytest.importorskip("triton")
    from draftsmith.engine import tree
    from draftsmith.models import triton_head

    monkeypatch.setattr(triton_head, "BLOCK_V", 32)
    monkeypatch.setattr(tree, "ROOT_HEAD", root)
    monkeypatch.setattr(triton_head, "JOIN", join)
    by_head = root == "triton"

    target, rt, ref, _ = setup
    drafter = make_drafter(target, 96)
    a_dec, b_dec = (SpecDecoder(rt, drafter, steps, topk, n) for _ in range(2))
    calls = []
    real = triton_head.head_top_k
    monkeypatch.setattr(triton_head, "head_top_k", lambda *a: calls.append(1) or real(*a))
    formed = []  # each drafter call's `logits` flag
    head = drafter.head
    monkeypatch.setattr(drafter, "head", lambda h, logits=True: formed.append(logits)
                        or head(h, logits))

    def before(i: int) -> None:
        assert not calls  # the cuBLAS head's cycle called no kernel
        if i:
            assert formed and all(formed)
            formed.clear()
        monkeypatch.setattr(tree, "DRAFT_HEAD", ("cublas", "triton")[i])

    def after() -> None:
        assert len(calls) == steps - 1 + by_head  # every depth past the root, and the root
        # the depths past the root form none, the extend only for the root
        assert len(formed) == steps and sum(formed) == (not by_head)
        calls.clear()
        formed.clear()

    assert_same_trees_each_cycle(a_dec, b_dec, before, after)
    assert b_dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref


def test_a_drafter_that_bends_its_logits_keeps_them_under_the_triton_head(setup, monkeypatch):
    """DRAFTSMITH_DRAFT_HEAD=triton never applies the head of a drafter whose logits are not its
    plain head's (`plain_head = False`, as the steered one): the head kernel is not called, and
    its trees accept as many tokens as under the cuBLAS head. A subclass that overrides forward
    is taken for one that bends them unless it says otherwise; a top-k past the kernel's keeps
    the cuBLAS head too."""
    from draftsmith.engine import tree
    from draftsmith.models import triton_head

    class Overrides(Eagle3Drafter):
        def forward(self, *a, **kw):
            return super().forward(*a, **kw)

    class SaysPlain(Overrides):
        plain_head = True

    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.7)
    plain = make_drafter(target, 96)
    x = torch.zeros(1, 1, 64)
    monkeypatch.setattr(triton_head, "runs_on", lambda t: True)
    monkeypatch.setattr(tree, "DRAFT_HEAD", "triton")
    assert tree.fuses_head(plain, x, 4) and not tree.fuses_head(drafter, x, 4)
    assert not tree.fuses_head(plain, x, triton_head.MAX_K + 1)
    assert not Overrides.plain_head and SaysPlain.plain_head and not Steered.plain_head
    monkeypatch.setattr(triton_head, "head_top_k", lambda *a: pytest.fail("head kernel called"))
    res = SpecDecoder(rt, drafter, 4, 4, 10).generate(PROMPTS, NEW, eos_ids=[])
    monkeypatch.setattr(tree, "DRAFT_HEAD", "cublas")
    want = SpecDecoder(rt, drafter, 4, 4, 10).generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref and res.mean_accept_length == want.mean_accept_length > 1.2


def test_a_shallower_tree_accepts_at_least_the_deep_trees_path_cut_to_its_depth(setup):
    """benchmarks/adaptive_depth.py credits a depth-d tree (same top-k, same budget) with
    min(accepted, d) of the deeper tree's cycle: its candidates are the deep tree's up to depth
    d, so its best nodes include every deep-tree node there. One cycle from many prefixes."""
    target, rt, ref, seq = setup
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.85)
    deep, shallow = SpecDecoder(rt, drafter, 6, 3, 10), SpecDecoder(rt, drafter, 3, 3, 10)
    pairs = []
    for r, p in enumerate(PROMPTS):
        drafter.row0 = r
        for i in range(0, NEW - 8, 3):
            got = []
            for dec in (deep, shallow):
                st = dec.start([p + ref[r][:i]], 16, [])
                before = int(st.count[0])
                dec.cycle(st)
                got.append(int(st.count[0]) - before - 1)  # drafts accepted
            pairs.append(got)
    assert all(s >= min(d, 3) for d, s in pairs), pairs
    assert any(d > 3 for d, _ in pairs) and any(0 < d < 3 for d, _ in pairs)  # both regimes
