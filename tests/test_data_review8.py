"""What a new user of `data make` reads: the sampling said, answers cut at the limit counted,
and the make folder named where a dataset folder is asked for."""

import pytest
from test_data_regenerate import convs

from draftsmith.data.prompts import read_jsonl_tail_safe
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate, sampling_words
from draftsmith.data.shards import read_manifest
from draftsmith.errors import DraftsmithError


def test_regenerate_says_how_it_samples_and_counts_answers_cut_at_the_limit(target, model,
                                                                           tmp_path):
    """The closing line said `truncated 0` (it counts prompts) while every answer ended at
    --max-new-tokens, and nothing said the answers were sampled at T 0.8."""
    cfg = RegenConfig(max_new_tokens=6, max_len=96, batch_size=4, temperature=0.8, seed=3)
    lines: list[str] = []
    out = tmp_path / "a.jsonl"
    stats = regenerate(convs()[:3], out, EngineBackend(target, model, cfg), target.tokenizer,
                       cfg, False, lines.append)
    cut = sum(a["finish"] == "length" for r in read_jsonl_tail_safe(out)
              for a in r["meta"]["answers"])
    assert cut > 0 and stats["answers_at_max_new"] == cut
    assert lines[0] == ("regenerate: 3 conversations to answer, sampled (--temperature 0.8, "
                        "--top-p 0.95, --seed 3), at most 6 new tokens each")
    assert f"answered ones cut at --max-new-tokens {cut}" in lines[-1]
    assert "prompts truncated 0" in lines[-1]
    assert sampling_words(RegenConfig(temperature=0)) == "greedy (--temperature 0)"


def test_a_make_folder_given_for_its_dataset_names_the_dataset(tmp_path):
    """`data inspect DIR` and `train --data DIR` on a `data make DIR` folder said only that
    it was not a dataset folder."""
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "manifest.json").write_text("{}")
    with pytest.raises(DraftsmithError, match=r"a `data make` folder, not a dataset: its "
                                              r"dataset is .*dataset; pass that"):
        read_manifest(tmp_path)


def test_data_make_takes_the_answers_temperature(monkeypatch, tmp_path):
    """`data make` sampled its answers at T 0.8 with no flag to change it (greedy answers
    needed the stages run one by one)."""
    from typer.testing import CliRunner

    import draftsmith.data.pipeline as pipeline
    from draftsmith.data.cli import app

    got = {}
    monkeypatch.setattr(pipeline, "make_dataset", lambda *a, **k: got.update(k))
    res = CliRunner().invoke(app, ["make", str(tmp_path / "m"), "--n", "2",
                                   "--device", "cpu", "--temperature", "0"])
    assert res.exit_code == 0, res.output
    assert got["temperature"] == 0
