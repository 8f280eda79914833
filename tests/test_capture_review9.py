"""Capture, ninth review: a server's answers and the engine's captured to the same shards; the
stored dtype whatever the compute dtype; --max-samples the manifest's first samples; a second
capture into a folder one is writing refused, not mixed with it; a manifest whose aux ids were
edited named as such by `verify` (the doctor's and `data inspect`'s check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset, verify
from draftsmith.errors import DraftsmithError
from draftsmith.train.sources import open_offline

CFG = CaptureConfig(aux_layer_ids=[0, 1, 2], batch_size=2, samples_per_shard=2, max_len=64)


def answered(tok, made: dict, n: int = 5) -> list[Conversation]:
    """Conversations as `data regenerate` records them, the answer's ids included; `made`: who
    made it (the engine's fields or a server's)."""
    out = []
    for i in range(n):
        text = f"answer {i}."
        ids = tok.encode(text, add_special_tokens=False)
        answer = {"turn": 0, **made, "tokens": len(ids), "finish": "stop", "ids": ids}
        out.append(Conversation([{"role": "user", "content": f"q{i}?"},
                                 {"role": "assistant", "content": text}],
                                meta={"prompt_id": f"p{i}", "answers": [answer]}))
    return out


def run(target, model, out: Path, cs: list[Conversation], cfg: CaptureConfig = CFG,
        **kw) -> dict:
    return capture(target, cs, out, cfg, progress=False, model=model, log=lambda s: None, **kw)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*"))}


def test_a_servers_answers_and_the_engines_capture_to_the_same_shards(target, model, tmp_path):
    engine = answered(target.tokenizer, {"made_by": {"target": "tiny", "batch_size": 8}})
    server = answered(target.tokenizer, {"model": "tiny", "sent": {"top_k": -1, "min_p": 0}})
    a = run(target, model, tmp_path / "engine", engine)
    b = run(target, model, tmp_path / "server", server)
    assert files(tmp_path / "engine") == files(tmp_path / "server") != {}
    assert {k for k in a if a[k] != b[k]} == set()
    assert a["answer_tokens"] == "target_ids"


def test_the_stored_dtype_is_bfloat16_and_said_whatever_the_compute_dtype(target, tmp_path):
    cs = answered(target.tokenizer, {})
    for dtype in (torch.float32, torch.bfloat16):
        cfg = CaptureConfig(aux_layer_ids=[0, 1, 2], samples_per_shard=2, dtype=dtype)
        out = tmp_path / str(dtype)
        m = run(target, target.build(dtype), out, cs, cfg)
        assert (m["dtype"], m["compute_dtype"]) == ("bfloat16", str(dtype)[6:])
        s = Dataset(out)[0]
        assert s["aux"].dtype == s["hidden"].dtype == torch.bfloat16
        verify(out)
    with pytest.raises(DraftsmithError, match="different compute_dtype"):
        run(target, None, tmp_path / "torch.float32", cs,
            CaptureConfig(aux_layer_ids=[0, 1, 2], samples_per_shard=2, dtype=torch.bfloat16))


def test_max_samples_takes_the_manifests_first_samples_alike_each_run(target, model, tmp_path):
    out = tmp_path / "d"
    run(target, model, out, answered(target.tokenizer, {}))
    ds = Dataset(out)
    first = [ds.sample_id(i) for i in range(3)]
    for _ in range(2):
        data = open_offline(out, target, 3, Dataset(out))
        got = [data.source[i] for i in range(len(data.source))]
        assert len(got) == 3 and data.lengths == ds.lengths()[:3]
        for i, s in enumerate(got):
            assert torch.equal(s["aux"], ds[i]["aux"]) and ds.sample_id(i) == first[i]


@pytest.mark.parametrize("second", [{}, {"overwrite": True, "ids": [0, 1, 3]}])
def test_a_second_capture_into_a_folder_being_written_is_refused(target, model, tmp_path,
                                                                  second):
    """Nothing held the folder: a second capture there (the same command in another shell, or
    one with --overwrite) wrote its shards and manifest beside the first's, or removed them
    while the first went on listing its own."""
    cs, out = answered(target.tokenizer, {}), tmp_path / "d"
    whole = run(target, model, tmp_path / "whole", cs)
    said: list[str] = []

    def again(k: int) -> None:
        if k == 0:
            cfg = CaptureConfig(aux_layer_ids=second.get("ids", [0, 1, 2]), batch_size=2,
                                samples_per_shard=2, max_len=64)
            with pytest.raises(DraftsmithError) as e:
                run(target, model, out, cs, cfg, overwrite=second.get("overwrite", False))
            said.append(str(e.value))

    assert run(target, model, out, cs, on_shard=again) == whole
    assert said == [f"--out {out}: another `draftsmith data capture` is writing into it; wait "
                    "for it to end (a rerun of the same command then resumes it) or capture into "
                    "another --out"]
    assert files(out) == files(tmp_path / "whole")
    assert run(target, None, out, cs) == whole  # the lock ends with the run


def test_an_edited_manifests_aux_ids_are_named_so_by_verify(target, model, tmp_path):
    """It said each shard was "renamed, or moved here from another dataset"; the shards are
    the capture's, the manifest's layers are what changed."""
    out = tmp_path / "d"
    run(target, model, out, answered(target.tokenizer, {}))
    m = json.loads((out / "manifest.json").read_text())
    m["aux_layer_ids"] = [0, 1, 3]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DraftsmithError) as e:
        verify(out)
    assert str(e.value) == (
        f"{out / 'shard-00000.safetensors'}: holds the states of aux layers [0, 1, 2] (its "
        f"metadata), but {out / 'manifest.json'} says [0, 1, 3]: the manifest was edited since "
        "the capture, or the shard moved here from a capture of other layers; put back "
        "aux_layer_ids [0, 1, 2] or capture the dataset again at the layers wanted")
    assert Dataset(out)[0]["aux"].shape[1] == 3  # the doctor still reads it to match its layers


def test_training_refuses_an_edited_manifests_aux_ids(target, model, tmp_path):
    """Training read such data without a word and recorded layers [0, 1, 3] in the drafter for
    states of [0, 1, 2]; it says now what verify says."""
    out = tmp_path / "d"
    run(target, model, out, answered(target.tokenizer, {}))
    m = json.loads((out / "manifest.json").read_text())
    m["aux_layer_ids"] = [0, 1, 3]
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DraftsmithError, match=r"holds the states of aux layers \[0, 1, 2\]"):
        open_offline(out, target, None)
