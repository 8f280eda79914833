"""Capture, second review: the named layers against HF, padding, what the manifest records,
reruns of other settings, a full disk mid-capture, a cut before the answer, damaged shards."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.data import atomic
from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation, encode_conversation
from draftsmith.data.shards import MANIFEST, Dataset, read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=4, samples_per_shard=2, max_len=400)


def convs(n: int = 5) -> list[Conversation]:
    """One-turn conversations of very different lengths (a long one among short ones)."""
    out = []
    for i in range(n):
        long = i == 1
        msgs = [{"role": "user", "content": f"q{i}?" + (" more" * 20 if long else "")},
                {"role": "assistant", "content": f"a{i}." + (" and so on" * 10 if long else "")}]
        out.append(Conversation(msgs))
    return out


def run(target, model, out: Path, cfg: CaptureConfig = CFG, cs=None, **kw):
    return capture(target, cs or convs(), out, cfg, progress=False, model=model,
                   log=kw.pop("log", lambda s: None), **kw)


def stored(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def reference(target, model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref2")
    run(target, model, out)
    return out


def test_aux_states_are_the_named_layers_outputs_first_and_last_included(tiny_llama_dir, target,
                                                                        model, tmp_path):
    """Canonical j is decoder layer j's output (HF's forward hook; -1 the embedding); the last
    layer's is the stream before the final norm, the stored hidden the one after it."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    outs: dict[int, torch.Tensor] = {}
    for j, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(
            lambda mod, args, o, j=j: outs.__setitem__(j, o[0] if isinstance(o, tuple) else o))
    for ids in ([-1, 0, 5], [5], [2, 3, 4]):
        out = tmp_path / "_".join(map(str, ids))
        run(target, model, out, dataclasses.replace(CFG, aux_layer_ids=ids), convs(3))
        ds = Dataset(out)
        assert ds.aux_layer_ids == ids
        for i in range(len(ds)):
            s = ds[i]
            with torch.no_grad():
                hs = hf(s["input_ids"][None], output_hidden_states=True).hidden_states
            want = torch.stack([hs[0][0] if j == -1 else outs[j][0] for j in ids]
                               + [hs[-1][0]], 1)
            got = torch.cat([s["aux"], s["hidden"][:, None]], 1).float()
            rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert rel.max() < 0.01, (ids, rel.max(0).values)  # bf16 storage alone: ~0.002
    assert not torch.allclose(outs[5][0], hs[-1][0], atol=1e-2)  # the norm is not a no-op


def test_padding_never_reaches_the_stored_states_or_masks(target, model, reference, tmp_path):
    """A batch of a long sample and short ones stores each as a batch of one stores it."""
    alone = tmp_path / "alone"
    run(target, model, alone, dataclasses.replace(CFG, batch_size=1))
    a, b = Dataset(reference), Dataset(alone)
    lens = a.lengths()
    assert max(lens) > 5 * min(lens)
    for i, conv in enumerate(convs()):
        ids, mask = encode_conversation(target.tokenizer, conv)
        x, y = a[i], b[i]
        assert x["input_ids"].tolist() == ids and x["loss_mask"].tolist() == mask
        assert torch.equal(x["loss_mask"], y["loss_mask"]) and len(x["aux"]) == len(ids)
        for k in ("aux", "hidden"):
            assert torch.allclose(x[k].float(), y[k].float(), atol=2e-2, rtol=1e-2), (i, k)


def test_the_manifest_records_what_its_shards_hold(target, reference):
    m, ds = read_manifest(reference), Dataset(reference)
    assert m["complete"] and m["aux_layer_ids"] == [-1, 0, 5]
    assert "output of decoder layer j" in m["aux_convention"]
    assert m["target"]["fingerprint"] == target.fingerprint
    assert (m["target"]["num_layers"], m["hidden_size"], m["vocab_size"]) == (
        target.cfg.num_layers, target.cfg.hidden_size, target.cfg.vocab_size)
    samples = [ds[i] for i in range(len(ds))]
    assert {str(s["aux"].dtype) for s in samples} == {f"torch.{m['dtype']}"}
    assert m["totals"] == {
        "samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples),
        "loss_tokens": sum(int(s["loss_mask"].sum()) for s in samples),
        "bytes": sum((reference / s["file"]).stat().st_size for s in m["shards"]),
        "shards": 3}
    assert m["expected"] == {k: m["totals"][k] for k in ("shards", "samples", "tokens")}
    for s in m["shards"]:
        assert s["sha256"] == hashlib.sha256((reference / s["file"]).read_bytes()).hexdigest()
    assert verify(reference)["samples"] == 5


def test_a_rerun_of_another_target_or_max_len_is_refused_and_changes_nothing(
        target, model, reference, tmp_path):
    before = stored(reference)
    other = write_tiny_folder(tmp_path / "other", "llama", seed=1)
    from draftsmith.targets import load_target

    t2 = load_target(other)
    assert t2.fingerprint != target.fingerprint
    with pytest.raises(DraftsmithError, match=f"different target .*{t2.fingerprint}"):
        run(t2, t2.build(torch.float32), reference)
    for change, said in (({"max_len": 300}, "different max_len .400 there, 300 now"),
                         ({"too_long": "skip"}, "different too_long"),
                         ({"samples_per_shard": 3}, "different samples_per_shard")):
        with pytest.raises(DraftsmithError, match=said):
            run(target, model, reference, dataclasses.replace(CFG, **change))
    assert stored(reference) == before


