"""`draftsmith bench` and the engine's host-side API, third review: a Python caller's bad
arguments are one clear DraftsmithError, not a TypeError deep in a buffer, and a bench grid the
drafter cannot run is refused before the target loads or any setting is timed."""

from __future__ import annotations

import pytest
import torch
from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)
from test_speculative import make_drafter, tiny_target

import draftsmith.bench.run as bench_run
import draftsmith.targets as targets
from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.engine.generate import generate
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder, check_drafting
from draftsmith.errors import DraftsmithError

PROMPTS = [[1, 5, 9], [1, 60, 61, 62]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, make_drafter(target, 96)


def test_a_bare_eos_id_is_refused_not_a_type_error_or_ignored(pair):
    """eos_ids=2 was "'int' object is not iterable"; eos_ids=0 (`0 or []`) silently decoded
    with no EOS at all."""
    target, drafter = pair
    dec = SpecDecoder(target, drafter, 2, 1, max_batch=2, max_seq=64)
    for eos in (2, 0):
        with pytest.raises(DraftsmithError, match="eos_ids must be a list of token ids"):
            generate(target, PROMPTS, 4, eos_ids=eos)
        with pytest.raises(DraftsmithError, match="eos_ids must be a list of token ids"):
            dec.generate(PROMPTS, 4, eos_ids=eos)
    want = generate(target, PROMPTS, 6, eos_ids=[])
    cut = [want[0][2]]  # a 1-D tensor of ids reads as its list
    assert generate(target, PROMPTS, 6, eos_ids=torch.tensor(cut)) == generate(
        target, PROMPTS, 6, eos_ids=cut)
    assert dec.generate(PROMPTS, 6, eos_ids=(cut[0],)).tokens == generate(
        target, PROMPTS, 6, eos_ids=cut)


def test_sampling_settings_of_the_wrong_type_are_refused_by_name(pair):
    target, drafter = pair
    with pytest.raises(DraftsmithError, match="sampling settings must be a SamplingParams"):
        generate(target, PROMPTS, 4, params={"temperature": 0.7})
    with pytest.raises(DraftsmithError, match="params must be a SamplingParams, got 0.7"):
        SpecDecoder(target, drafter, 2, 1, params=0.7)


def test_spec_generate_takes_one_setting_for_every_prompt_as_the_baseline_does(pair):
    """run_generation takes one SamplingParams for all rows or one a row; SpecDecoder.generate
    took only a list (one setting: "'SamplingParams' object is not iterable")."""
    target, drafter = pair
    sampled = SamplingParams(0.8, top_k=5)
    dec = SpecDecoder(target, drafter, 2, 1, params=sampled, max_batch=2, max_seq=64)
    torch.manual_seed(7)
    one = dec.generate(PROMPTS, 6, params=sampled).tokens
    torch.manual_seed(7)
    assert one == dec.generate(PROMPTS, 6, params=[sampled, sampled]).tokens
    greedy = SamplingParams()
    assert dec.generate(PROMPTS, 6, params=greedy).tokens == generate(target, PROMPTS, 6)


@pytest.mark.parametrize(("args", "says"), [
    ((2.0, 1, None), "steps 2.0"), (("3", 1, None), "steps '3'"),
    ((True, 1, None), "steps True"), ((2, 2.0, 4), "topk 2.0"), ((2, True, None), "topk True"),
    ((2, 2, 5.0), "num_draft_tokens 5.0"),
])
def test_drafting_sizes_must_be_whole_numbers(pair, args, says):
    """steps 2.0 was a TypeError in a buffer's allocation; topk True ran a chain."""
    with pytest.raises(DraftsmithError, match=f"must be whole numbers, got {says}"):
        check_drafting(*args)
    with pytest.raises(DraftsmithError, match="must be whole numbers"):
        SpecDecoder(*pair, *args, max_seq=64)


def _never(*_a, **_k):
    raise AssertionError("ran before the grid was checked")


def test_bench_refuses_a_topk_past_the_draft_vocabulary_before_the_target_loads(
        drafter_dir, monkeypatch, tmp_path):  # noqa: F811
    """--topk 1,200 with a 128-token draft vocabulary: the baseline and chain ran (minutes on a
    real target), then the tree's decoder refused it and every result was lost."""
    monkeypatch.setattr(targets, "load_target", _never)
    res = invoke("--target", "unused", "--drafter", str(drafter_dir), "--steps", "2",
                 "--topk", "1,200", "--num-draft-tokens", "8", "--device", "cpu",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code != 0 and isinstance(res.exception, DraftsmithError)
    assert "--topk 200 exceeds the drafter's draft vocabulary of 128" in str(res.exception)


def test_run_bench_refuses_a_topk_past_the_draft_vocabulary_before_timing(tiny_llama_dir,
                                                                           monkeypatch):
    monkeypatch.setattr(bench_run, "_baseline", _never)
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[2], topk=[1, 200],
                      num_draft_tokens=[8], num_prompts=1, max_new_tokens=4)
    with pytest.raises(DraftsmithError, match="--topk 200 exceeds the drafter's draft vocab"):
        run_bench(cfg, log=lambda s: None)


NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}")


@pytest.fixture(scope="module")
def no_system_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny llama under a template that refuses a system turn, as Gemma's does."""
    import shutil

    folder = tmp_path_factory.mktemp("no_system") / "t"
    shutil.copytree(tiny_llama_dir, folder)
    tpl = folder / "chat_template.jinja"
    tpl.write_text(NO_SYSTEM + tpl.read_text())
    return folder


SYSTEM_FILE = ('{"prompt": "abc"}\n{"messages": [{"role": "system", "content": "be brief"}, '
               '{"role": "user", "content": "hi"}]}\n')


def test_bench_names_a_prompt_the_chat_template_refuses(no_system_dir, tmp_path):
    """A suite with a system turn on such a target was a jinja TemplateError traceback."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(SYSTEM_FILE)
    cfg = BenchConfig(target=str(no_system_dir), drafter="random", suites=[str(prompts)],
                      steps=[1], num_prompts=0, max_new_tokens=2)
    with pytest.raises(DraftsmithError, match=r"--suite .*p.jsonl: the target's chat template "
                       r"refused prompt 2 \(TemplateError: System role not supported\)"):
        run_bench(cfg, log=lambda s: None)


def test_generate_names_a_prompt_the_chat_template_refuses(no_system_dir, tmp_path):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(SYSTEM_FILE)
    res = CliRunner().invoke(app, ["generate", "--target", str(no_system_dir), "--prompts",
                                   str(prompts), "-n", "2", "--device", "cpu"])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == ("generate: the target's chat template refused prompt 2 "
                                  "(TemplateError: System role not supported)")


@pytest.mark.parametrize("text", ["", "   "])
def test_generate_refuses_an_empty_prompt(tmp_path, text):
    """`generate -p ""` decoded an empty user turn, where a prompts file's empty message is
    refused; refused before the target loads."""
    from typer.testing import CliRunner

    from draftsmith.cli import app

    res = CliRunner().invoke(app, ["generate", "-p", "hi", "-p", text, "--target",
                                   str(tmp_path / "missing"), "--device", "cpu"])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == "--prompt: an empty user message; give the text to complete"
