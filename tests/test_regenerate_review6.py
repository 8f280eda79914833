"""--timeout for a server's answers (`data regenerate` and `data make`): a slow server at a long
--max-new-tokens timed out at the client's fixed 600 s with no way to wait longer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data_regenerate import running
from test_regenerate_review5 import CFG, slow_app
from typer.testing import CliRunner

from draftsmith.data.cli import app
from draftsmith.data.pipeline import Server, _server_client
from draftsmith.data.regenerate import check_server_options

pytest.importorskip("openai")


def prompts(path: Path, first: str, n: int = 2) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{first}{i}"}]})
                            + "\n" for i in range(n)))
    return path


def test_regenerate_waits_as_long_as_timeout_says(tmp_path: Path, tiny_llama_dir) -> None:
    src = prompts(tmp_path / "p.jsonl", "slow")
    common = ["regenerate", str(src), "--target", str(tiny_llama_dir), "--model", "m",
              "--retries", "0", "--max-new-tokens", "4", "--concurrency", "2"]
    with running(slow_app()) as url:  # 0.6 s an answer
        short = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "a.jsonl"), "--base-url",
                                         url, "--timeout", "0.2"])
        long = CliRunner().invoke(app, [*common, "-o", str(tmp_path / "b.jsonl"), "--base-url",
                                        url, "--timeout", "5"])
    msg = str(short.exception)
    assert "2 timed out" in msg and "raise --timeout" in msg, short.output
    assert long.exit_code == 0, long.output
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_timeout_that_is_no_duration_is_refused(bad: float) -> None:
    with pytest.raises(Exception) as e:
        check_server_options(2, 1, bad)
    assert f"--timeout must be a number of seconds > 0, got {bad:g}" in str(e.value)


def test_timeout_without_a_server_is_refused(tmp_path: Path) -> None:
    src = prompts(tmp_path / "p.jsonl", "q")
    r = CliRunner().invoke(app, ["regenerate", str(src), "-o", str(tmp_path / "a.jsonl"),
                                 "--timeout", "30"])
    assert "--timeout" in str(r.exception) and "--base-url" in str(r.exception), r.output
    r = CliRunner().invoke(app, ["make", str(tmp_path / "d"), "--timeout", "30"])
    assert "--timeout" in str(r.exception) and "--base-url" in str(r.exception), r.output


def test_data_makes_client_takes_the_timeout(tiny_llama_dir) -> None:
    from draftsmith.targets import load_target

    t = load_target(tiny_llama_dir)
    with running(slow_app()) as url:
        client = _server_client(t, CFG, Server(url, "m", timeout=7.5), lambda s: None)
        client.close()
    assert client.timeout == 7.5 and client.client.timeout == 7.5
