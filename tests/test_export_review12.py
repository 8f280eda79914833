"""Export review 12: what vLLM reads of a speculators export, said at export itself."""

from __future__ import annotations

import json
import warnings

from test_export import make

from draftsmith.export import export_drafter


def _export(target, tmp_path, name: str, **over):
    src = make(target, tmp_path / f"d-{name}", **over)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_drafter(src, "speculators", tmp_path / name, target=str(target.folder))
    return out, [str(w.message) for w in caught]


def test_export_warns_in_one_line_of_norm_flags_an_older_vllm_drops(target, tmp_path):
    """vLLM's speculators reader (algos.update_eagle3) passes norm_before_fc on only from PR
    #38111 and fc_norm/norm_output from #46488; before, norm_output is dropped without a word.
    The export itself says so (demo and tune export through the API, not the CLI's hint)."""
    for flag, pr in (("norm_output", "#46488"), ("fc_norm", "#46488"),
                     ("norm_before_fc", "#38111")):
        _, said = _export(target, tmp_path, flag, **{flag: True})
        lines = [m for m in said if flag in m]
        assert len(lines) == 1 and "\n" not in lines[0], said
        assert "vLLM" in lines[0] and pr in lines[0]


def test_export_of_plain_flags_says_nothing_of_vllm(target, tmp_path):
    _, said = _export(target, tmp_path, "plain", norm_before_residual=True)
    assert not [m for m in said if "vLLM" in m], said


def test_a_two_state_export_warns_and_names_its_count_for_vllm(target, tmp_path):
    """vLLM's Eagle-3 model sizes fc by `num_aux_hidden_states` where it reads one (else 3):
    the count is written into transformer_layer_config, which vLLM's speculators reader makes
    the draft's config; the export warns that an older vLLM still builds fc for 3."""
    out, said = _export(target, tmp_path, "two", aux=[1, 3])
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["num_aux_hidden_states"] == 2
    lines = [m for m in said if "aux layers" in m and "vLLM" in m]
    assert len(lines) == 1 and "exactly 3" in lines[0], said


def test_a_three_state_export_writes_no_count(target, tmp_path):
    out, said = _export(target, tmp_path, "three")
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert "num_aux_hidden_states" not in layer
    assert not [m for m in said if "vLLM" in m], said


def test_the_cli_says_each_vllm_note_once(target, tmp_path):
    """The export command prints the notes in its serve hint; the export's own warning of the
    same note is not said a second time on stderr."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.export.cli import export

    app = typer.Typer()
    app.command()(export)
    src = make(target, tmp_path / "d", norm_output=True)
    r = CliRunner().invoke(app, [str(src), "-f", "speculators", "-o", str(tmp_path / "o"),
                                 "--target", str(target.folder)])
    assert r.exit_code == 0, r.output
    assert r.output.count("norm_output set") == 1, r.output
