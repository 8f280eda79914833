"""Command-line consistency, third review: the commands that share a flag apply one rule to it
(a chain's --num-draft-tokens, --seed at temperature 0), and bench reads prompt files as
generate does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from test_bench import drafter_dir  # noqa: F401 (a fixture)
from test_cli_review import run_main
from test_cli_review2 import NEVER, error_of

from draftsmith.bench.run import BenchConfig, _meta
from draftsmith.bench.suites import suite_messages
from draftsmith.engine.sampling import SamplingParams
from draftsmith.errors import DraftsmithError

LOADS = f"{NEVER}: no such file or folder"  # accepted: on to the target, which cannot load


def last_error(monkeypatch, capsys, *args: str) -> str:
    code, _, err = run_main(monkeypatch, capsys, *args, "--target", NEVER, "--device", "cpu")
    assert code == 2, err
    return err.strip().splitlines()[-1].removeprefix("draftsmith: error: ")


@pytest.mark.parametrize("command", [["bench"], ["serve", "--port", "0"]])
def test_bench_and_serve_take_a_chains_draft_tokens_alike(monkeypatch, capsys, tmp_path,
                                                          drafter_dir, command):  # noqa: F811
    """bench refused --num-draft-tokens 4 with --steps 3 (a chain) that serve and SGLang take."""
    monkeypatch.chdir(tmp_path)
    command = [*command, "--drafter", str(drafter_dir)]
    assert last_error(monkeypatch, capsys, *command, "--steps", "3", "--num-draft-tokens",
                      "4") == LOADS
    assert error_of(monkeypatch, capsys, *command, "--steps", "3", "--num-draft-tokens", "9",
                    "--target", NEVER, "--device", "cpu") == (
        "--num-draft-tokens 9: a chain (--topk 1) verifies --steps + 1 = 4 tokens; leave it out, "
        "or give --topk > 1")


def test_a_grid_of_chains_takes_one_draft_token_count_per_steps():
    assert BenchConfig(steps=[1, 3], num_draft_tokens=[4, 2]).settings() == [
        (1, 1, 2), (3, 1, 4)]
    with pytest.raises(DraftsmithError, match="--num-draft-tokens 4: a chain .* = 2,4 tokens"):
        BenchConfig(steps=[1, 3], num_draft_tokens=[4])


@pytest.mark.parametrize("command", [["bench", "--drafter", "random"], ["generate", "-p", "hi"]])
def test_seed_at_temperature_0_is_refused_by_every_sampling_command(monkeypatch, capsys,
                                                                     tmp_path, command):
    """generate refused --seed at temperature 0; bench took it and drew nothing with it."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, *command, "--seed", "3", "--target", NEVER,
                    "--device", "cpu") == (
        "--seed applies to sampling: give --temperature > 0 with it (at temperature 0 decoding "
        "is greedy)")
    assert last_error(monkeypatch, capsys, *command, "--seed", "3", "--temperature",
                      "0.5") == LOADS


def test_bench_meta_records_the_seed_of_a_sampled_run():
    """bench.json named the temperature but not the seed its draws came from."""
    drafter = SimpleNamespace(cfg=SimpleNamespace(aux_layer_ids=[1, 2, 3]))
    target = SimpleNamespace(source="t", fingerprint="f")
    sampled = BenchConfig(params=SamplingParams(0.7), seed=5)
    assert _meta(sampled, target, drafter, [])["seed"] == 5
    assert _meta(BenchConfig(seed=5), target, drafter, [])["seed"] is None


def test_bench_asks_a_files_prompts_with_every_system_prompt(tmp_path):
    """bench kept only a conversation's first message when it was a system prompt: a second
    system prompt, which generate and regenerate ask with, was dropped."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "system", "content": "in French"},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "salut"}]
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"messages": msgs}) + "\n")
    assert suite_messages(str(p), 0) == [msgs[:3]]


@pytest.mark.parametrize("device", ["meta", "mps", "cpu:1", "cuda:x"])
def test_a_device_no_command_runs_on_is_refused_before_loading(monkeypatch, capsys, tmp_path,
                                                               device):
    """torch.device took them: bench then died in a traceback (meta, mps), or ran `cpu:1` as if
    on a GPU, in bfloat16 under --dtype auto."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, "bench", "--drafter", "random", "--target", NEVER,
                    "--device", device) == f"--device {device}: use cpu, cuda, cuda:N or auto"
    assert list(tmp_path.iterdir()) == []


def test_a_cuda_index_past_the_hosts_devices_is_refused(monkeypatch):
    from draftsmith.cli import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == "cuda:1" and pick_device("cuda") == "cuda"
    with pytest.raises(DraftsmithError, match=r"^--device cuda:2: this host has 2 CUDA "
                       r"device\(s\), cuda:0 to cuda:1$"):
        pick_device("cuda:2")


@pytest.mark.parametrize("command", [["bench"], ["serve", "--port", "0"]])
def test_a_mistyped_drafter_is_refused_before_the_target_loads(monkeypatch, capsys, tmp_path,
                                                               command):
    """bench and serve loaded (and built) the target before they looked for the drafter."""
    monkeypatch.chdir(tmp_path)
    assert error_of(monkeypatch, capsys, *command, "--drafter", "drafterr", "--target", NEVER,
                    "--device", "cpu") == "drafterr: no such folder (a draftsmith drafter folder)"


def test_bench_results_survive_an_out_folder_it_cannot_write(monkeypatch, capsys, tmp_path,
                                                             tiny_llama_dir):
    """bench.json was written before the report was printed: an --out it could not write
    (full disk, no permission) ended the run in a traceback with every figure lost."""
    import errno

    from draftsmith.bench import report

    def refuse(*a):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(report, "write_json", refuse)
    code, out, err = run_main(monkeypatch, capsys, "bench", "--drafter", "random", "--target",
                              str(tiny_llama_dir), "--device", "cpu", "--num-prompts", "1",
                              "-n", "3", "--steps", "1", "-o", str(tmp_path / "o"))
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"draftsmith: error: --out {tmp_path / 'o'}: cannot write bench.json (Permission "
        "denied); the results are the JSON line printed above")
    rows = json.loads(out.strip().splitlines()[-1])["results"]
    assert [r["setting"] for r in rows] == ["baseline", "chain 1"]
