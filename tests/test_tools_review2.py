"""Tools review 2: compare says on stderr what it measures; serve reports a chain's
num_draft_tokens (steps + 1), as generate and bench do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter


def _drafter(target, folder: Path, seed: int) -> Path:
    from draftsmith.layers import default_aux_layers

    cfg = Eagle3Config.for_target(target.cfg, target.cfg.vocab_size,
                                  default_aux_layers(target.cfg.num_layers),
                                  target_fingerprint=target.fingerprint)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    d.init_weights()
    d.set_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                torch.ones(cfg.vocab_size, dtype=torch.bool))
    return save_drafter(d, folder)


def test_compare_says_each_load_and_run_on_stderr_and_keeps_stdout(target, tiny_llama_dir,
                                                                   tmp_path, capsys):
    paths = [str(_drafter(target, tmp_path / n, s)) for n, s in (("D", 0), ("E2", 1))]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), num_prompts=2,
                                     max_new=4, steps=2))
    out, err = capsys.readouterr()
    assert out == "" and set(res["speed"]["drafters"]) == {"D", "E2"}
    for line in ("compare: loading drafter D", "compare: loading drafter E2",
                 "compare: prompt 1/2: D", "compare: prompt 2/2: E2",
                 "compare: prompt 1/2: the target alone", "compare: 6/6 runs"):
        assert line in err, (line, err)
    assert err.index("loading drafter E2") < err.index("prompt 1/2")


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    from conftest import write_tiny_folder

    from draftsmith.serve.engine import EngineConfig, load_engine
    from draftsmith.targets import load_target

    tiny = write_tiny_folder(tmp_path_factory.mktemp("t"), "llama", seed=2)
    drafter = _drafter(load_target(tiny), tmp_path_factory.mktemp("d"), 0)
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=32, max_tokens=8, steps=3, topk=1)
    return load_engine(str(tiny), drafter, "cpu", torch.float32, cfg), tiny


def test_serve_reports_a_chains_draft_tokens_as_steps_plus_one(spec_engine):
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from test_serve import live

    engine, tiny = spec_engine
    with live(engine, str(tiny)) as s:
        card = httpx.get(s["url"] + "/v1/models").json()["data"][0]["draftsmith"]
        metrics = httpx.get(s["url"] + "/metrics").json()
    for info in (card, metrics):
        assert (info["steps"], info["topk"], info["num_draft_tokens"]) == (3, 1, 4)
