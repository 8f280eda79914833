"""Review of the scale-out data path (`draftsmith serve` + `data regenerate --base-url`): a run
whose requests failed (the server down, or stopped mid-run) exited 0, so a script went on to
capture an answers file with holes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from test_cli_review import run_main


def prompts(tmp_path: Path, n: int) -> Path:
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": f"Say {i}."}]}) + "\n" for i in range(n)))
    return src


def dead_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_regenerate_against_a_server_that_is_down_exits_with_one_error(
        monkeypatch, capsys, tmp_path: Path, tiny_llama_dir: Path) -> None:
    url = f"http://127.0.0.1:{dead_port()}/v1"
    out = tmp_path / "a.jsonl"
    code, _, err = run_main(monkeypatch, capsys, "data", "regenerate", str(prompts(tmp_path, 3)),
                         "-o", str(out), "--base-url", url, "--model", "m", "--retries", "0",
                         "--max-new-tokens", "4", "--max-len", "64",
                         "--target", str(tiny_llama_dir))
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("draftsmith: error: regenerate: 3 of the 3 conversations asked "
                           f"failed (is the server at {url} up?)"), err
    assert f"{out} keeps the 0 answered" in last and "rerun the same command" in last
    assert "Traceback" not in err


def test_regenerate_with_some_failed_names_what_the_file_keeps(monkeypatch, capsys,
                                                              tmp_path: Path) -> None:
    import draftsmith.data.regenerate as R

    said = {"done_before": 2, "answered": 3, "redone": 0, "failed": 4}
    monkeypatch.setattr(R, "regenerate_file", lambda *a, **k: said)
    out = tmp_path / "a.jsonl"
    code, _, err = run_main(monkeypatch, capsys, "data", "regenerate", str(prompts(tmp_path, 9)),
                         "-o", str(out), "--base-url", "http://127.0.0.1:9/v1")
    assert code == 2, err
    assert (f"4 of the 7 conversations asked failed (is the server at http://127.0.0.1:9/v1 "
            f"up?), see the warnings above; {out} keeps the 5 answered") in err
    said.update(failed=0)
    code, _, err = run_main(monkeypatch, capsys, "data", "regenerate", str(prompts(tmp_path, 9)),
                         "-o", str(out), "--base-url", "http://127.0.0.1:9/v1")
    assert code == 0, err
