"""compare, tenth review: a gap between two drafters said with its uncertainty (their accept
lengths paired prompt by prompt), and the acceptance table naming how it decoded and on which
target, as the plot and compare.json do."""

from __future__ import annotations

import json
import math

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.compare.report import sections
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def measured(drafters, tiny_llama_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("cmp10")
    res = run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])],
                                     target=str(tiny_llama_dir), num_prompts=3, max_new=6,
                                     steps=2, out=out))
    return res, out


def test_a_noisy_gap_is_told_from_a_steady_one():
    """With few prompts, a gap that flips sign from prompt to prompt is noise; one every prompt
    shows is not. compare printed two means and nothing on their spread."""
    from draftsmith.compare.paired import paired, words

    noisy = paired("B", [2.0, 2.5, 1.8, 2.2], "A", [1.9, 2.6, 1.7, 2.3])
    half = 3.182 * math.sqrt(4 * 0.01 / 3 / 4)  # t(3) x the standard error of +-0.1
    assert noisy["prompts"] == 4 and noisy["mean_difference"] == pytest.approx(0.0)
    assert noisy["interval_95"] == pytest.approx([-half, half], abs=1e-3)
    assert noisy["beyond_noise"] is False
    assert words(noisy).endswith("(95%: -0.18 to +0.18, 4 prompts): within the noise: more "
                                 "prompts")
    steady = paired("B", [2.1, 2.62, 1.79, 2.41, None], "A", [2.0, 2.5, 1.7, 2.3, 2.0])
    assert steady["prompts"] == 4 and steady["beyond_noise"] is True  # the None prompt left out
    assert words(steady).startswith("+0.11 (95%: +0.") and words(steady).endswith("beyond the "
                                                                                  "noise")
    one = paired("B", [2.0], "A", [1.5])
    assert (one["mean_difference"], one["interval_95"], one["beyond_noise"]) == (0.5, None, None)


def test_each_prompt_is_kept_and_the_gap_is_paired_over_them(measured):
    """compare.json held each drafter's accept length pooled over all prompts only: nothing to
    tell whether big's lead over small is larger than the spread over prompts."""
    res, out = measured
    speed = res["speed"]
    small, big = (speed["drafters"][k]["per_prompt_accept_length"] for k in ("small", "big"))
    assert len(small) == len(big) == 3 and all(1.0 <= x <= 3.0 for x in small + big)
    (gap,) = speed["paired"]
    assert (gap["drafter"], gap["against"], gap["prompts"]) == ("big", "small", 3)
    gaps = [b - s for b, s in zip(big, small, strict=True)]
    assert gap["mean_difference"] == pytest.approx(sum(gaps) / 3)
    assert "paired" in speed["definitions"]
    assert json.loads((out / "compare.json").read_text())["speed"]["paired"] == [gap]
    from draftsmith.compare.paired import words

    row = ["accept length minus small's, paired over prompts", "(reference)", words(gap)]
    assert "| " + " | ".join(row) + " |" in (out / "compare.md").read_text()


def test_the_acceptance_table_names_its_decoding_and_target(measured, tiny_llama_dir):
    """The PNG's title said "greedy" and compare.md's context the target, but the acceptance
    table (all the terminal shows of them) said neither."""
    res, out = measured
    assert res["speed"]["decoding"] == "greedy"
    title = f"Acceptance on the same prompts (3 chat prompts, chain of 2 steps), greedy, " \
            f"target {res['context']['target']}"
    (shown,) = [t for t, _, _ in sections(res) if t.startswith("Acceptance")]
    assert shown.removesuffix(" · BUSY MACHINE (see the notes)") == title  # a busy CI machine
    assert f"## {title}" in (out / "compare.md").read_text()


def _sglang_ids(src, out, ids):
    import shutil

    folder = shutil.copytree(src, out)
    c = json.loads((folder / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(c))
    return folder


def test_engine_ids_naming_no_layer_are_said_in_the_users_numbers(drafters, tiny_llama_dir,  # noqa: F811
                                                                  tmp_path):
    """SGLang ids naming no layer of the target (first [-1, 2, 3], under the old first-id rule
    read as inputs; now [1, 2, 6], outputs, on every SGLang version): compare's run
    refused them as "aux layer ids [-2] out of range: canonical ids ...", a -2 the user never
    wrote (the doctor's older wording), while its own aux ids note already said how SGLang
    reads them."""
    sg = _sglang_ids(drafters["B-specforge"], tmp_path / "sg", [1, 2, 6])
    with pytest.raises(DraftsmithError) as e:
        run_compare(CompareOptions([str(drafters["A"]), str(sg)], target=str(tiny_llama_dir),
                                   num_prompts=1, max_new=2, steps=1))
    msg = str(e.value)
    assert msg.startswith(f"drafter sg with this --target: {sg / 'config.json'}: SGLang reads "
                          "[1, 2, 6] as the outputs of layers [1, 2, 6]: id 6 is out of range "
                          "for this target (6 layers: it would fail to load the drafter)")
    assert "[-2]" not in msg and "canonical ids" not in msg
    assert msg.endswith(f"(fix: `draftsmith doctor --drafter {sg}` names the ids to write)")


def test_an_unknown_target_depth_is_not_told_as_a_million_layers(drafters, tmp_path):  # noqa: F811
    """Without --target, ids [-2, 1, 2] were "out of range for this target (1000000 layers":
    the placeholder depth that skips the range check, shown as the target's."""
    from draftsmith.compare.describe import describe

    sg = _sglang_ids(drafters["B-specforge"], tmp_path / "sg", [-2, 1, 2])
    note = describe(sg, "sg").ids_note
    assert "1000000" not in note
    assert "id -2 is out of range for any target (it would fail to load the drafter)" in note
