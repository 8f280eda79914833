"""compare, eleventh review: the paired interval checked by hand (past the t table too), a gap
of zero on every prompt told as no gap, tokens/s paired over prompts as accept length is, and
a drafter that does not fit the target refused before the target's weights are built."""

from __future__ import annotations

import json
import math

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)
from test_compare_review10 import measured  # noqa: F401  (the same measured run)

from draftsmith.compare import CompareOptions, run_compare
from draftsmith.compare.paired import paired, t975, words
from draftsmith.errors import DraftsmithError


def test_the_interval_is_the_hand_computed_student_t_one():
    """Gaps 1, 2, 3: mean 2, sample sd 1, se 1/sqrt(3), t(2) = 4.303."""
    p = paired("B", [3.0, 4.0, 5.0], "A", [2.0, 2.0, 2.0])
    half = 4.303 / math.sqrt(3)
    assert p["mean_difference"] == pytest.approx(2.0)
    assert p["standard_error"] == pytest.approx(1 / math.sqrt(3))
    assert p["interval_95"] == pytest.approx([2 - half, 2 + half])
    assert p["beyond_noise"] is False  # -0.48 to +4.48
    assert words(p) == "+2.00 (95%: -0.48 to +4.48, 3 prompts): within the noise: more prompts"


@pytest.mark.parametrize(("df", "table"), [(31, 2.0395), (35, 2.0301), (40, 2.0211),
                                           (60, 2.0003), (120, 1.9799), (1000, 1.9623)])
def test_past_the_table_t_is_the_t_distributions(df, table):
    """Past 31 prompts t975 was 1.96 + 2.4/df: 2.0374 for df 31 (the table's 2.0395), each
    interval a little too narrow; the Cornish-Fisher series gives the table's values."""
    assert t975(df) == pytest.approx(table, abs=1e-4)


def test_a_gap_of_zero_on_every_prompt_is_no_call_for_more_prompts():
    """The same drafter twice (greedy decoding is deterministic) gaps 0 on every prompt: the
    interval is 0 to 0, and "within the noise: more prompts" sent the user to measure more."""
    p = paired("A2", [2.0, 2.5, 1.75], "A", [2.0, 2.5, 1.75])
    assert (p["mean_difference"], p["interval_95"], p["beyond_noise"]) == (0.0, [0.0, 0.0],
                                                                            False)
    assert words(p) == "+0.00 (95%: +0.00 to +0.00, 3 prompts): the same on every prompt"
    steady = paired("B", [2.5, 3.0, 2.25], "A", [2.0, 2.5, 1.75])  # +0.5 on every prompt
    assert words(steady).endswith(": beyond the noise")




def test_tokens_per_s_is_paired_over_prompts_as_accept_length_is(measured):  # noqa: F811
    """tokens/s, the figure a busy machine skews most, was one pooled number per drafter: no
    way to tell a lead from the noise. Each prompt's is kept and paired against the first's."""
    res, out = measured
    speed = res["speed"]
    small, big = (speed["drafters"][k]["per_prompt_tokens_per_s"] for k in ("small", "big"))
    assert len(small) == len(big) == 3 and all(x > 0 for x in small + big)
    (gap,) = speed["paired_tokens_per_s"]
    assert (gap["drafter"], gap["against"], gap["prompts"]) == ("big", "small", 3)
    assert gap["mean_difference"] == pytest.approx(sum(b - s for b, s in zip(big, small,
                                                                               strict=True)) / 3)
    assert "paired_tokens_per_s" in speed["definitions"]
    assert json.loads((out / "compare.json").read_text())["speed"]["paired_tokens_per_s"] == [gap]
    row = ["tokens/s minus small's, paired over prompts", "(reference)", words(gap, ".1f")]
    assert "| " + " | ".join(row) + " |" in (out / "compare.md").read_text()


def test_a_misfit_drafter_is_refused_before_the_target_is_built(drafters, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """A drafter for a target of another vocab was named only once the target's weights were
    built (minutes for a real one); reading it needs the target's files, not its model."""
    from conftest import write_tiny_folder

    from draftsmith.targets import Target

    wide = write_tiny_folder(tmp_path / "wide", vocab_size=256)

    def built(*_a, **_k):
        raise AssertionError("the target was built before the drafters were read")

    monkeypatch.setattr(Target, "build", built)
    with pytest.raises(DraftsmithError, match="drafter specforge with this --target: .*embed"):
        run_compare(CompareOptions([str(drafters["A"]), str(drafters["B-specforge"])],
                                   target=str(wide), num_prompts=1, max_new=2, steps=1))


def test_a_rerun_that_cannot_finish_its_report_keeps_the_earlier_one(drafters, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    """A rerun whose compare.json failed to write (a full disk) had already written its
    compare.md over the earlier one: the folder's two reports then told two runs apart."""
    from pathlib import Path

    from draftsmith.compare import Unwritten

    out = tmp_path / "out"
    run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])], out=out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_text = Path.write_text

    def full(self, *a, **k):
        if self.name.endswith("compare.json"):
            raise OSError(28, "No space left on device")
        return write_text(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(Unwritten, match="No space left on device"):
        run_compare(CompareOptions([str(drafters["B"]), str(drafters["A"])], out=out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no half of it, no tmp
