"""compare: hand-counted parameters under every convention, external layouts written by hand
(SpecForge/SGLang, speculators) read correctly, and acceptance on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.compare import CompareOptions, parse_claims, run_compare
from draftsmith.compare.describe import describe
from draftsmith.compare.params import likely_convention, parse_number
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, hf_state_dict, save_drafter
from draftsmith.train.sources import target_head

V, H, HEADS, KV, HD = 128, 64, 4, 2, 16  # the tiny target: vocab, hidden, heads, kv heads


def hand_counts(inter: int, dv: int, embed_stored: bool) -> dict[str, int]:
    fc = H * 3 * H
    attn = (HEADS * HD) * 2 * H + 2 * (KV * HD) * 2 * H + H * (HEADS * HD)  # q, k+v, o
    mlp = 2 * inter * H + H * inter
    norms = 4 * H  # input_layernorm, hidden_norm, post_attention_layernorm, norm
    core = fc + attn + mlp + norms
    head, embed, buffers = dv * H, V * H, dv + V  # d2t [dv], t2d [V]
    stored = core + head + buffers + (embed if embed_stored else 0)
    return {"core": core, "trainable": core + head, "all": core + head + embed,
            "stored": stored}





def build(target, inter: int, dv: int, ids: list[int], seed: int) -> Eagle3Drafter:
    cfg = Eagle3Config.for_target(target.cfg, dv, ids, intermediate_size=inter,
                                  target_fingerprint=target.fingerprint,
                                  target_source=str(target.folder))
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    d.init_weights(0.2)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target_head(target)[0])
    used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:dv].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    d.set_vocab(used - torch.arange(dv), t2d)
    return d


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cmp")
    a = build(target, 128, 32, [0, 2, 4], 0)
    b = build(target, 256, 64, [1, 2, 3], 1)
    data = {"kind": "offline", "samples": 500, "tokens": 100_000}
    out = {"A": save_drafter(a, root / "small", data=data),
           "B": save_drafter(b, root / "big", data=data | {"samples": 19_000,
                                                          "tokens": 3_800_000})}
    out["B-specforge"] = specforge_folder(b, root / "specforge", [1, 2, 3])  # outputs, as SGLang
    out["B-speculators"] = speculators_folder(b, root / "speculators", target)
    return out


def specforge_folder(d: Eagle3Drafter, out: Path, written: list[int]) -> Path:
    """SGLang/SpecForge layout by hand: midlayer.* names, no embedding, nested ids only."""
    out.mkdir()
    w = {k: v for k, v in hf_state_dict(d).items() if k != "embed_tokens.weight"}
    save_file(w, str(out / "model.safetensors"))
    c = d.cfg
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": H, "intermediate_size": c.intermediate_size,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": c.draft_vocab_size,
           "max_position_embeddings": 512, "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": written,
                            "use_aux_hidden_state": True}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def speculators_folder(d: Eagle3Drafter, out: Path, target) -> Path:
    """speculators layout by hand: layers.0.* names, embedding kept, vLLM ids at top level."""
    out.mkdir()
    w = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
         for k, v in hf_state_dict(d).items()}
    save_file(w, str(out / "model.safetensors"))
    c = d.cfg
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": c.intermediate_size,
             "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
             "num_hidden_layers": 1, "vocab_size": V, "max_position_embeddings": 512,
             "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0}
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
           "norm_before_residual": False, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": str(target.folder),
                                               "architectures": ["LlamaForCausalLM"]}}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("name,inter,dv,stored", [
    ("A", 128, 32, True), ("B", 256, 64, True), ("B-specforge", 256, 64, False),
    ("B-speculators", 256, 64, True)])
def test_parameter_counts_by_convention(drafters, name, inter, dv, stored):
    p = describe(drafters[name], name).params
    assert p.by_convention() == hand_counts(inter, dv, stored)
    assert p.embedding == V * H and p.embedding_stored is stored and p.lm_head == dv * H
    assert p.bytes_on_disk == (drafters[name] / "model.safetensors").stat().st_size


def test_external_layouts_read_correctly(drafters, tiny_llama_dir):
    sf = describe(drafters["B-specforge"], "sf", num_layers=6)
    assert sf.info.layout == "sglang" and sf.ids_canonical == [1, 2, 3]
    assert sf.ids_written == {"eagle_config.eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    sp = describe(drafters["B-speculators"], "sp")  # depth from the verifier's config.json
    assert sp.info.layout == "speculators" and sp.ids_canonical == [1, 2, 3]
    for d in (sf, sp):
        assert d.arch["intermediate_size"] == 256 and d.arch["draft_vocab_size"] == 64
        assert d.arch["attention heads"] == HEADS and d.arch["kv heads"] == KV
        assert d.arch["decoder layers"] == 1 and d.arch["norm_before_residual"] is False
    mine = describe(drafters["B"], "B")
    assert {k: v for k, v in mine.arch.items() if k not in ("layout", "weights dtype")} == \
        {k: v for k, v in sp.arch.items() if k not in ("layout", "weights dtype")}


def test_claimed_convention():
    assert parse_number("1.2B") == 1.2e9 and parse_number("500M") == 5e8
    assert parse_claims(["A=1e9"]) == {"A": 1e9}
    with pytest.raises(DraftsmithError):
        parse_claims(["A"])


def test_seed_question_answered(drafters):
    res = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                     claimed={"A": 57_600, "big": 94_464}))
    a_desc = describe(drafters["A"], "A")
    assert likely_convention(57_600, a_desc.params)[0] == "core"
    assert "small's published 57.6K most likely counts `core`" in res["claims"][0]
    assert "big's published 94.5K most likely counts `all`" in res["claims"][1]
    assert any("intermediate_size (128 vs 256)" in n for n in res["notes"])
    assert any("big was trained on 38.0x the tokens of small" in n for n in res["notes"])


def test_acceptance_same_prompts_report_and_png(drafters, tiny_llama_dir, tmp_path):
    paths = [str(drafters[k]) for k in ("A", "B", "B-specforge")]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), num_prompts=2,
                                     max_new=8, steps=2, out=tmp_path))
    runs = res["speed"]["drafters"]
    assert set(runs) == {"small", "big", "specforge"}
    for r in runs.values():
        assert len(r["position_rates"]) == 2 and 1.0 <= r["mean_accept_length"] <= 3.0
    # the same weights through the SpecForge reader behave identically
    assert runs["specforge"]["accepted"] == runs["big"]["accepted"]
    assert runs["specforge"]["accept_hist"] == runs["big"]["accept_hist"]
    md = (tmp_path / "compare.md").read_text()
    assert "## Acceptance on the same prompts" in md and "acceptance.png" in md
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    speed = json.loads((tmp_path / "compare.json").read_text())["speed"]
    assert (speed["prompts"], speed["device"], speed["dtype"]) == (2, "cpu", "float32")
    # a rerun into the same folder without --target measures nothing: no plot of the last run
    run_compare(CompareOptions(paths[:2], out=tmp_path))
    assert not (tmp_path / "acceptance.png").exists()
    assert "acceptance.png" not in (tmp_path / "compare.md").read_text()


def test_tree_acceptance_and_its_setting_in_the_report(drafters, tiny_llama_dir, tmp_path):
    """--topk/--num-draft-tokens: the drafters compared as a tree, as the engines draft, and the
    report says which drafting its acceptance was measured under."""
    paths = [str(drafters[k]) for k in ("A", "B")]
    opts = dict(target=str(tiny_llama_dir), num_prompts=2, max_new=8, steps=2)
    chain = run_compare(CompareOptions(paths, **opts))["speed"]
    res = run_compare(CompareOptions(paths, **opts, topk=3, num_draft_tokens=6, out=tmp_path))
    tree = res["speed"]
    assert (tree["topk"], tree["num_draft_tokens"], chain["num_draft_tokens"]) == (3, 6, 3)
    for k in ("small", "big"):
        t, c = tree["drafters"][k], chain["drafters"][k]
        assert 1.0 <= t["mean_accept_length"] <= 3.0
        assert t["new_tokens"] == c["new_tokens"]  # greedy: the same texts either way
    md = (tmp_path / "compare.md").read_text()
    assert "## Acceptance on the same prompts (2 chat prompts, tree 2/3/6)" in md
    with pytest.raises(DraftsmithError, match="num-draft-tokens"):
        CompareOptions(paths, topk=3)


def test_acceptance_on_the_prompts_bench_decodes(drafters, tiny_llama_dir, tmp_path, monkeypatch,
                                                 capsys):
    """compare measures the token ids `draftsmith bench` decodes for the same suite, system
    message included (a CPU compare predicts a GPU bench), and says when a suite is short."""
    import draftsmith.compare.speed as speed
    from draftsmith.bench.suites import suite_messages
    from draftsmith.targets import load_target

    seen = []
    real = speed.measure
    monkeypatch.setattr(speed, "measure", lambda m, d, prompts, *a: seen.append(prompts)
                        or real(m, d, prompts, *a))
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "system", "content": s},
                                                  {"role": "user", "content": u}]}) + "\n"
                         for s, u in [("Be terse.", "Name a prime."), ("Be kind.", "Say hi.")]))
    paths = [str(drafters["A"]), str(drafters["B"])]
    res = run_compare(CompareOptions(paths, target=str(tiny_llama_dir), prompts=str(f),
                                     num_prompts=5, max_new=4, steps=2))
    target = load_target(str(tiny_llama_dir))
    assert seen[0] == [target.chat_ids(m) for m in suite_messages(str(f), 5)]
    assert seen[0][0] != target.chat_ids([{"role": "user", "content": "Name a prime."}])
    assert (res["speed"]["suite"], res["speed"]["prompts"]) == ("mine", 2)
    assert "has 2 prompts with a user turn, fewer than --num-prompts 5" in capsys.readouterr().err


def test_cli(drafters):
    import typer
    from typer.testing import CliRunner

    from draftsmith.compare import compare

    app = typer.Typer()
    app.command()(compare)
    app.command("other")(lambda: None)
    res = CliRunner().invoke(app, ["compare", str(drafters["A"]), str(drafters["B-speculators"]),
                                   "--json", "--claimed", "A=60000"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [d["layout"] for d in out["drafters"]] == ["draftsmith", "speculators"]
    bad = CliRunner().invoke(app, ["compare", str(drafters["A"])])
    assert bad.exit_code != 0
    for flags in (["--device", "cpu"], ["--dtype", "float32"]):
        ignored = CliRunner().invoke(app, ["compare", str(drafters["A"]), str(drafters["B"]),
                                           *flags])
        assert isinstance(ignored.exception, DraftsmithError), ignored.output
        assert f"{flags[0]} set where acceptance is measured" in str(ignored.exception)


def test_counts_and_an_output_file_are_refused_by_their_flags_up_front(tmp_path):
    from draftsmith.compare import CompareOptions
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="--max-new-tokens must be >= 1, got 0"):
        CompareOptions(["a", "b"], max_new=0)
    (taken := tmp_path / "taken").write_text("x")
    with pytest.raises(DraftsmithError, match="--out .*taken: is a file, not a folder"):
        CompareOptions(["a", "b"], out=taken)
    assert taken.read_text() == "x"


@pytest.mark.parametrize("value", ["1.2.3", ".", "0", "1e400"])
def test_a_claimed_count_that_is_no_positive_number_is_refused_by_its_flag(value):
    with pytest.raises(DraftsmithError, match=f"--claimed 'A={value}'"):
        parse_claims([f"A={value}"])


def test_a_claim_names_the_folder_before_a_letter(drafters, tmp_path):
    """Folders named B and A, in that order: B=... is the folder B (the tables' header), not
    the second drafter."""
    import shutil

    b, a = tmp_path / "B", tmp_path / "A"
    shutil.copytree(drafters["B"], b)
    shutil.copytree(drafters["A"], a)
    res = run_compare(CompareOptions([str(b), str(a)], claimed={"B": 94_464}))
    assert res["claims"][0].startswith("B's published 94.5K most likely counts `all`")


@pytest.mark.parametrize("flag,kw", [("--steps", {"steps": 6}), ("--prompts", {"prompts": "x"}),
                                     ("--num-prompts", {"num_prompts": 2}),
                                     ("--topk", {"topk": 2, "num_draft_tokens": 4})])
def test_acceptance_flags_without_a_target_are_refused_not_ignored(flag, kw):
    with pytest.raises(DraftsmithError, match=f"{flag}.*needs --target"):
        CompareOptions(["a", "b"], **kw)
    CompareOptions(["a", "b"], target="t", **kw)


def test_acceptance_on_another_target_is_flagged_and_a_misfit_named(drafters, tmp_path):
    from conftest import write_tiny_folder

    other = write_tiny_folder(tmp_path / "other", "llama", seed=1)  # same shape, other weights
    paths = [str(drafters["A"]), str(drafters["B-specforge"])]
    res = run_compare(CompareOptions(paths, target=str(other), num_prompts=1, max_new=2,
                                     steps=1))
    flagged = [n for n in res["notes"] if "trained for target fingerprint" in n]
    assert len(flagged) == 1 and flagged[0].startswith("small was trained")
    shallow = write_tiny_folder(tmp_path / "shallow", "llama", num_hidden_layers=4)
    with pytest.raises(DraftsmithError, match="drafter small with this --target: aux layer"):
        run_compare(CompareOptions([str(drafters["B"]), str(drafters["A"])],
                                   target=str(shallow), num_prompts=1, max_new=2, steps=1))
