"""Tune, seventeenth review: tune's SGLang and vLLM lines were flags only, naming no target;
export's were whole commands. Both now come from one `launch_command`, tune's naming the folder
the engines serve (`targets.served_folder`)."""

from __future__ import annotations

import shlex

import torch
from test_tune_cli import _tiny_pair
from test_tune_review9 import _chain_choice

from draftsmith.tune.cost_model import Measurement, SpecSetting, recommend
from draftsmith.tune.flags import (
    UNNAMED,
    export_paths,
    launch_command,
    recommendation_text,
    sglang_flags,
    vllm_flags,
)


def test_a_choice_names_the_whole_commands_serving_its_target():
    rec, target = _chain_choice(), "/models/my target"
    text = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"), target=target)
    sg, sp = export_paths("runs/d")["sglang"], export_paths("runs/d")["speculators"]
    head = f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
    assert f"  SGLang command: {head}{sglang_flags(rec.setting, sg)}" in text.splitlines()
    assert (f"  vLLM command:   vllm serve {shlex.quote(target)} {vllm_flags(rec.setting, sp)}"
            in text.splitlines())
    # the flag lines stay as they were, and without a target there are no command lines
    bare = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"))
    assert "command" not in bare and set(bare.splitlines()) <= set(text.splitlines())


def test_an_unknown_target_is_the_stand_in_and_says_what_goes_there():
    text = recommendation_text(_chain_choice(), "runs/d", target="")
    assert f"--model-path {UNNAMED} --speculative-algorithm EAGLE3" in text
    assert f"vllm serve {UNNAMED} --speculative-config" in text
    assert f"\n  {UNNAMED}: the target model's folder" in text


def test_no_speculation_serves_the_target_plainly_with_its_tp_size():
    (rec,) = recommend([], [Measurement(SpecSetting.baseline(), 1, 200.0),
                            Measurement(SpecSetting(3), 1, 150.0, accept_length=2.5)])
    assert not rec.speculate
    text = recommendation_text(rec, "runs/d", tp=2, target="/t")
    assert "  SGLang command: python -m sglang.launch_server --model-path /t --tp-size 2" in text
    assert "  vLLM command:   vllm serve /t --tensor-parallel-size 2" in text.splitlines()
    assert "speculative" not in " ".join(li for li in text.splitlines() if "command" in li)
    one = recommendation_text(rec, "runs/d", tp=1, target="/t")
    assert "  vLLM command:   vllm serve /t" in one.splitlines()


def test_export_and_tune_build_the_same_command():
    from draftsmith.export.cli import _serve_hint

    config = {"draftsmith": {"aux_layer_ids_canonical": [1, 2, 3]},
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}}
    hint = _serve_hint("sglang", "/out", config, 3, "/t")
    flags = hint.splitlines()[1].removeprefix("SGLang: ")
    assert f"SGLang command: {launch_command('sglang', '/t', flags)}" in hint.splitlines()


def test_tune_names_the_folder_the_engines_serve(tmp_path):
    from draftsmith.targets import load_target, served_folder
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 4, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=1, max_draft=2)
    served = served_folder(load_target(str(folder)))
    assert served == str(folder.resolve())
    commands = [li for t in report["texts"] for li in t.splitlines() if "command:" in li]
    assert len(commands) == 2 and all(f" {shlex.quote(served)}" in c for c in commands)
