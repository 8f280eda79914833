"""`data capture`'s closing line under torchrun: a rank's counts are said to be its own until
the ranks' parts are merged (rank 0 finishing first said its part was the whole dataset)."""

from __future__ import annotations

from test_cli_review import run_main
from test_cli_review2 import prompts_file


def capture_as(monkeypatch, capsys, rank: int, world: int, src, out, target) -> str:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", "0")
    code, _, err = run_main(monkeypatch, capsys, "data", "capture", str(src), "-o", str(out),
                            "--target", str(target), "--device", "cpu", "--shard-size", "1")
    assert code == 0, err
    return err.strip().splitlines()[-1]


def test_rank_zero_finishing_first_says_its_counts_are_its_own(monkeypatch, capsys, tmp_path,
                                                               tiny_llama_dir):
    src, out = prompts_file(tmp_path / "c.jsonl", 4, answered=True), tmp_path / "ds"
    first = capture_as(monkeypatch, capsys, 0, 2, src, out, tiny_llama_dir)
    assert first.endswith(" (this rank)") and "2 shards" in first
    last = capture_as(monkeypatch, capsys, 1, 2, src, out, tiny_llama_dir)
    assert last.endswith("4 shards"), last


def test_a_single_process_capture_is_the_whole_dataset(monkeypatch, capsys, tmp_path,
                                                       tiny_llama_dir):
    src, out = prompts_file(tmp_path / "c.jsonl", 2, answered=True), tmp_path / "ds"
    assert capture_as(monkeypatch, capsys, 0, 1, src, out, tiny_llama_dir).endswith("2 shards")
