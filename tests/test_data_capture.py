"""Capture on a tiny random target: fresh-forward equality, kill + resume, ranks + merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset, read_manifest, verify
from draftsmith.errors import DraftsmithError


def convs(n: int = 14) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}: " + "why? " * (i % 4)},
                {"role": "assistant", "content": f"answer {i} " + "because. " * (i % 5)}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "and then?"},
                     {"role": "assistant", "content": f"then {i}."}]
        out.append(Conversation(msgs))
    return out




CFG = CaptureConfig(aux_layer_ids=[-1, 1, 4], batch_size=3, samples_per_shard=4, max_len=200)


def shard_bytes(folder: Path) -> dict[str, bytes]:
    m = read_manifest(folder)
    return {Path(s["file"]).name: (folder / s["file"]).read_bytes() for s in m["shards"]}


@pytest.fixture(scope="module")
def reference(target, model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    capture(target, convs(), out, CFG, progress=False, model=model, log=lambda s: None)
    return out


def test_stored_states_equal_a_fresh_forward(target, model, reference):
    ds = Dataset(reference)
    assert len(ds) == 14 and ds.manifest["complete"]
    assert ds.manifest["aux_layer_ids"] == [-1, 1, 4]
    assert "output of decoder layer j" in ds.manifest["aux_convention"]
    assert ds.manifest["target"]["fingerprint"] == target.fingerprint
    for i in (0, 5, 13):
        s = ds[i]
        with torch.no_grad():
            fo = model(s["input_ids"][None], torch.arange(len(s["input_ids"]))[None],
                       aux_ids=(-1, 1, 4), want_logits=False)
        assert torch.allclose(s["aux"].float(), fo.aux[0], atol=2e-2, rtol=1e-2)
        assert torch.allclose(s["hidden"].float(), fo.hidden[0], atol=2e-2, rtol=1e-2)
        text = target.tokenizer.decode(s["input_ids"][s["loss_mask"]].tolist())
        assert text.startswith(f"answer {i} ") and text.count("<|im_end|>") == 1 + (i % 3 == 0)


def test_stored_states_equal_an_hf_forward_at_the_named_layers(tiny_llama_dir, reference):
    """Against transformers, not our own model: canonical id j is HF's hidden_states[j + 1]
    (the output of decoder layer j; -1 the embedding), the stored hidden its last, normed."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    ds = Dataset(reference)
    for i in (0, 13):
        s = ds[i]
        with torch.no_grad():
            hs = hf(s["input_ids"][None], output_hidden_states=True).hidden_states
        assert len(hs) == 7
        want = torch.stack([hs[j + 1][0] for j in (-1, 1, 4)] + [hs[-1][0]], 1)
        got = torch.cat([s["aux"], s["hidden"][:, None]], 1).float()
        rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert rel.max() < 0.01, rel.max(0).values  # bf16 storage alone: ~0.002


def test_batch_one_is_bit_exact(target, model, tmp_path):
    cfg = CaptureConfig(aux_layer_ids=[0, 5], batch_size=1, samples_per_shard=8)
    capture(target, convs(3), tmp_path, cfg, progress=False, model=model, log=lambda s: None)
    s = Dataset(tmp_path)[2]
    with torch.no_grad():
        fo = model(s["input_ids"][None], torch.arange(len(s["input_ids"]))[None],
                   aux_ids=(0, 5), want_logits=False)
    assert torch.equal(s["aux"], fo.aux[0].bfloat16())
    assert torch.equal(s["hidden"], fo.hidden[0].bfloat16())


