"""compare, fifth review (and the dataset manifest it and training read): a malformed manifest
or drafter record was a KeyError/ValueError/TypeError traceback; a manifest compare could not
read vanished from its tables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)
from test_data_shards import make_samples, write

from draftsmith.compare import CompareOptions, _speed, run_compare
from draftsmith.compare.describe import describe
from draftsmith.compare.report import markdown
from draftsmith.data.shards import MANIFEST, Dataset, is_complete, read_manifest, verify
from draftsmith.errors import DraftsmithError


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def dataset(tmp_path) -> Path:
    write(tmp_path / "d", [make_samples(3), make_samples(2, seed=1)])
    return tmp_path / "d"


@pytest.mark.parametrize("key,value", [
    ("hidden_size", "eight"), ("hidden_size", None), ("hidden_size", 8.5),
    ("aux_layer_ids", 3), ("aux_layer_ids", None), ("target", None), ("target", "abc"),
    ("totals", [1, 2]), ("totals", {"samples": "5"}), ("complete", "false"),
    ("vocab_size", "big"),
])
def test_a_malformed_manifest_key_is_named_when_read(dataset, key, value):
    """Dataset() (training's and the doctor's first read) and verify() (the doctor's shard
    check) name the manifest and key; before, int("eight") in verify was a ValueError, a null
    target an AttributeError in training, "false" read as a complete capture."""
    _edit(dataset / MANIFEST, lambda m: m.update({key: value}))
    for read in (Dataset, verify):
        with pytest.raises(DraftsmithError, match=f"{dataset / MANIFEST}: {key} is "):
            read(dataset)


@pytest.mark.parametrize("key", ["hidden_size", "aux_layer_ids"])
def test_a_missing_width_is_named_where_it_is_needed(dataset, key):
    """A manifest without the widths still opens (an external one: inspect reads it), but the
    shard check and the reader's widths name the key, not a KeyError."""
    _edit(dataset / MANIFEST, lambda m: m.pop(key))
    ds = Dataset(dataset)
    with pytest.raises(DraftsmithError, match=f"{dataset / MANIFEST}: no {key} in the manifest"):
        verify(dataset)
    with pytest.raises(DraftsmithError, match=f"no {key} in the manifest"):
        getattr(ds, key)


def test_null_totals_and_dtype_read_as_absent(dataset):
    """A null dtype reads as bfloat16 and a null totals as none recorded (verify's totals
    check was an AttributeError on None)."""
    _edit(dataset / MANIFEST, lambda m: m.update(totals=None, dtype=None))
    assert verify(dataset)["samples"] == 5
    assert is_complete(read_manifest(dataset))


def test_a_wellformed_manifest_still_reads(dataset):
    assert Dataset(dataset).hidden_size == 8 and verify(dataset)["shards"] == 2


def _with_layers(folder: Path, value) -> None:
    _edit(folder / "config.json",
          lambda c: c.update(draftsmith={"target_num_layers": value}))


def test_a_malformed_target_layer_count_is_one_error(drafters, tmp_path):  # noqa: F811
    """An engine folder's recorded target_num_layers, read to range-check its ids without
    --target, was int("thirty"): a ValueError traceback."""
    bad = shutil.copytree(drafters["B-specforge"], tmp_path / "bad")
    _with_layers(bad, "thirty")
    with pytest.raises(DraftsmithError, match=r"config.json: draftsmith.target_num_layers is "
                                              r"'thirty', not a whole number"):
        describe(bad, "bad")
    assert describe(bad, "bad", num_layers=6).ids_canonical == [1, 2, 3]  # --target's layers
    _with_layers(bad, 0)  # draftsmith's "not recorded": the ids are read without a range check
    assert "target depth unknown" in describe(bad, "bad").ids_note


def test_malformed_drafter_records_go_on_without_them(drafters, tmp_path):  # noqa: F811
    """A hand-edited draftsmith.json whose data or training record is no object, an imported
    record without its source, or a bad canonical-ids record: compare went down with an
    AttributeError/KeyError/TypeError; now those rows are left out."""
    a = shutil.copytree(drafters["A"], tmp_path / "a")
    _edit(a / "draftsmith.json", lambda d: d.update(data="offline", training=[1, 2],
                                                    imported={"when": "today"}))
    d = describe(a, "a")
    assert d.data is None and d.training is None
    sp = shutil.copytree(drafters["B-specforge"], tmp_path / "sp")
    _edit(sp / "config.json", lambda c: c.update(
        draftsmith={"aux_layer_ids_canonical": 7, "target_num_layers": 6}))
    assert "the file's draftsmith record says canonical 7" in describe(sp, "sp").ids_note


