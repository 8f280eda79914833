"""compare, second review: strict JSON, one clear error for an unreadable folder or a run past
the target's positions, the aux ids compare measured on shown where an engine reads others, the
same folder twice, and targets or draft vocabs that differ without a fingerprint to say so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from test_compare import build, drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, differences, run_compare
from draftsmith.compare.describe import describe
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
from draftsmith.targets import load_target


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _no_nan(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_nan_in_a_drafters_files_is_null_in_compare_json(drafters, tmp_path):  # noqa: F811
    """A training summary holding NaN (Python's json writes and reads it) went into compare.json
    as the NaN literal, which jq and JavaScript refuse."""
    a = shutil.copytree(drafters["A"], tmp_path / "nan")
    _edit_json(a / "draftsmith.json", lambda d: d.update(
        training={"steps": 3, "last_loss": float("nan"), "last_cond_acc": [0.5, float("inf")]}))
    res = run_compare(CompareOptions([str(a), str(drafters["B"])], out=tmp_path / "out"))
    saved = _no_nan((tmp_path / "out" / "compare.json").read_text())
    training = saved["drafters"][0]["training"]
    assert training == {"steps": 3, "last_loss": None, "last_cond_acc": [0.5, None]}
    assert res["drafters"][0]["training"] == training
    assert "| training last_cond_acc | 0.5, - |" in (tmp_path / "out" / "compare.md").read_text()


def _truncate(folder: Path) -> None:
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])


@pytest.mark.parametrize("name,spoil,words", [
    ("truncated", _truncate, "cannot read its weights"),
    ("no heads", lambda f: _edit_json(f / "config.json",
                                      lambda c: c.pop("num_attention_heads")),
     "num_attention_heads is None, not a whole number"),
    ("text heads", lambda f: _edit_json(f / "config.json",
                                        lambda c: c.update(num_attention_heads="four")),
     "num_attention_heads is 'four', not a whole number"),
])
def test_an_unreadable_folder_is_one_clear_error(drafters, tmp_path, name, spoil,  # noqa: F811
                                                 words):
    """A cut safetensors file or a config without its head count was a SafetensorError or a
    TypeError traceback."""
    bad = shutil.copytree(drafters["B-specforge"], tmp_path / "bad")
    spoil(bad)
    with pytest.raises(DraftsmithError, match=f"{bad}.*{words}"):
        run_compare(CompareOptions([str(drafters["A"]), str(bad)]))


def test_new_tokens_past_the_targets_positions_are_refused(drafters, tiny_llama_dir,  # noqa: F811
                                                           monkeypatch):
    """bench refuses a prompt + --max-new-tokens past max_position_embeddings (512 here);
    compare decoded on past them without a word, before building a model it refuses now."""
    from draftsmith.targets import Target

    monkeypatch.setattr(Target, "build", lambda *a: pytest.fail("built the target"))
    with pytest.raises(DraftsmithError, match="--max-new-tokens = .* exceeds the target's "
                                              "max_position_embeddings 512"):
        run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                   target=str(tiny_llama_dir), num_prompts=1, max_new=600))


def test_the_ids_compare_measured_on_are_shown_where_the_engine_feeds_others(
        drafters, tiny_llama_dir, tmp_path):  # noqa: F811
    """An SGLang folder with only vLLM's top-level ids: SGLang feeds its defaults (the table
    said so), but compare's run read the top-level ids, as `import` does; nothing said the
    acceptance shown was on other layers than the table's."""
    top = shutil.copytree(drafters["B-specforge"], tmp_path / "toponly")
    _edit_json(top / "config.json", lambda c: c.update(
        eagle_config={"use_aux_hidden_state": True}, eagle_aux_hidden_state_layer_ids=[2, 3, 4]))
    paths = [str(drafters["B"]), str(top), str(drafters["B-specforge"])]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), num_prompts=1,
                                     max_new=4, steps=1, out=tmp_path / "out"))
    ids = {d["label"]: (d["aux_ids_canonical"], d["aux_ids_measured"]) for d in res["drafters"]}
    assert ids == {"big": ([1, 2, 3], [1, 2, 3]), "toponly": ([1, 2, 2], [1, 2, 3]),
                   "specforge": ([1, 2, 3], [1, 2, 3])}
    flagged = [n for n in res["notes"] if "was measured on canonical aux layers" in n]
    assert flagged == ["toponly was measured on canonical aux layers [1, 2, 3] (its config as "
                       "`draftsmith import` reads it), but SGLang feeds it [1, 2, 2]: its "
                       "acceptance there may differ from this one"]
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| canonical, as compare measured (as `draftsmith import` reads it) | 1, 2, 3 |" in md


