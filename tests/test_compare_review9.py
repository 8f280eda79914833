"""compare, ninth review: targets and aux layers set side by side across every drafter, not
only against the first; an unknown layer list never called different; a folder without a
fingerprint flagged by the target depth it records; the timed runs' order rotated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from conftest import write_tiny_folder
from test_compare import build, drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, _other_target, differences, run_compare
from draftsmith.compare.describe import describe
from draftsmith.models.eagle3 import save_drafter
from draftsmith.targets import load_target


def _edit(folder: Path, edit) -> None:
    c = json.loads((folder / "config.json").read_text())
    edit(c)
    (folder / "config.json").write_text(json.dumps(c))


def test_an_unknown_layer_list_is_not_called_different(drafters, tmp_path):  # noqa: F811
    """An SGLang folder without ids and no --target: its layers are unknown, but the notes said
    "they read different target layers: [1, 2, 3] vs None"."""
    sg = shutil.copytree(drafters["B-specforge"], tmp_path / "sg")
    _edit(sg, lambda c: c.update(eagle_config={"use_aux_hidden_state": True}))
    notes = differences([describe(drafters["B"], "big"), describe(sg, "sg")])
    assert not any("None" in n or "different target layers" in n for n in notes)
    assert "sg: which target layers it reads is unknown here (see its aux ids note), so its " \
        "layers are not compared" in notes


def test_layers_are_compared_by_name_past_the_first(drafters):  # noqa: F811
    """Three drafters: "they read different target layers" named neither."""
    a, b, c = (describe(drafters[k], k) for k in ("A", "B", "B-specforge"))
    notes = differences([b, c, a])
    assert "B and A read different target layers: [1, 2, 3] vs [0, 2, 4] (canonical)" in notes
    assert not any(n.startswith("they ") for n in notes)


def test_two_later_drafters_of_different_targets_are_named(drafters, tmp_path):  # noqa: F811
    """The first folder records no target (SpecForge's): the second and third, trained for
    different targets, were each set only against it, and nothing was said."""
    other = load_target(str(write_tiny_folder(tmp_path / "t", "llama", seed=1)))
    c = save_drafter(build(other, 256, 64, [1, 2, 3], 1), tmp_path / "c")
    res = run_compare(CompareOptions([str(drafters["B-specforge"]), str(drafters["B"]),
                                      str(c)]))
    assert [n.split(" (")[0] for n in res["notes"] if "different targets" in n] == [
        "big and c were trained for different targets"]


def test_a_folder_without_a_fingerprint_for_a_deeper_target_is_flagged(drafters,  # noqa: F811
                                                                       tmp_path):
    """A speculators folder whose verifier has 8 layers, measured on a target of 6: its
    acceptance on a target it was not trained for went unflagged (no fingerprint)."""
    deep = write_tiny_folder(tmp_path / "deep", num_hidden_layers=8, seed=3)
    sp = shutil.copytree(drafters["B-speculators"], tmp_path / "sp")
    _edit(sp, lambda c: c["speculators_config"]["verifier"].update(name_or_path=str(deep)))
    descs = [describe(drafters["B"], "big", 6), describe(sp, "sp", 6)]
    fp = descs[0].info.recorded("target_fingerprint")
    six = SimpleNamespace(source="tiny", fingerprint=fp, cfg=SimpleNamespace(num_layers=6))
    assert _other_target(descs, six) == [
        "sp was trained for a target of 8 layers, but --target tiny has 6: its acceptance here "
        "is on a target it was not trained for"]
    assert _other_target([descs[0], describe(drafters["B-speculators"], "same", 6)], six) == []
    # measured on the target the drafters record, no --target was given to name
    other = SimpleNamespace(source="/t", fingerprint="0" * 16, cfg=six.cfg)
    assert _other_target(descs[:1], other, recorded=True)[0].startswith(
        f"big was trained for target fingerprint {fp}, but the target the drafters record, /t, "
        "has 0000")


def test_the_timed_runs_order_rotates_each_prompt(drafters, tiny_llama_dir,  # noqa: F811
                                                  monkeypatch):
    """The target alone, then A, then B, for every prompt: A always ran right after the
    baseline, B always last."""
    import draftsmith.engine.generate as generate
    from draftsmith.engine.speculative import SpecDecoder

    calls: list[object] = []
    real_run, real_gen = generate.run_generation, SpecDecoder.generate
    monkeypatch.setattr(generate, "run_generation",
                        lambda *a, **k: calls.append("base") or real_run(*a, **k))
    monkeypatch.setattr(SpecDecoder, "generate",
                        lambda self, *a, **k: calls.append(self) or real_gen(self, *a, **k))
    run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                               target=str(tiny_llama_dir), num_prompts=3, max_new=2, steps=1))
    names = {"base": "base", calls[1]: "A", calls[2]: "B"}  # the warm-up's order
    assert [names[c] for c in calls[3:]] == ["base", "A", "B", "A", "B", "base",
                                            "B", "base", "A"]