def test_killed_then_resumed_is_identical(target, model, reference, tmp_path):
    def die(k: int) -> None:
        if k == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(target, convs(), tmp_path, CFG, progress=False, model=model, on_shard=die,
                log=lambda s: None)
    assert len(read_manifest(tmp_path)["shards"]) == 2
    half = tmp_path / ".shard-00002.safetensors.4242.tmp"  # a kill -9 mid-write leaves one
    half.write_bytes(b"partial")
    logs: list[str] = []
    capture(target, convs(), tmp_path, CFG, progress=False, model=model, log=logs.append)
    assert any("2/4 shards to write" in s for s in logs)
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    assert verify(tmp_path)["samples"] == 14
    assert not list(tmp_path.glob(".*.tmp"))


def test_other_settings_are_refused_on_resume(target, model, reference):
    cfg = CaptureConfig(aux_layer_ids=[0, 1, 4], batch_size=3, samples_per_shard=4, max_len=200)
    with pytest.raises(DraftsmithError, match="different aux_layer_ids"):
        capture(target, convs(), reference, cfg, progress=False, model=model, log=lambda s: None)
    # the manifest names one compute dtype: shards of another are not added under it
    cfg = CaptureConfig(aux_layer_ids=[-1, 1, 4], batch_size=3, samples_per_shard=4, max_len=200,
                        dtype=torch.bfloat16)
    with pytest.raises(DraftsmithError, match="different compute_dtype"):
        capture(target, convs(), reference, cfg, progress=False, model=model, log=lambda s: None)


def test_two_ranks_merge_to_the_single_run(target, model, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        m = capture(target, convs(), tmp_path, CFG, progress=False, model=model,
                    log=lambda s: None)
    assert m["complete"] and m["totals"]["samples"] == 14
    assert [s["file"] for s in m["shards"]][:2] == ["rank-0/shard-00000.safetensors",
                                                   "rank-1/shard-00001.safetensors"]
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    merged, single = Dataset(tmp_path), Dataset(reference)
    assert [merged.sample_id(i) for i in range(14)] == [single.sample_id(i) for i in range(14)]
    verify(tmp_path)


def test_too_long_truncated_or_skipped_and_counted(target, model, tmp_path):
    data = convs(6)
    lens = [len(target.chat_ids(c.messages, False)) for c in data]
    limit = sorted(lens)[3]
    logs: list[str] = []
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=limit, too_long="skip")
    m = capture(target, data, tmp_path / "skip", cfg, progress=False, model=model,
                log=logs.append)
    too_long = sum(n > limit for n in lens)
    assert m["input"]["skipped"] == {"too_long": too_long}
    assert m["totals"]["samples"] == 6 - too_long
    assert any("skipped" in s for s in logs)
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=limit, too_long="truncate")
    m = capture(target, data, tmp_path / "cut", cfg, progress=False, model=model,
                log=lambda s: None)
    assert m["input"]["truncated"] == too_long and m["totals"]["samples"] == 6
    assert max(Dataset(tmp_path / "cut").lengths()) == limit


KILL_SCRIPT = """
import sys, time
from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.targets import load_target
sys.path.insert(0, {tests!r})
from test_data_capture import CFG, convs
capture(load_target({target!r}), convs(), {out!r}, CFG, progress=False,
        on_shard=lambda k: (print("shard", k, flush=True), time.sleep(0.5)))
"""