def _data_folder(drafter: Path, dataset: Path) -> None:
    _edit(drafter / "draftsmith.json",
          lambda d: d.update(data={"kind": "offline", "folder": str(dataset), "samples": 5}))


def test_a_manifest_compare_cannot_read_is_shown(drafters, dataset, tmp_path):  # noqa: F811
    """describe kept read_manifest's error in `manifest_error`, but the tables never showed
    it: the report looked as if the drafter recorded no dataset facts at all."""
    a = shutil.copytree(drafters["A"], tmp_path / "a")
    _data_folder(a, dataset)
    _edit(dataset / MANIFEST, lambda m: m.update(hidden_size="eight"))
    res = run_compare(CompareOptions([str(a), str(drafters["B"])]))
    assert "hidden_size is 'eight'" in res["drafters"][0]["data"]["manifest_error"]
    row = next(r for r in markdown(res, None).splitlines() if r.startswith("| manifest_error"))
    assert "hidden_size is 'eight'" in row


def test_odd_manifest_extras_and_make_record_do_not_stop_compare(drafters, dataset,  # noqa: F811
                                                                  tmp_path):
    """The manifest's `input` and `commands` and the `data make` record beside it are
    descriptive: a list for `input`, a lone command string or a damaged make.json were an
    AttributeError/TypeError/JSONDecodeError (a string was shown letter by letter)."""
    a = shutil.copytree(drafters["A"], tmp_path / "a")
    _data_folder(a, dataset)
    _edit(dataset / MANIFEST, lambda m: m.update(input=[3], commands="draftsmith data capture"))
    (dataset.parent / "make.json").write_text("{not json")
    data = describe(a, "a").data
    assert data["sources"] == ["draftsmith data capture"] and data["input conversations"] is None
    assert data["dataset samples"] == 5 and data["regenerated"] is None


def _stub_target(chat_ids) -> SimpleNamespace:
    # positions for no answer: compare stops at its check, before any weights
    return SimpleNamespace(chat_ids=chat_ids,
                           cfg=SimpleNamespace(max_position_embeddings=2, sliding_window=None))


def test_a_prompt_the_chat_template_refuses_is_named(tmp_path):
    """compare tokenised its suite with chat_ids directly: a template refusing a system turn
    (Gemma's) was a jinja traceback where bench names the prompt."""
    from jinja2 import TemplateError

    def refuse(messages):
        raise TemplateError("System role not supported")

    opts = CompareOptions(["a", "b"], target="t", num_prompts=2)
    with pytest.raises(DraftsmithError, match=r"--prompts chat: the target's chat template "
                                              r"refused prompt 1 \(TemplateError"):
        _speed(opts, _stub_target(refuse), [])


def test_a_short_suite_is_said_on_stderr_not_in_the_json(tmp_path, capsys):
    """The short-suite line went to stdout, before `compare --json`'s document: `| jq` broke."""
    suite = tmp_path / "p.jsonl"
    suite.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    opts = CompareOptions(["a", "b"], target="t", prompts=str(suite), num_prompts=3)
    with pytest.raises(DraftsmithError, match="max_position_embeddings"):
        _speed(opts, _stub_target(lambda m: [1, 2, 3]), [])
    out = capsys.readouterr()
    assert out.out == "" and "has 1 prompts with a user turn, fewer than" in out.err


def test_an_unwritable_out_prints_the_results_before_the_error(drafters, tmp_path):  # noqa: F811
    """--out that cannot be written (here compare.md is a folder) was an OSError traceback
    after the whole run, and what was measured was lost; now it is printed, then one error."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.compare import compare

    app = typer.Typer()
    app.command()(compare)
    app.command("other")(lambda: None)
    out = tmp_path / "out"
    (out / "compare.md").mkdir(parents=True)
    r = CliRunner().invoke(app, ["compare", str(drafters["A"]), str(drafters["B"]),
                                 "--out", str(out), "--json"])
    assert isinstance(r.exception, DraftsmithError), r.output
    assert f"--out {out}: cannot write the report" in str(r.exception)
    shown = json.loads(r.stdout)
    assert [d["label"] for d in shown["drafters"]] == ["small", "big"]
