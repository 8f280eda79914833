"""The doctor on a tiny 8-layer target: the seed's wiring bug, engine readings, each consistency
check, the behaviour gap, and a clean run with no findings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.doctor import DoctorOptions, run_doctor
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
from draftsmith.targets import load_target
from draftsmith.train.sources import target_head

TRUE = [1, 3, 5]  # outputs of these layers are what the data holds


def convs(n: int = 6) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}: why is the sky blue?"},
                          {"role": "assistant", "content": f"answer {i}: light scatters. " * 2}])
            for i in range(n)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("t8"), "llama", num_hidden_layers=8)




@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    cfg = CaptureConfig(aux_layer_ids=TRUE, batch_size=6, samples_per_shard=3, max_len=96)
    capture(target, convs(), out, cfg, progress=False, log=lambda s: None)
    return out


def make_drafter(folder: Path, target, ids: list[int], trained_on: list[int] | None = None,
                 **over) -> Path:
    from draftsmith.data.vocab import count_dataset

    counts = count_dataset(Path(folder).parent / "data", target.cfg.vocab_size) \
        if (Path(folder).parent / "data").exists() else torch.ones(target.cfg.vocab_size)
    used = counts.nonzero().flatten()
    d2t = used - torch.arange(used.numel())
    t2d = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    base = dict(target_fingerprint=target.fingerprint, target_source=str(target.folder))
    cfg = Eagle3Config.for_target(target.cfg, used.numel(), ids, **(base | over))
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.init_weights()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target_head(target)[0])
    d.set_vocab(d2t, t2d)
    data = {"kind": "offline", "aux_layer_ids": trained_on or ids,
            "target_fingerprint": target.fingerprint}
    return save_drafter(d, folder, data=data)


@pytest.fixture(scope="module")
def work(data_dir, tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("work")
    shutil.copytree(data_dir, w / "data")
    return w


def doctor(**kw):
    kw.setdefault("run", False)
    kw.setdefault("samples", 2)
    return run_doctor(DoctorOptions(**kw))


def errors(rep, check: str | None = None) -> list:
    return [f for f in rep.errors() if check is None or f.check == check]


# ---- the seed -------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong", [[0, 2, 4], [2, 4, 6]])
def test_seed_wrong_config_names_true_layers_and_fix(work, target, target_dir, wrong):
    folder = make_drafter(work / f"wrong{wrong[0]}", target, wrong, trained_on=None)
    rep = doctor(data=work / "data", drafter=folder, target=str(target_dir))
    assert rep.wiring["true_ids"] == TRUE and rep.wiring["token_set"] == "loss-masked"
    assert [s["status"] for s in rep.wiring["slots"]] == ["exact"] * 4
    wiring = [f for f in errors(rep, "wiring") if "will feed" in f.what]
    assert len(wiring) == 1
    f = wiring[0]
    assert str(wrong) in f.what and "[1, 3, 5]" in f.what
    assert f.fix == "write config.aux_layer_ids in draftsmith.json: [1, 3, 5]"
    assert rep.exit_code() == 1
    rep = doctor(data=work / "data", drafter=folder, engine="sglang")
    (f,) = rep.errors()
    assert f.fix.endswith("then writes for sglang: eagle_config.eagle_aux_hidden_state_layer_ids"
                          " in config.json: [1, 3, 5]")


def test_seed_edited_config_caught_without_data(work, target, target_dir):
    folder = make_drafter(work / "edited", target, [0, 2, 4], trained_on=TRUE)
    rep = doctor(drafter=folder, target=str(target_dir))
    f = errors(rep, "wiring")[0]
    assert "trained on data recorded as [1, 3, 5]" in f.what and "[1, 3, 5]" in f.fix


def test_correct_config_is_clean_with_a_speculative_run(work, target, data_dir):
    folder = make_drafter(work / "good", target, TRUE)
    rep = doctor(data=data_dir, drafter=folder, run=True, prompts=2, max_new=8)
    assert rep.problems() == [], rep.findings
    assert rep.exit_code(strict=True) == 0
    run = rep.behaviour["runs"]["as configured"]
    assert run["aux_layer_ids"] == TRUE and len(run["position_rates"]) == 3
    assert {"shards", "target", "wiring: data", "sizes", "vocab", "positions"} <= set(rep.passed)
    assert rep.context["in_each_convention"]["vllm"] == [2, 4, 6]


def test_mislabelled_manifest(work, target, target_dir):
    bad = work / "relabelled"
    shutil.copytree(work / "data", bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["aux_layer_ids"] = [2, 4, 6]  # as if the capture script's "layer 3" meant output of 3
    (bad / "manifest.json").write_text(json.dumps(m))
    rep = doctor(data=bad, target=str(target_dir))
    f = [f for f in errors(rep, "wiring") if "manifest says" in f.what][0]
    assert "[2, 4, 6]" in f.what and "[1, 3, 5]" in f.fix


# ---- engines --------------------------------------------------------------------------------

def sglang_folder(root: Path, src: Path, nested: list[int] | None, top: list[int] | None) -> Path:
    from safetensors.torch import save_file

    from draftsmith.models.eagle3 import hf_state_dict, load_drafter

    out = root / f"sglang-{nested}-{top}"
    d = load_drafter(src)
    tensors = {k: v for k, v in hf_state_dict(d).items() if k != "embed_tokens.weight"}
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    c = d.cfg
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
           "draft_vocab_size": c.draft_vocab_size, "max_position_embeddings": 512,
           "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False}
    if nested is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested}
    if top is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = top
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def good(work, target) -> Path:
    return make_drafter(work / "good-src", target, TRUE)


def test_sglang_reads_nested_ids_as_outputs_whatever_the_first_id(work, good, data_dir):
    """SGLang's Llama/Qwen classes add 1 to every explicit id, on every version (PR #25454's
    rule, +1 only where ids[0] == 1, changed the DeepSeek-V2 family): nested [2, 4, 6] feed
    the outputs of 2, 4, 6, not the [1, 3, 5] the data holds. `sglang-legacy`, the name that
    reading had, is the same engine."""
    folder = sglang_folder(work, good, [2, 4, 6], None)  # the seed's style of config
    for engine in ("sglang", "sglang-legacy"):
        rep = doctor(data=data_dir, drafter=folder, engine=engine)
        f = [f for f in errors(rep, "wiring") if "will feed" in f.what][0]
        assert "[2, 4, 6]" in f.what and not any("version dependent" in x.what
                                                for x in rep.findings)
        assert "eagle_config.eagle_aux_hidden_state_layer_ids in config.json: [1, 3, 5]" in f.fix


def test_sglang_ignores_top_level_ids(work, good, data_dir):
    folder = sglang_folder(work, good, None, [2, 4, 6])
    rep = doctor(data=data_dir, drafter=folder, engine="sglang")
    f = [f for f in errors(rep, "wiring") if "will feed" in f.what][0]
    assert "[1, 3, 4]" in f.what  # SGLang's defaults: inputs of 2, L//2, L-3
    assert any("silently uses its defaults" in x.what for x in rep.findings)
    assert doctor(data=data_dir, drafter=folder, engine="vllm").ok


def test_sglang_cannot_capture_last_layer(target, target_dir, tmp_path):
    out = tmp_path / "d"
    capture(target, convs(2), out, CaptureConfig(aux_layer_ids=[1, 3, 7], max_len=64),
            progress=False, log=lambda s: None)
    rep = doctor(data=out, target=str(target_dir), engine="sglang")
    assert any(f.check == "capturable" for f in rep.errors())
    row = next(r for r in rep.engines if r["engine"] == "sglang")
    assert row["write"] is None and "retrain" in row["how"]


# ---- consistency ----------------------------------------------------------------------------

def test_tampered_shard(work, target_dir):
    bad = work / "tampered"
    shutil.copytree(work / "data", bad)
    shard = bad / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    rep = doctor(data=bad, target=str(target_dir))
    f = errors(rep, "shards")[0]
    assert "sha256" in f.what and "shard-00001" in f.what


def test_different_target(work, data_dir, tmp_path):
    other = write_tiny_folder(tmp_path / "other", "llama", seed=1, num_hidden_layers=8)
    rep = doctor(data=data_dir, target=str(other))
    whats = " ".join(f.what for f in errors(rep, "target"))
    assert "fingerprint" in whats
    assert rep.wiring["true_ids"] == [None, None, None]


def test_different_tokenizer_and_template(work, target_dir, data_dir, tmp_path):
    other = tmp_path / "retok"
    shutil.copytree(target_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    rep = doctor(data=data_dir, target=str(other))
    whats = [f.what for f in errors(rep, "target")]
    assert any("tokenizer" in w for w in whats) and any("chat template" in w for w in whats)


def test_drafter_inconsistencies(work, target, data_dir):
    folder = make_drafter(work / "short", target, TRUE, max_position_embeddings=128)
    from safetensors.torch import load_file, save_file

    w = load_file(str(folder / "model.safetensors"))
    w["d2t"][-1] = 10_000
    save_file(w, str(folder / "model.safetensors"))
    rep = doctor(data=data_dir, drafter=folder)
    fixes = {f.check: f for f in rep.errors()}
    assert "set max_position_embeddings to 512" in fixes["positions"].fix
    assert "outside the target vocab" in fixes["vocab"].what


def test_a_drafter_that_does_not_load_or_run_is_reported_not_raised(work, target, target_dir):
    """Weights at odds with config.json are an error finding (an engine would fail to load
    them), not a skipped check under "OK"; aux ids the target lacks skip that run, and the
    report still comes out with the wiring's errors. --steps 0 is refused by its flag."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    folder = make_drafter(work / "odd_weights", target, TRUE)
    w = load_file(str(folder / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, :-1].contiguous()
    save_file(w, str(folder / "model.safetensors"))
    rep = doctor(drafter=folder, target=str(target_dir), run=True, prompts=1, max_new=4)
    assert "the drafter does not load" in errors(rep, "loads")[0].what and rep.exit_code(False)
    far = [*TRUE[:-1], 99]
    folder = make_drafter(work / "far_ids", target, far)
    rep = doctor(drafter=folder, target=str(target_dir), run=True, prompts=1, max_new=4)
    assert any("the run as configured" in s and "[99]" in s for s in rep.skipped)
    assert rep.errors() and rep.exit_code(False)
    with pytest.raises(DraftsmithError, match="--steps must be >= 1"):
        dataclasses.replace(DoctorOptions(drafter=folder), steps=0)


def test_behaviour_gap_is_flagged(work, target, data_dir):
    folder = make_drafter(work / "promised", target, TRUE)
    rows = [{"step": s, "loss": 1.0, "acc": [0.9, 0.8, 0.7], "cond_acc": [0.9, 0.85, 0.8],
             "accept_length": 3.3} for s in (10, 20)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = doctor(data=data_dir, drafter=folder, run=True, prompts=2, max_new=6)
    # the live match passed and the run fed the data's layers: a drafter's gap, not wiring
    f = [f for f in rep.findings if f.check == "behaviour"][0]
    assert f.severity == "warning" and "not wiring" in f.what
    assert "promised 90.0%" in f.what
    assert rep.behaviour["promised"]["accept_length"] == pytest.approx(3.3)


def test_cli_json_and_exit_code(work, target, data_dir):
    import typer
    from typer.testing import CliRunner

    from draftsmith.doctor import doctor as command

    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    folder = make_drafter(work / "cli", target, [0, 2, 4], trained_on=None)
    # --dtype auto, every other command's default, was "unknown dtype 'auto'"
    res = CliRunner().invoke(app, ["doctor", "--data", str(data_dir), "--drafter", str(folder),
                                   "--json", "--no-run", "--samples", "1", "--dtype", "auto"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["ok"] is False and out["wiring"]["true_ids"] == TRUE
    assert {"severity", "what", "where", "fix"} <= set(out["findings"][0])


def test_exported_folders_pass_for_their_engines(work, good, data_dir, target_dir):
    from draftsmith.export import export_drafter

    sg = export_drafter(good, "sglang", work / "exp-sglang", target=str(target_dir))
    sp = export_drafter(good, "speculators", work / "exp-spec", target=str(target_dir))
    for folder, engine in ((sg, "sglang"), (sg, "vllm"), (sp, "vllm")):
        rep = doctor(data=data_dir, drafter=folder, engine=engine)
        assert rep.problems() == [], (engine, rep.findings)
    rep = doctor(data=data_dir, drafter=sp, engine="sglang")
    assert "does not load the speculators layout" in rep.errors()[0].what
    rep = doctor(data=data_dir, drafter=sg, run=True, prompts=1, max_new=4)  # target from file
    assert rep.context["target"]["from"] == "the data manifest"
    assert list(rep.behaviour["runs"]) == ["as sglang feeds it"]


def test_shard_dtype_differs_from_manifest(work, target_dir):
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save

    bad = work / "fp32"
    shutil.copytree(work / "data", bad)
    path = bad / "shard-00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    tensors["aux"] = tensors["aux"].float()
    raw = save(tensors, metadata=meta)
    path.write_bytes(raw)
    m = json.loads((bad / "manifest.json").read_text())
    m["shards"][0].update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
    m["totals"]["bytes"] = sum(s["bytes"] for s in m["shards"])
    (bad / "manifest.json").write_text(json.dumps(m))
    rep = doctor(data=bad, target=str(target_dir))
    (f,) = rep.errors()
    assert f.check == "dtype" and "'aux': 'float32'" in f.what and "bfloat16" in f.what


def test_sglang_gets_what_export_writes_and_limits_are_errors():
    """Export writes canonical [2, 4, 6] of an 8-layer target as [2, 4, 6] (it went out as
    [3, 5, 7], which SGLang's Llama classes read as outputs of 3, 5, 7). The last layer's
    output is an error for SGLang even where the ids agree."""
    from draftsmith.doctor.engines import feed_from_canonical, feed_from_written, what_to_write
    from draftsmith.doctor.verdict import _feed_findings
    from draftsmith.doctor.wiring import _verdict

    feed = feed_from_canonical([2, 4, 6], "sglang", 8)
    assert (feed.written, feed.canonical) == ([2, 4, 6], [2, 4, 6])
    written, words = what_to_write([2, 4, 6], "sglang", 8)
    assert written == [2, 4, 6] and words.endswith("in config.json: [2, 4, 6]")
    feed = feed_from_written([1, 3, 7], "sglang", 8)
    assert feed.canonical == [1, 3, 7]

    class Info:
        folder = "d"
    found = _feed_findings([1, 3, 7], feed, Info(), 8)
    assert [f.severity for f in found] == ["error"] and "last layer output" in found[0].what
    tie = _verdict("aux[1]", 4, torch.tensor([0.0, 0.0, 0.5]), torch.ones(3))
    assert tie.status != "exact"


def test_sglang_ids_past_the_target_are_a_finding_not_a_crash():
    """[2, 3, 4] on a 4-layer target: SGLang reads the outputs of layers 2-4, and layer 4 is
    not there; the doctor says so in the ids as written."""
    from draftsmith.doctor.engines import feed_from_written

    feed = feed_from_written([2, 3, 4], "sglang", 4)
    assert feed.canonical is None and not feed.version_dependent
    assert feed.note.startswith("SGLang reads [2, 3, 4] as the outputs of layers [2, 3, 4]: id 4 "
                                "is out of range for this target (4 layers")


# ---- review: edge layers, bad configs, exported folders, damaged data --------------------------

def test_embedding_and_layer0_data_are_reported_for_every_engine(target, target_dir, tmp_path):
    """Data at the embedding (-1) stopped the whole report: every engine's advice asked current
    SGLang's form, which has none; [0, ...] likewise. vLLM's id 0 needs newer model files."""
    from draftsmith.doctor.engines import what_to_write

    out = tmp_path / "emb"
    capture(target, convs(2), out, CaptureConfig(aux_layer_ids=[-1, 3, 5], max_len=64),
            progress=False, log=lambda s: None)
    rep = doctor(data=out, target=str(target_dir), engine="vllm")
    assert rep.wiring["true_ids"] == [-1, 3, 5]
    rows = {r["engine"]: r for r in rep.engines}
    assert rows["vllm"]["write"] == [0, 4, 6] and rows["sglang"]["write"] is None
    assert any("needs vLLM id 0" in f.what for f in rep.findings if f.check == "capturable")
    written, words = what_to_write([0, 3, 5], "sglang", 8)
    assert written == [0, 3, 5] and words.endswith("in config.json: [0, 3, 5]")
    assert what_to_write([0, 3, 5], "vllm", 8)[0] == [1, 4, 6]


@pytest.mark.parametrize("over", [{"eagle_aux_hidden_state_layer_ids": "2,4,6"},
                                  {"eagle_aux_hidden_state_layer_ids": [2.0, 4.5, 6]},
                                  {"eagle_config": [1, 3, 5]}, {"draftsmith": "x"}])
def test_malformed_ids_in_an_exported_config_are_named(tmp_path, good, target_dir, over):
    bad = sglang_folder(tmp_path, good, [1, 3, 5], [2, 4, 6])
    cfg = json.loads((bad / "config.json").read_text()) | over
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match=f"config.json: {next(iter(over))}"):
        doctor(drafter=bad, target=str(target_dir))


def test_an_exported_folder_for_another_target_is_an_error(good, target_dir, tmp_path):
    from draftsmith.export import export_drafter

    other = write_tiny_folder(tmp_path / "other", "llama", seed=1, num_hidden_layers=8)
    for fmt in ("sglang", "speculators"):
        folder = export_drafter(good, fmt, tmp_path / fmt, target=str(target_dir))
        rep = doctor(drafter=folder, target=str(other))
        assert any("trained for target fingerprint" in f.what for f in errors(rep, "target"))
        assert doctor(drafter=folder, target=str(target_dir)).ok


def test_engine_draftsmith_checks_what_import_reads_from_an_exported_folder(tmp_path, good,
                                                                           data_dir):
    """`--engine draftsmith` on an SGLang folder checked nothing and passed broken wiring."""
    folder = sglang_folder(tmp_path, good, [3, 5, 7], None)  # SGLang: outputs of 3, 5, 7
    rep = doctor(data=data_dir, drafter=folder, engine="draftsmith")
    (f,) = [f for f in errors(rep, "wiring") if "will feed" in f.what]
    assert "[3, 5, 7]" in f.what and "import" in f.where
    assert f.fix == "write eagle_config.eagle_aux_hidden_state_layer_ids in config.json: [1, 3, 5]"


def test_layers_with_identical_states_do_not_fail_correct_data(tmp_path):
    """Layer 2 adds nothing, so layers 1 and 2 hold the same states: data at layer 1 matched
    both 'ambiguously' and the doctor said to recapture correct data."""
    import io

    from rich.console import Console
    from safetensors.torch import load_file, save_file

    from draftsmith.doctor.render import show

    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=8)
    w = load_file(str(folder / "model.safetensors"))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        w[f"model.layers.2.{name}.weight"].zero_()
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "d"
    capture(load_target(folder), convs(2), out, CaptureConfig(aux_layer_ids=TRUE, max_len=64),
            progress=False, log=lambda s: None)
    rep = doctor(data=out, target=str(folder))
    assert rep.wiring["true_ids"] == TRUE and rep.exit_code(strict=True) == 0
    slot = rep.wiring["slots"][0]
    assert (slot["status"], slot["best_id"], slot["tied_ids"]) == ("tied", 1, [1, 2])
    buf = io.StringIO()
    show(rep, Console(file=buf, width=200))
    assert "1 note(s), no errors or warnings" in buf.getvalue()
    m = json.loads((out / "manifest.json").read_text())
    m["aux_layer_ids"] = [0, 3, 5]
    (out / "manifest.json").write_text(json.dumps(m))
    f = errors(doctor(data=out, target=str(folder)), "wiring")[0]
    assert "matches canonical layers [1, 2] alike" in f.what


def test_damaged_data_with_a_drafter_is_reported_not_raised(work, good, target_dir, tmp_path):
    """A truncated shard stopped the report once a drafter was given (draft-vocab coverage and
    the run's prompts read every shard); the run then used built-in prompts, labelled as such."""
    bad = tmp_path / "truncated"
    shutil.copytree(work / "data", bad)
    for shard in bad.glob("shard-*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:500])
    rep = doctor(data=bad, drafter=good, target=str(target_dir), run=True, prompts=1, max_new=4)
    assert errors(rep, "shards") and rep.exit_code() == 1
    assert rep.behaviour["prompts"] == "built-in, target chat template"


def test_unmerged_multi_rank_capture_is_named(work, tmp_path):
    shutil.copytree(work / "data", tmp_path / "run" / "rank-0")
    with pytest.raises(DraftsmithError, match="draftsmith data merge"):
        doctor(data=tmp_path / "run")


def test_vllm_falls_back_to_eagle_config_in_its_own_convention(tmp_path, good, data_dir):
    """vLLM reads eagle_config's ids when the top-level key is missing, as inputs of layers: a
    nested [1, 3, 5] feeds layers 0, 2, 4 there (the doctor assumed the defaults, so a drafter
    trained on the defaults passed); older versions' defaults are named as a version note."""
    folder = sglang_folder(tmp_path, good, TRUE, None)
    (f,) = [f for f in errors(doctor(data=data_dir, drafter=folder, engine="vllm"), "wiring")
            if "will feed" in f.what]
    assert "canonical layers [0, 2, 4]" in f.what and "defaults (canonical [1, 3, 4]" in f.what
    folder = sglang_folder(tmp_path, good, [2, 4, 6], None)
    rep = doctor(data=data_dir, drafter=folder, engine="vllm")
    assert rep.ok and any("version dependent" in f.what for f in rep.problems())


def test_a_foreign_aux_convention_is_an_error_as_train_refuses_it(work, target_dir, tmp_path):
    """An external tool's manifest in another convention passed with a warning (exit 0), yet
    `draftsmith train` refuses it."""
    from draftsmith.train.sources import open_offline

    bad = tmp_path / "foreign"
    shutil.copytree(work / "data", bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["aux_convention"] = "input of decoder layer j (EAGLE)"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DraftsmithError, match="canonical form"):
        open_offline(bad, load_target(target_dir), None)
    (f,) = errors(doctor(data=bad, target=str(target_dir)), "shards")
    assert "set aux_convention in manifest.json to 'output of decoder layer j" in f.fix


def test_behaviour_gap_on_too_few_drafts_is_no_wiring_error():
    """A short run (2 prompts, 8 tokens) of a drafter whose log promised 6.2% accepted 0 of 16
    drafts, which happens 36% of the time at that rate, and the doctor called it a wiring error
    (exit 1); the same shortfall over many drafts still is one."""
    from draftsmith.doctor.behaviour import below_chance, gap_findings

    promise = {"cond_acc": [0.0625, 0.0], "accept_length": 1.06}

    def run(k, n):
        return {"as configured": {"position_rates": [k / n, 0.0], "reached": [n, k],
                                  "accepted": [k, 0], "mean_accept_length": 1 + k / n,
                                  "aux_layer_ids": TRUE}}

    assert below_chance(0, 16, 0.0625) == pytest.approx(0.9375 ** 16)
    assert below_chance(3, 10, 0.0) == 1.0 and below_chance(9, 10, 1.0) == 0.0
    (f,) = gap_findings(run(0, 16), promise, "d")
    assert f.severity == "warning" and "0 of 16 drafts, too few to tell" in f.what
    (f,) = gap_findings(run(0, 400), promise, "d")
    assert f.severity == "error" and "wiring" in f.what
    assert gap_findings(run(4, 100), {"cond_acc": [0.07], "accept_length": 1.07}, "d") == []


def test_behaviour_of_a_run_that_drafted_nothing_is_unmeasured_not_rejected():
    """A run whose answers all ended at once reached no draft position: its rates are None and
    the table shows '-', and the gap check says nothing was measured instead of comparing 0 %
    with the training log's promise."""
    from draftsmith.doctor.behaviour import gap_findings
    from draftsmith.doctor.render import behaviour_table

    run = {"position_rates": [None, None], "reached": [0, 0], "accepted": [0, 0],
           "mean_accept_length": 0.0, "tokens_per_s": 0.0, "aux_layer_ids": TRUE}
    (f,) = gap_findings({"as configured": run}, {"cond_acc": [0.6, 0.4], "accept_length": 2.0},
                        "d")
    assert f.severity == "warning" and "nothing measures acceptance" in f.what
    tab = behaviour_table({"runs": {"as configured": run}, "prompts": 2,
                           "promised": {"cond_acc": [0.6, 0.4], "accept_length": 2.0}})
    assert list(tab.columns[2].cells)[:2] == ["-", "-"]