@pytest.mark.slow  # ~5-6 s: the default suite stays under 10 minutes on 2 cores
def test_kill_9_then_resume(target, model, reference, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    code = KILL_SCRIPT.format(tests=str(Path(__file__).parent), target=str(tiny_llama_dir),
                              out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            line = proc.stdout.readline()
            if line.startswith("shard 1") or not line:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    done = len(read_manifest(out)["shards"])
    assert 1 <= done < 4
    capture(target, convs(), out, CFG, progress=False, model=model, log=lambda s: None)
    assert shard_bytes(out) == shard_bytes(reference)


def test_overwrite_deletes_nothing_until_the_inputs_are_checked(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(c.to_json()) + "\n" for c in convs(3)))
    out = tmp_path / "ds"
    out.mkdir()
    old = {"manifest.json": "{}", "shard-00000.safetensors": "old shard"}
    for name, text in old.items():
        (out / name).write_text(text)
    base = ["capture", str(src), "-o", str(out), "--overwrite", "--device", "cpu"]
    r = CliRunner()
    for bad in (["--target", str(tmp_path / "no-target")],
                ["--target", str(tiny_llama_dir), "--aux-layers", "0,99"]):
        res = r.invoke(app, base + bad)
        assert isinstance(res.exception, DraftsmithError), res.output
        assert {p.name: p.read_text() for p in out.iterdir()} == old
    res = r.invoke(app, base + ["--target", str(tiny_llama_dir), "--aux-layers", "0,5"])
    assert res.exit_code == 0, res.output
    assert read_manifest(out)["aux_layer_ids"] == [0, 5] and verify(out)["samples"] == 3


def test_a_file_given_for_the_dataset_folder_is_refused(target, tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(c.to_json()) + "\n" for c in convs(2)))
    keep = tmp_path / "keep.txt"
    keep.write_text("notes\n")
    res = CliRunner().invoke(app, ["capture", str(src), "-o", str(keep), "--device", "cpu",
                                   "--target", str(target.folder)])
    assert isinstance(res.exception, DraftsmithError) and "not a folder" in str(res.exception)
    with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
        capture(target, convs(2), keep, CFG, progress=False, log=lambda s: None)
    assert keep.read_text() == "notes\n"


def test_overwrite_under_ranks_clears_only_what_this_rank_owns(tmp_path):
    """With --overwrite every rank cleans at its own pace: none removes another running rank's
    folder; rank 0 takes the top level and folders a wider earlier run left."""
    from draftsmith.data.capture import clean

    def fill() -> None:
        for name in ("rank-0", "rank-1", "rank-2", "rank-3"):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "shard-00000.safetensors").write_bytes(b"x")
        for name in ("manifest.json", "shard-00000.safetensors", "notes.txt"):
            (tmp_path / name).write_text("x")

    def left() -> set[str]:
        return {p.name for p in tmp_path.iterdir()}

    fill()
    clean(tmp_path, 1, 2)
    assert left() == {"rank-0", "rank-2", "rank-3", "manifest.json", "shard-00000.safetensors",
                      "notes.txt"}
    clean(tmp_path, 0, 2)
    assert left() == {"notes.txt"}  # rank 1's folder was already gone; 2 and 3 are stale
    fill()
    clean(tmp_path, 0, 2)
    assert left() == {"rank-1", "notes.txt"}  # rank 1 is running: its folder is its own
    fill()
    clean(tmp_path)
    assert left() == {"notes.txt"}


def test_aux_layers_out_of_order_or_repeated_are_refused_before_any_work(target, tmp_path):
    """SGLang and vLLM feed aux states ascending and `export` refuses other orders: a capture
    (or `data make`, or online --aux-layers) in another order wasted a whole run."""
    from draftsmith.data.pipeline import make_dataset
    from draftsmith.layers import parse_ids

    cases = {"4,1": r"\[4, 1\] are not ascending.*give --aux-layers 1,4",
             "1,4,1": r"\[1, 4, 1\] repeat a layer: give --aux-layers 1,4"}
    for text, why in cases.items():
        ids = [int(x) for x in text.split(",")]
        with pytest.raises(DraftsmithError, match=why):
            parse_ids(text)
        with pytest.raises(DraftsmithError, match=why):
            capture(target, convs(2), tmp_path / "c", CaptureConfig(aux_layer_ids=ids),
                    progress=False, log=lambda s: None)
        with pytest.raises(DraftsmithError, match=why):
            make_dataset(tmp_path / "m", 2, target, aux_layers=ids, log=lambda s: None)
    assert not (tmp_path / "c").exists() and not (tmp_path / "m").exists()


