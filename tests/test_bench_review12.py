"""Review of `draftsmith bench`: each distinct warning said once, a suite named twice (in the
same words or another path to the same file) run once under one label, and labels that never
collide."""

from __future__ import annotations

import pytest

from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.bench.suites import CHAT_SUITE, suite_labels

PROMPTS = '{"prompt": "hi"}\n{"prompt": "yo"}\n'


def test_an_unfit_tree_given_twice_is_warned_once():
    """--steps 3,3 (or --topk 4,4) put the same unfit tree in the grid twice: the run said
    `skipped tree 3/4/500` twice and meta.warnings held it twice."""
    cfg = BenchConfig(steps=[3, 3], topk=[4, 4], num_draft_tokens=[8, 500])
    assert cfg.unfit() == ["tree 3/4/500: --steps 3, --topk 4 verify 2 to 37 tokens, not 500"]


def test_one_file_named_by_two_paths_is_one_suite(tmp_path, monkeypatch):
    """`--suite p.jsonl --suite ./p.jsonl` (or its absolute path) timed the same prompts twice,
    reported under two labels."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(PROMPTS)
    assert suite_labels(["p.jsonl", "./p.jsonl", str(tmp_path / "p.jsonl")]) == {"p.jsonl": "p"}
    assert suite_labels(["chat", "chat", str(CHAT_SUITE)]) == {"chat": "chat"}


def test_suite_labels_never_collide(tmp_path):
    """A label taken from a file's stem could equal another suite's name as given where that one
    fell back to its name: both suites' rows went under one label, one replacing the other."""
    names = [str(tmp_path / "d" / "foo.bar.jsonl"), "foo.bar", str(tmp_path / "e" / "foo.jsonl")]
    labels = suite_labels(names)
    assert len(set(labels.values())) == 3


def test_a_suite_named_twice_runs_once_with_a_note(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(PROMPTS)
    said: list[str] = []
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[1],
                      suites=["p.jsonl", "./p.jsonl", "p.jsonl"], max_new_tokens=2)
    rep = run_bench(cfg, log=said.append)
    assert [(r["suite"], r["setting"]) for r in rep["results"]] == [
        ("p", "baseline"), ("p", "chain 1")]
    assert rep["meta"]["suites"] == ["p.jsonl"]
    repeat = [s for s in said if "./p.jsonl" in s]
    assert len(repeat) == 1 and "p.jsonl" in repeat[0] and "once" in repeat[0]
    assert sum("./p.jsonl" in w for w in rep["meta"]["warnings"]) == 1


def test_what_loading_the_drafter_warned_is_said_once_and_recorded(tiny_llama_dir, tmp_path):
    """load_drafter's warning (here a d2t sending draft ids 3 and 5 to one target id) went to
    Python's warning channel alone: bench.json's meta.warnings left it out, though it qualifies
    every speculative row."""
    import warnings

    import torch

    from draftsmith.bench.drafters import get_drafter, random_drafter
    from draftsmith.models.eagle3 import save_drafter
    from draftsmith.targets import load_target

    t = load_target(tiny_llama_dir)
    d = random_drafter(t.cfg, torch.device("cpu"), torch.float32, seed=3)
    with torch.no_grad():
        d.d2t[5] = int(d.d2t[3]) + 3 - 5
    folder = save_drafter(d, tmp_path / "d")
    model = t.build(torch.float32, "cpu")
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        _, said = get_drafter(str(folder), t, model)
    assert not escaped
    assert [w for w in said if "draft ids 3 and 5" in w] and len(said) == len(set(said))


def test_a_library_warning_while_loading_passes_on_unrecorded():
    import warnings

    import pytest

    from draftsmith.bench.drafters import PACKAGE, _own_warnings

    def message(text: str, filename: str) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(text), UserWarning, filename, 1)

    caught = [message("ours", str(PACKAGE / "models" / "eagle3.py")),
              message("ours", str(PACKAGE / "models" / "eagle3.py")),
              message("theirs", "/lib/torch/serialization.py")]
    with pytest.warns(UserWarning, match="theirs"):
        assert _own_warnings(caught) == ["ours"]


