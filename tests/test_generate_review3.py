"""generate built a runtime for every batch: on a GPU each allocated its KV cache and captured
its decode graph again. One runtime now serves every batch, with the same text."""

from __future__ import annotations

import json

from test_cli_review import run_main


def test_generate_decodes_every_batch_on_one_runtime(monkeypatch, capsys, tiny_llama_dir):
    from draftsmith.engine import runtime

    made = []
    init = runtime.Runtime.__init__

    def counted(self, *a, **k):
        made.append(a[:2])
        init(self, *a, **k)

    args = ["generate", "-p", "hello", "-p", "a longer prompt than that", "-p", "x",
            "--target", str(tiny_llama_dir), "--device", "cpu", "-n", "4", "--json"]
    code, out, err = run_main(monkeypatch, capsys, *args, "--batch-size", "3")
    assert code == 0, err
    whole = [json.loads(x) for x in out.splitlines()]
    monkeypatch.setattr(runtime.Runtime, "__init__", counted)
    code, out, err = run_main(monkeypatch, capsys, *args, "--batch-size", "2")
    assert code == 0, err
    assert len(made) == 1 and made[0][1] == 2  # two rows, for batches of 2 and 1
    assert [json.loads(x) for x in out.splitlines()] == whole
