"""Self-made prompts, the one-command pipeline, and the data CLI on a tiny target."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from draftsmith.data.cli import app
from draftsmith.data.prompts import read_jsonl_tail_safe
from draftsmith.data.selfmade import MagpieConfig, fold, self_made_prompts, stop_ids
from draftsmith.data.shards import Dataset
from draftsmith.errors import DraftsmithError


def test_self_made_prompts_unique_and_resumable(target, model, tmp_path):
    out = tmp_path / "p.jsonl"
    cfg = MagpieConfig(n=6, batch_size=16, max_new_tokens=64, min_chars=1, seed=1)
    stats = self_made_prompts(target, out, cfg, model, progress=False)
    recs = read_jsonl_tail_safe(out)
    assert stats["kept"] == 6 and len(recs) == 6
    assert len({fold(r["messages"][0]["content"]) for r in recs}) == 6
    assert all(r["meta"]["source"] == "magpie" and r["messages"][0]["role"] == "user"
               for r in recs)
    assert target.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_ids(target, "<|im_end|>\n")
    cfg = MagpieConfig(n=8, batch_size=16, max_new_tokens=64, min_chars=1, seed=1)
    self_made_prompts(target, out, cfg, model, progress=False)
    again = read_jsonl_tail_safe(out)
    assert len(again) == 8 and again[:6] == recs


def test_self_made_prompts_killed_and_resumed_equal_an_uninterrupted_run(target, model, tmp_path,
                                                                         monkeypatch):
    """Each round's seed and openings follow its number, which a rerun reads back from the
    records (it restarted at 0, so a resumed run asked other questions)."""
    import draftsmith.engine.generate as generate

    cfg = MagpieConfig(n=12, batch_size=4, max_new_tokens=24, min_chars=1, seed=1,
                       openings=("Why", "How", "List"))
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    self_made_prompts(target, whole, cfg, model, progress=False)
    real, calls = generate.run_generation, []

    def killed_in_round_three(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(generate, "run_generation", killed_in_round_three)
    with pytest.raises(KeyboardInterrupt):
        self_made_prompts(target, part, cfg, model, progress=False)
    monkeypatch.setattr(generate, "run_generation", real)
    self_made_prompts(target, part, cfg, model, progress=False)
    assert part.read_text() == whole.read_text()
    grow = dataclasses.replace(cfg, n=13)  # more of the same: checked before any generation
    with pytest.raises(DraftsmithError, match=r"temperature 1.0 there, 0.5 now"):
        self_made_prompts(target, part, dataclasses.replace(grow, temperature=0.5), model)
    with pytest.raises(DraftsmithError, match="other --openings"):
        self_made_prompts(target, part, dataclasses.replace(grow, openings=()), model)
    assert part.read_text() == whole.read_text()


def test_make_then_rerun_reuses_every_stage(target, tmp_path):
    from draftsmith.data.pipeline import make_dataset

    logs: list[str] = []
    kw = dict(target=target, batch_size=16, max_len=96, max_new_tokens=16, prompt_tokens=48,
              vocab_size=40, log=logs.append, progress=False)
    rec = make_dataset(tmp_path, 5, **kw)
    ds = Dataset(tmp_path / "dataset")
    assert len(ds) == 5 and ds.manifest["complete"]
    assert set(rec["stages"]) == {"prompts", "regenerate", "capture", "vocab"}
    assert (tmp_path / "dataset" / "vocab.safetensors").is_file()
    shas = [s["sha256"] for s in ds.manifest["shards"]]
    logs.clear()
    rec = make_dataset(tmp_path, 5, **kw)
    assert rec["stages"]["regenerate"]["result"]["done_before"] == 5
    assert any("0/1 shards to write" in s for s in logs)
    assert [s["sha256"] for s in Dataset(tmp_path / "dataset").manifest["shards"]] == shas


def test_make_with_a_larger_n_grows_the_run(target, tmp_path):
    """The capture stage refused a grown answers file, suggesting an --overwrite `make` lacks."""
    from draftsmith.data.pipeline import make_dataset

    kw = dict(target=target, batch_size=4, max_len=96, max_new_tokens=16, prompt_tokens=48,
              vocab_size=16, log=lambda s: None, progress=False)
    make_dataset(tmp_path, 3, **kw)
    rec = make_dataset(tmp_path, 5, **kw)
    said = rec["stages"]["regenerate"]["result"]  # chunk 0, sampled with 3 rows, asked whole
    assert said["done_before"] == 0 and said["redone"] == 3 and said["answered"] == 5
    assert len(Dataset(tmp_path / "dataset")) == 5
    with pytest.raises(DraftsmithError, match="aux_layer_ids.*delete .*dataset to capture") as e:
        make_dataset(tmp_path, 5, aux_layers=[0, 2], **kw)
    assert "--overwrite" not in str(e.value)  # `make` has none


def test_cli_capture_inspect_vocab_and_tamper(tiny_llama_dir, tmp_path):
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]})
        + "\n" for i in range(5)))
    r = CliRunner()
    data = tmp_path / "ds"
    base = ["capture", str(convs), "-o", str(data), "--target", str(tiny_llama_dir),
            "--device", "cpu", "--shard-size", "2", "--aux-layers", "-1,0,5"]
    res = r.invoke(app, base)
    assert res.exit_code == 0, res.output
    assert "estimated storage" in res.output
    m = Dataset(data).manifest
    assert m["aux_layer_ids"] == [-1, 0, 5] and m["totals"]["shards"] == 3
    assert m["commands"][0].startswith("draftsmith")
    res = r.invoke(app, ["inspect", str(data), "--json"])
    info = json.loads(res.stdout)
    assert info["samples"] == 5 and "all 3 shards match" in info["verified"]
    assert "output of decoder layer j" in info["aux layer ids"]
    res = r.invoke(app, ["vocab", str(data), "--size", "8"])
    assert res.exit_code == 0 and "coverage" in res.output
    shard = data / "shard-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    res = r.invoke(app, ["inspect", str(data)])
    assert isinstance(res.exception, DraftsmithError) and "shard-00002" in str(res.exception)
    res = r.invoke(app, base[:-2] + ["--aux-layers", "1,2,x"])
    assert isinstance(res.exception, DraftsmithError)


def test_self_made_prompts_start_with_the_openings(target, model, tmp_path):
    out = tmp_path / "p.jsonl"
    opens = ("Explain why", "Write a Python function that")
    cfg = MagpieConfig(n=6, batch_size=8, max_new_tokens=48, min_chars=1, seed=2, openings=opens)
    assert self_made_prompts(target, out, cfg, model, progress=False)["kept"] == 6
    recs = read_jsonl_tail_safe(out)
    texts = [r["messages"][0]["content"] for r in recs]
    assert all(t.startswith(r["meta"]["opening"]) for t, r in zip(texts, recs, strict=True))
    assert {r["meta"]["opening"] for r in recs} == set(opens)
    assert all(len(t) > len(r["meta"]["opening"]) for t, r in zip(texts, recs, strict=True))
    assert "openings" not in recs[0]["meta"]


def test_an_opening_the_target_adds_no_word_to_is_not_a_prompt(target):
    """A target that closes the turn at once (or adds only punctuation) leaves the bare opening,
    which --min-chars alone would keep."""
    from draftsmith.data.selfmade import _one

    tok = target.tokenizer
    start = tok("Explain why", add_special_tokens=False)["input_ids"]
    cfg = MagpieConfig(min_chars=1)
    for more, kept in (("", False), (" ?", False), (" the sky is blue", True)):
        stats = {"bare_openings": 0, "duplicates": 0, "length_filtered": 0}
        toks = tok("Explain why" + more, add_special_tokens=False)["input_ids"][len(start):]
        got = _one(target, toks, cfg, set(), stats, "Explain why", start)
        assert (got is not None, stats["bare_openings"]) == (kept, int(not kept)), more
        assert got is None or got.startswith("Explain why the sky")


def test_mixed_openings_leave_half_the_rows_free():
    from draftsmith.data.selfmade import BUILTIN_OPENINGS, openings_from

    mixed = openings_from("mixed")
    assert set(mixed) == set(BUILTIN_OPENINGS) | {""} and mixed.count("") == len(mixed) // 2


def test_openings_bad_input_is_a_clear_error(tiny_llama_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "p.jsonl"
    res = runner.invoke(app, ["prompts", "--self-made", "4", "--openings", str(tmp_path / "no"),
                              "--target", str(tiny_llama_dir), "--out", str(out)])
    assert res.exit_code != 0 and "neither 'builtin', 'mixed' nor a file" in str(res.exception)
    res = runner.invoke(app, ["prompts", "humaneval", "--openings", "builtin", "--out", str(out)])
    assert res.exit_code != 0 and "give it with --self-made" in str(res.exception)
    res = runner.invoke(app, ["prompts", "humaneval", "--self-made", "4", "--out", str(out),
                              "--target", str(tiny_llama_dir), "--device", "cpu"])
    assert res.exit_code != 0 and "give humaneval in a run of its own" in str(res.exception)
    assert not out.exists()


def test_continuation_keeps_the_space_a_sentencepiece_decoder_strips():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from draftsmith.data.selfmade import _continuation

    vocab = {"<unk>": 0, "▁Write": 1, "▁a": 2, "▁function": 3, "▁that": 4, "▁takes": 5, "▁x": 6}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    assert tok.decode([5, 6]) == "takes x"  # alone, the first token loses its space
    assert "Write a function that" + _continuation(tok, [1, 2, 3, 4], [5, 6]) == (
        "Write a function that takes x")


def test_self_made_counts_below_one_are_named_with_their_values():
    with pytest.raises(DraftsmithError, match=r"the count \(-3\)"):
        MagpieConfig(-3)


def test_make_checks_every_setting_before_any_stage(target, tmp_path):
    from draftsmith.data.pipeline import make_dataset

    out = tmp_path / "mk"
    kw = dict(target=target, batch_size=4, max_len=96, max_new_tokens=16, prompt_tokens=48,
              vocab_size=40, log=lambda s: None, progress=False)
    cases = [({"prompt_tokens": 0}, "--prompt-tokens must be >= 1, got 0"),
             ({"aux_layers": [0, 99]}, r"--aux-layers: aux layer ids \[99\] out of range"),
             ({"vocab_size": 0}, "--vocab-size must be >= 1, got 0"),
             ({"max_len": 8, "max_new_tokens": 64}, "--max-new-tokens 64 .* --max-len 8")]
    for over, why in cases:
        with pytest.raises(DraftsmithError, match=why):
            make_dataset(out, 2, **(kw | over))
        assert not out.exists()
    keep = tmp_path / "keep.txt"
    keep.write_text("notes\n")
    res = CliRunner().invoke(app, ["make", str(keep), "--device", "cpu"])
    assert isinstance(res.exception, DraftsmithError) and "not a folder" in str(res.exception)
    assert keep.read_text() == "notes\n"


def test_self_made_prompts_bad_settings_and_output(target, model, tiny_llama_dir, tmp_path):
    with pytest.raises(DraftsmithError, match=r"--min-chars \(100\) must not exceed --max-chars"):
        MagpieConfig(2, min_chars=100, max_chars=10)
    keep = tmp_path / "keep.txt"
    keep.write_text("line one\nline two")
    cfg = MagpieConfig(n=2, batch_size=4, max_new_tokens=32, min_chars=1)
    with pytest.raises(DraftsmithError, match="keep.txt:1: not valid JSON"):
        self_made_prompts(target, keep, cfg, model, progress=False)
    assert keep.read_text() == "line one\nline two"
    out = tmp_path / "p.jsonl"
    out.write_text(json.dumps({"messages": [{"role": "user", "content": "old"}]}))
    args = ["prompts", "--self-made", "2", "-o", str(out), "--target", str(tiny_llama_dir),
            "--device", "cpu", "--batch-size", "4", "--max-new-tokens", "32", "--min-chars", "1"]
    said = CliRunner().invoke(app, args)  # a prompt not self-made is not counted as one
    assert isinstance(said.exception, DraftsmithError) and "not self-made" in str(said.exception)
    assert [r["messages"][0]["content"] for r in read_jsonl_tail_safe(out)] == ["old"]
    assert CliRunner().invoke(app, args + ["--overwrite"]).exit_code == 0
    assert "old" not in [r["messages"][0]["content"] for r in read_jsonl_tail_safe(out)]


def test_make_says_a_small_vocab_warning_in_its_log(target, tmp_path, recwarn):
    """The vocab stage's warning reached the terminal as Python's UserWarning, with the
    pipeline's file and source line, where `data vocab` says it as one `warning:` line."""
    from draftsmith.data.pipeline import make_dataset

    logs: list[str] = []
    make_dataset(tmp_path, 2, target=target, batch_size=4, max_len=96, max_new_tokens=8,
                 prompt_tokens=48, vocab_size=100_000, log=logs.append, progress=False)
    assert any(s.startswith("warning: only") and "distinct assistant tokens" in s for s in logs)
    assert not [w for w in recwarn if "distinct assistant tokens" in str(w.message)]