@pytest.mark.parametrize("env, said", [({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
                                       ({"WORLD_SIZE": "2"}, "RANK is not")])
def test_allreduce_reads_the_launchers_environment_checked(monkeypatch, env, said):
    """WORLD_SIZE=x was a ValueError traceback, and WORLD_SIZE alone (no RANK) spawned that many
    local ranks as if torchrun had asked for them; train and capture refuse both by name."""
    from draftsmith.bench import allreduce
    from draftsmith.errors import DraftsmithError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(allreduce, "launch_tp", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(DraftsmithError, match=said):
        allreduce.allreduce_bench(hidden=64, layers=2, target=None, batch="1", q="1",
                                  dtype="fp32", iters=2, graph_ops=2, tp=0, device="cpu",
                                  nccl_proto=None, nccl_algo=None, nccl_p2p_level=None,
                                  nccl=None, out=None)


def test_a_refilled_speculative_run_is_timed_as_the_baseline_is(monkeypatch):
    """The refilled baseline's seconds were the wall time around its call, its request checks
    and state set-up included; the speculative one's the clock its engine started after its
    own: the checks' host time counted against the baseline alone."""
    import time

    import draftsmith.bench.run as bench_run
    import draftsmith.engine.spec_refill as spec_refill
    from draftsmith.engine.spec_state import SpecResult

    def slow_checks(*_a, **_k) -> SpecResult:
        time.sleep(0.2)  # host work before the engine's clock starts
        return SpecResult([[1, 2]], 0.0, 0.001, 1, 1, [0, 1], [1], [0])

    monkeypatch.setattr(spec_refill, "generate_refill", slow_checks)
    monkeypatch.setattr(spec_refill, "warm_refill", lambda *a, **k: None)
    monkeypatch.setattr(bench_run, "SpecDecoder", lambda *a, **k: None)
    row, _ = bench_run._speculative_refill(None, None, (1, 1, 2), [[[1]]],
                                           BenchConfig(refill=True), [])
    assert row["seconds"] >= 0.2


def test_a_prompt_files_skipped_records_are_said_once(tiny_llama_dir, tmp_path):
    """The CLI read each --suite before loading and run_bench read it again: a malformed record
    was warned twice (three times for a suite named twice), and bench.json kept none of it."""
    from test_bench import bench_json, invoke

    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\nnot json\n{"prompt": "yo"}\n')
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--suite", str(p),
                 "--suite", str(p), "--steps", "1", "-n", "2", "--device", "cpu",
                 "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    assert " ".join(res.output.split()).count("not valid JSON") == 1  # the console wraps
    assert sum("not valid JSON" in w for w in bench_json(res)["meta"]["warnings"]) == 1


def test_allreduce_out_it_cannot_append_to_is_one_error(tmp_path, monkeypatch, capsys):
    """An --out that passed the early checks but could not be opened (a link to a folder that
    is gone, a read-only disk) ended a finished measurement in a FileNotFoundError traceback."""
    from draftsmith.bench import allreduce
    from draftsmith.errors import DraftsmithError

    for name in ("RANK", "WORLD_SIZE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "ar.jsonl"
    out.symlink_to(tmp_path / "gone" / "ar.jsonl")
    with pytest.raises(DraftsmithError, match="cannot append"):
        allreduce.allreduce_bench(hidden=64, layers=2, target=None, batch="1", q="1",
                                  dtype="fp32", iters=2, graph_ops=2, tp=1, device="cpu",
                                  nccl_proto=None, nccl_algo=None, nccl_p2p_level=None,
                                  nccl=None, out=out)
    assert '"rows"' in capsys.readouterr().out  # the result is the line printed


def test_a_config_of_no_suite_is_refused_before_loading():
    """suites=[] loaded the target, then failed on max() of no prompts (a ValueError)."""
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="--suite: give at least one"):
        BenchConfig(suites=[])
