"""bench's progress lines and closing lines are text, not rich markup: a suite file named
`[bold]p.jsonl` was logged as `p.jsonl` (its name read as a style), and an --out of `o[b]` lost its
`[b]` in the line saying where bench.json went."""

from __future__ import annotations

import json

from test_bench import drafter_dir  # noqa: F401 (a fixture)
from test_cli_review import run_main


def test_a_suite_file_named_like_markup_is_printed_as_typed(monkeypatch, capsys, tmp_path,
                                                            tiny_llama_dir, drafter_dir):  # noqa: F811
    suite = tmp_path / "[bold]p.jsonl"
    suite.write_text('{"prompt": "hello there"}\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, "bench", "--drafter", str(drafter_dir),
                              "--target", str(tiny_llama_dir), "--device", "cpu", "--suite",
                              suite.name, "-n", "2", "--steps", "1", "-o", "o[b]")
    assert code == 0, err
    assert "Traceback" not in err and f"{suite.stem}: batch 1, chain 1" in err
    assert "wrote o[b]/bench.json" in " ".join(err.split())
    assert json.loads(out.strip().splitlines()[-1])["bench_json"].endswith("o[b]/bench.json")
    # stdout is the JSON line alone (`bench ... | jq`), the tables on stderr
    assert len(out.strip().splitlines()) == 1 and "draftsmith bench" in err