def test_the_same_folder_twice_is_said_to_be_so(drafters, tmp_path):  # noqa: F811
    link = tmp_path / "again"
    link.symlink_to(drafters["A"])
    notes = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"]),
                                        str(link)]))["notes"]
    assert [n for n in notes if "same folder" in n] == [
        f"A:small and C:small are the same folder ({drafters['A'].resolve()}): their figures "
        "differ by measurement noise alone"]


def _unrecorded(target, out: Path) -> Path:
    """A drafter that records no target fingerprint, as an external folder would."""
    cfg = Eagle3Config.for_target(target.cfg, 32, [0, 2, 4], intermediate_size=128)
    torch.manual_seed(0)
    return save_drafter(Eagle3Drafter(cfg), out)


def test_targets_that_differ_in_size_are_named_without_a_fingerprint(drafters,  # noqa: F811
                                                                     tmp_path):
    """Folders without a fingerprint (SpecForge's) for targets of another vocabulary: only "the
    architecture differs" was said, never that no one target measures both."""
    wide = load_target(str(write_tiny_folder(tmp_path / "wide", vocab_size=256)))
    other = describe(_unrecorded(wide, tmp_path / "other"), "other")
    sf = describe(drafters["B-specforge"], "sf")
    notes = differences([sf, other])
    assert any(n.startswith("sf and other were trained for different targets (target vocab 128 "
                            "vs 256)") for n in notes)
    assert not any("different targets" in n for n in differences([sf, describe(
        drafters["B-speculators"], "sp")]))


def test_draft_vocabs_of_one_size_over_other_tokens_are_not_alike(target, tmp_path):
    """Same architecture, same target, 32 draft tokens each but other ones: the report called
    them alike."""
    a = build(target, 128, 32, [0, 2, 4], 0)
    b = build(target, 128, 32, [0, 2, 4], 2)
    used = [set((d.d2t + torch.arange(32)).tolist()) for d in (a, b)]
    da, db = (describe(save_drafter(d, tmp_path / n), n) for d, n in ((a, "a"), (b, "b")))
    notes = differences([da, db])
    assert "a and b have the same architecture" in notes
    assert (f"a and b draft over different tokens: {len(used[0] & used[1])} of their 32 "
            "draft-vocab tokens are shared") in notes
    assert not any("different tokens" in n for n in differences([da, da]))


def test_a_multimodal_verifiers_layer_count_reads_the_ids(drafters, tmp_path):  # noqa: F811
    """A speculators folder whose verifier keeps its layers in text_config, as import reads
    them: compare said the target depth was unknown and showed no canonical ids."""
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 6}}))
    sp = shutil.copytree(drafters["B-speculators"], tmp_path / "sp")
    _edit_json(sp / "config.json", lambda c: c["speculators_config"]["verifier"].update(
        name_or_path=str(verifier)))
    d = describe(sp, "sp")
    assert d.ids_canonical == [1, 2, 3] and "depth unknown" not in d.ids_note
    # vLLM's 7 is canonical 6, past the 6 layers the verifier has
    _edit_json(sp / "config.json", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 7]))
    assert "out of range for this target" in describe(sp, "sp").ids_note


def test_an_engine_folder_that_does_not_fit_the_target_is_named(drafters, tmp_path):  # noqa: F811
    wide = write_tiny_folder(tmp_path / "wide", vocab_size=256)
    with pytest.raises(DraftsmithError, match="drafter specforge with this --target: .*embed"):
        run_compare(CompareOptions([str(drafters["B-specforge"]), str(drafters["A"])],
                                   target=str(wide), num_prompts=1, max_new=2, steps=1))