def test_a_full_disk_mid_capture_says_what_is_kept_and_a_rerun_equals_an_uninterrupted_one(
        target, model, reference, tmp_path, monkeypatch):
    """The error said "the file there before is unchanged" of a shard that was never there, and
    nothing of the shards kept or of a rerun going on."""
    replace = os.replace

    def full(src, dst):
        if Path(dst).name == "shard-00001.safetensors":
            raise OSError(28, "No space left on device")
        return replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", full)
    with pytest.raises(DraftsmithError) as e:
        run(target, model, tmp_path)
    said = str(e.value)
    assert "shard-00001.safetensors: cannot write it (No space left on device)" in said
    assert "the 1 shard(s) finished before this one are kept" in said
    assert "rerun the same command" in said and "there before" not in said
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "shard-00000.safetensors"]
    monkeypatch.setattr(atomic.os, "replace", replace)
    logs: list[str] = []
    run(target, model, tmp_path, log=logs.append)
    assert any("2/3 shards to write" in s for s in logs)
    assert stored(tmp_path) == stored(reference)


def test_a_conversation_cut_before_its_answer_is_said_to_be_max_lens_doing(target, model,
                                                                          tmp_path):
    """It was counted "no_assistant_tokens", as if the input had no answer, with 0 truncated."""
    cs = convs()
    prompt_len = len(encode_conversation(target.tokenizer, cs[1])[1]) - sum(
        encode_conversation(target.tokenizer, cs[1])[1])
    cfg = dataclasses.replace(CFG, max_len=prompt_len - 5)
    logs: list[str] = []
    m = run(target, model, tmp_path, cfg, log=logs.append)
    assert m["input"]["skipped"] == {"answer_past_max_len": 1}
    assert any("skipped 1 answer_past_max_len" in s for s in logs)
    empty = Conversation([{"role": "user", "content": "hi"}])
    with pytest.raises(DraftsmithError, match="skipped: 1 no_assistant_tokens"):
        run(target, model, tmp_path / "none", cs=[empty])


def test_a_shard_without_a_tensor_or_its_sample_ids_is_named_when_read(reference, tmp_path):
    """A foreign shard lacking `hidden` was a bare SafetensorError; one without metadata a
    TypeError."""
    from safetensors import safe_open
    from safetensors.torch import save

    folder = tmp_path / "ds"
    folder.mkdir()
    for p in reference.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    path = folder / "shard-00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del tensors["hidden"]
    path.write_bytes(save(tensors))
    ds = Dataset(folder)
    with pytest.raises(DraftsmithError, match=r"shard-00000.safetensors: unreadable shard"):
        ds[0]
    with pytest.raises(DraftsmithError, match=r"shard-00000.safetensors: no sample_ids"):
        ds.sample_id(0)
    assert ds.tokens(0)[0].tolist() == Dataset(reference).tokens(0)[0].tolist()
    assert Dataset(folder).sample_id(2) == json.loads(json.dumps(Dataset(reference).sample_id(2)))


def test_a_merged_capture_missing_a_shard_is_made_whole_by_a_rerun(target, model, reference,
                                                                   tmp_path, monkeypatch):
    """A merged, complete dataset was taken as done whatever its shards: a rank's shard deleted
    (or cut short) stayed missing however often the ranks ran again."""
    monkeypatch.setenv("WORLD_SIZE", "2")

    def ranks() -> dict:
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            m = run(target, model, tmp_path)
        return m

    ranks()
    lost = tmp_path / "rank-1" / "shard-00001.safetensors"
    lost.unlink()
    m = ranks()
    assert m["complete"] and lost.is_file() and verify(tmp_path)["samples"] == 5
    single = {Path(s["file"]).name: (reference / s["file"]).read_bytes()
              for s in read_manifest(reference)["shards"]}
    assert {Path(s["file"]).name: (tmp_path / s["file"]).read_bytes()
            for s in m["shards"]} == single


def test_out_of_memory_mid_capture_is_one_error_and_a_smaller_batch_resumes(
        target, model, tmp_path, monkeypatch):
    """A GPU out of memory was a bare torch traceback, saying nothing of the shards kept or
    that a smaller --batch-size resumes the same dataset."""
    from draftsmith.data import capture as cap

    forward = cap.forward_shard

    def oom(model, tok, convs, idx, cfg, aux_ids):
        if cfg.batch_size > 1 and idx[0] >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return forward(model, tok, convs, idx, cfg, aux_ids)

    monkeypatch.setattr(cap, "forward_shard", oom)
    with pytest.raises(DraftsmithError, match=r"out of memory forwarding 4 conversation.s. of up "
                       r"to 400 tokens at once: .* keeps the 1 shard.s. finished .2 samples.; a "
                       r"rerun of the same command captures the rest, and may pass a smaller "
                       r"--batch-size"):
        run(target, model, tmp_path)
    logs: list[str] = []
    m = run(target, model, tmp_path, dataclasses.replace(CFG, batch_size=1), log=logs.append)
    assert any("2/3 shards to write" in s for s in logs)
    assert m["complete"] and verify(tmp_path)["samples"] == 5