def masked_runs(target, sample: dict) -> list[str]:
    runs, cur = [], []
    for i, m in zip(sample["input_ids"].tolist(), sample["loss_mask"].tolist(), strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [target.tokenizer.decode(cur)], []
    return runs + ([target.tokenizer.decode(cur)] if cur else [])


def test_an_answer_cut_at_max_tokens_leaves_its_end_of_turn_out_of_the_loss(target, model,
                                                                            tmp_path):
    """The target did not end a turn cut at max tokens: the template's closing marker there is
    no token it predicted. The answer's own tokens stay in the loss."""
    msgs = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "on and on"},
            {"role": "user", "content": "stop?"}, {"role": "assistant", "content": "yes."}]
    answers = [{"turn": 0, "finish": "length"}, {"turn": 1, "finish": "stop"}]
    cut = Conversation(msgs, meta={"answers": answers})
    capture(target, [cut], tmp_path, CaptureConfig([1], max_len=200), progress=False,
            model=model, log=lambda s: None)
    s = Dataset(tmp_path)[0]
    assert masked_runs(target, s) == ["on and on", "yes.<|im_end|>"]
    assert target.tokenizer.decode(s["input_ids"].tolist()).count("<|im_end|>") == 4


def test_a_conversation_the_template_refuses_is_skipped_counted_and_warned_once(target, model,
                                                                               tmp_path):
    tok = target.tokenizer
    old = tok.chat_template
    tok.chat_template = ("{% if messages | length > 2 %}{{ raise_exception('Conversation roles "
                         "must alternate') }}{% endif %}" + old)
    logs: list[str] = []
    try:
        m = capture(target, convs(7), tmp_path, CaptureConfig([1], max_len=200), progress=False,
                    model=model, log=logs.append)
    finally:
        tok.chat_template = old
    assert m["input"]["skipped"] == {"template_refused": 3} and m["totals"]["samples"] == 4
    warned = [s for s in logs if "warning" in s]
    assert len(warned) == 1 and "refused 3 conversation" in warned[0]
    assert "conversation 0 (id" in warned[0] and "roles must alternate" in warned[0]


def test_a_grown_input_keeps_the_shards_it_leaves_alone(target, model, reference, tmp_path):
    """`data make --n` larger than before appends answers: the capture grows (shards whose
    samples are unchanged are kept, the rest redone) to what one capture of all of them is."""
    logs: list[str] = []
    capture(target, convs(6), tmp_path, CFG, progress=False, model=model, log=logs.append)
    first = shard_bytes(tmp_path)["shard-00000.safetensors"]
    with pytest.raises(DraftsmithError, match="different source_digest"):  # capture alone
        capture(target, convs(), tmp_path, CFG, progress=False, model=model, log=logs.append)
    capture(target, convs(), tmp_path, CFG, progress=False, model=model, log=logs.append,
            grow=True)
    assert any("3/4 shards to write" in s for s in logs)
    assert shard_bytes(tmp_path) == shard_bytes(reference)
    assert shard_bytes(tmp_path)["shard-00000.safetensors"] == first
    assert read_manifest(tmp_path)["expected"]["samples"] == 14 and verify(tmp_path)
    capture(target, convs(5), tmp_path, CFG, progress=False, model=model, log=lambda s: None,
            grow=True)  # shrunk: the shards past the input are gone
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    assert verify(tmp_path)["samples"] == 5


def test_merge_of_a_typod_folder_says_it_is_not_there(tmp_path):
    """`data merge` of a path that does not exist said it held no rank-R/manifest.json."""
    from draftsmith.data.capture import try_merge

    with pytest.raises(DraftsmithError, match=r"caputre: no such folder$"):
        try_merge(tmp_path / "caputre")
    (tmp_path / "f").write_text("x")
    with pytest.raises(DraftsmithError, match="f: is a file, not a capture folder"):
        try_merge(tmp_path / "f")
    with pytest.raises(DraftsmithError, match="no rank-R/manifest.json to merge"):
        try_merge(tmp_path)
