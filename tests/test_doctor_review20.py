"""Doctor review 20: stored states more than 3 tokens off their input_ids are named by their real
cause (they read as "not captured from this target"); the wider search costs data of another
target no more full probes, and short samples neither end the search nor make a finding."""

from __future__ import annotations

from typing import Any

import pytest
import test_doctor as td
import torch
from test_doctor import TRUE, doctor, errors
from test_doctor_review18 import _shifted

from draftsmith.data.shards import Dataset
from draftsmith.doctor import wiring

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5 (96 tokens each)
target_dir, target, data_dir = td.target_dir, td.target, td.data_dir


@pytest.mark.parametrize(("by", "words", "fix"), [
    (5, "run 5 tokens behind", "input_ids[5:] beside the states [:-5]"),
    (30, "run 30 tokens behind", "input_ids[30:] beside the states [:-30]"),
    (-5, "run 5 tokens ahead of",
     "the dropped first tokens [3, 92, 90, 76, 89] prepended to input_ids[:-5]"),
])
def test_ids_more_than_three_tokens_off_their_states_are_named(data_dir, target_dir, tmp_path,
                                                               by, words, fix):
    """Only 1 to 3 were tried: four errors said "not captured from this target ... --target"."""
    rep = doctor(data=_shifted(data_dir, tmp_path / "s", by), target=str(target_dir))
    (f,) = errors(rep, "wiring")
    assert f.what.startswith(f"the shards' input_ids {words} their hidden states")
    assert f.fix.endswith(f"realign each sample: {fix}") and "--target" not in f.fix
    assert rep.wiring["token_shift"] == by and rep.wiring["true_ids"] == TRUE


def _model(target: Any) -> Any:
    return target.build(torch.float32, "cpu")


def _count_probes(monkeypatch) -> list[int]:
    probes: list[int] = []
    real = wiring._match

    def counted(model, ds, layers, n, *a):
        probes.append(n)
        return real(model, ds, layers, n, *a)

    monkeypatch.setattr(wiring, "_match", counted)
    return probes


def test_another_targets_data_costs_no_more_full_probes(data_dir, tmp_path, monkeypatch):
    """The wider shifts are screened by each view's first states (one short forward), so data
    of another target runs the probes the 1-3 token search ran, and names no shift."""
    from conftest import write_tiny_folder

    from draftsmith.targets import load_target

    other = load_target(write_tiny_folder(tmp_path / "o", "llama", seed=1, num_hidden_layers=8))
    probes = _count_probes(monkeypatch)
    mm = wiring.match(_model(other), Dataset(data_dir), 8, 2, 256, True, (1, 3),
                      (3, 92, 90, 76, 89, 6))
    assert mm.token_shift is None and probes.count(1) <= 11


class _Short:
    """A dataset whose first samples are short (`keep` tokens), read from `ds`."""

    def __init__(self, ds: Any, keep: dict[int, int]) -> None:
        self.ds, self.keep, self.manifest = ds, keep, ds.manifest

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = dict(self.ds[i])
        n = self.keep.get(i)
        return s if n is None else {k: v[:n] for k, v in s.items()}


@pytest.mark.parametrize(("by", "keep"), [(3, 2), (5, 4)])
def test_a_short_first_sample_does_not_end_the_search(data_dir, target, tmp_path, by, keep):
    """A first sample of 2 tokens ended every realignment at a 2-token shift ("a sample too
    short to realign"): the 3-token shift of the long samples went unnamed."""
    ds = _Short(Dataset(_shifted(data_dir, tmp_path / "s", by)), {0: keep})
    mm = wiring.match(_model(target), ds, 8, 2, 256, True, (1, 3), (3, 92, 90, 76, 89, 6))
    assert mm.token_shift == by and mm.true_ids() == TRUE


def test_short_samples_of_aligned_data_name_no_shift(data_dir, target):
    ds = _Short(Dataset(data_dir), {i: 6 for i in range(6)})
    mm = wiring.match(_model(target), ds, 8, 2, 256, True, (1, 3), (3, 92, 90, 76, 89, 6))
    assert mm.token_shift is None


class _Mixed(_Short):
    """`ds` with the states of samples other than `keep`'s keys replaced by noise."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = dict(self.ds[i])
        if i not in self.keep:
            g = torch.Generator().manual_seed(i)
            for k in ("aux", "hidden"):
                s[k] = torch.randn(s[k].shape, generator=g)
        return s


def test_a_shift_of_the_probed_sample_alone_is_not_named(data_dir, target, tmp_path):
    """The realignment that matched the one probed sample was named as the data's ("every stored
    state matches the live one of the token at input_ids[t + 2]") though the other compared
    samples' states match no live state."""
    ds = _Mixed(Dataset(_shifted(data_dir, tmp_path / "s", 2)), {0: 0})
    mm = wiring.match(_model(target), ds, 8, 3, 256, True, (1, 3), (3, 92, 90, 76, 89, 6))
    assert mm.token_shift is None


def test_a_neighbour_holding_only_the_shared_opening_is_not_named_as_the_states_source(
        data_dir, target, tmp_path):
    """Sample 0 holds sample 2's states; neighbour 1, cut to the 7 template tokens every sample
    opens with, matched those states on all it has and was named their source ("sample 0's
    stored states are those of sample 1's input_ids")."""
    from test_doctor_review2 import edit_shards
    from test_doctor_review19 import _swap

    ds = _Short(Dataset(edit_shards(data_dir, tmp_path / "sw", _swap)), {1: 7})
    mm = wiring.match(_model(target), ds, 8, 2, 256, True, (1, 3), (3, 92, 90, 76, 89, 6))
    assert mm.paired == {0: 2, 5: 4} and mm.true_ids() == TRUE
