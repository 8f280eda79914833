"""Import review 10: SpecForge's `norm_output` flag read as today's engines serve it.

SpecForge PR #879 (2026-09-15) changed the flag's meaning: before it, `norm_output: false` fed
lm_head the un-normed state (and true was plain EAGLE-3); since, false is plain EAGLE-3 and
true is EAGLE-3.1 (the normed state fed back), as SGLang and vLLM read it: both always feed
lm_head the final norm's output and take `norm_output` (default false) only for the state fed
to the next step. A folder carries no SpecForge version, so the import reads what the engines
serve and says, in one line, what it assumed and how to check."""

from __future__ import annotations

import warnings

import torch
from test_export import make
from test_export_review import engine_folder

from draftsmith.export import read_any
from draftsmith.export.layout import ImportNote
from draftsmith.models.eagle3 import load_drafter


def _read_noted(out, target):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = read_any(out, target=str(target.folder))
    notes = [w.message for w in caught if isinstance(w.message, ImportNote)
             and "norm_output" in str(w.message)]
    return back, notes


def assert_computes_alike(back, d) -> None:
    """The import's logits and fed-back state equal the source drafter's."""
    x, h = torch.randint(0, 128, (1, 5)), torch.randn(1, 5, 3, 64)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        want, want_fed = d(x, d.fuse(h), pos)
        got, got_fed = back(x, back.fuse(h), pos)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(got_fed, want_fed, atol=1e-6)


def test_norm_output_false_is_read_as_the_engines_serve_it(target, tmp_path):
    """SGLang and vLLM serve `norm_output: false` as plain EAGLE-3 (final norm before lm_head,
    pre-norm state fed back), as SpecForge trains it since #879; the import refused it."""
    d = load_drafter(make(target, tmp_path / "d", fc_norm=True))
    out = engine_folder(d, target, tmp_path / "sg", fc_norm=True, norm_output=False)
    back, notes = _read_noted(out, target)
    assert back.cfg.fc_norm and not back.cfg.norm_output
    assert_computes_alike(back, d)
    assert len(notes) == 1 and "\n" not in str(notes[0])
    assert "#879" in str(notes[0]) and "draftsmith bench --drafter" in notes[0].fix


def test_norm_output_true_note_names_both_specforge_readings(target, tmp_path):
    """The true reading depends on the SpecForge version too (before #879: plain EAGLE-3; since:
    EAGLE-3.1, as the engines serve it and the import reads it): the note says so and how to
    check, still in one line."""
    d = load_drafter(make(target, tmp_path / "d", fc_norm=True))
    out = engine_folder(d, target, tmp_path / "sg", fc_norm=True, norm_output=True)
    _, notes = _read_noted(out, target)
    assert len(notes) == 1 and "\n" not in str(notes[0])
    assert "#879" in str(notes[0]) and "draftsmith bench --drafter" in notes[0].fix


def test_no_norm_output_key_says_nothing(target, tmp_path):
    d = load_drafter(make(target, tmp_path / "d"))
    _, notes = _read_noted(engine_folder(d, target, tmp_path / "sg"), target)
    assert notes == []


def test_norm_output_true_feeds_the_normed_state_back_as_the_engines_do(target, tmp_path):
    """SGLang's llama_eagle3.py (`aux = hidden_states_to_logits if self.norm_output else
    hidden_states_to_aux`) and vLLM feed the normed state to the next step under
    `norm_output: true`, as draftsmith's own `norm_output` does; the import dropped the flag,
    drafting otherwise from the second step."""
    d = load_drafter(make(target, tmp_path / "d", fc_norm=True, norm_output=True))
    out = engine_folder(d, target, tmp_path / "sg", fc_norm=True, norm_output=True)
    back, _ = _read_noted(out, target)
    assert back.cfg.norm_output
    assert_computes_alike(back, d)
