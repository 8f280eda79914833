"""compare, thirteenth review: the hidden files a compare killed midway (SIGKILL) left in its
--out cleared by the next run, a live run's left alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_compare import drafters  # noqa: F401  (the module's drafter folders)

from draftsmith.compare import CompareOptions, run_compare

REPORT = ["compare.json", "compare.md"]


def _dead_pid() -> int:
    """A process id that ran and is gone (reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def _run(drafters: dict[str, Path], out: Path) -> None:  # noqa: F811
    run_compare(CompareOptions([str(drafters["A"]), str(drafters["B"])], out=out))


def test_a_killed_runs_staged_files_are_cleared_by_the_next(drafters, tmp_path):  # noqa: F811
    """A compare killed while staging or moving in its report (SIGKILL, the OOM killer) left
    `.<pid>.compare.json` and set-aside `.<pid>.old.*` files that no later run removed."""
    out, pid = tmp_path / "out", _dead_pid()
    out.mkdir()
    left = [f".{pid}.compare.json", f".{pid}.acceptance.png", f".{pid}.old.compare.md"]
    for name in left:
        (out / name).write_text("from a killed run")
    _run(drafters, out)
    assert sorted(p.name for p in out.iterdir()) == REPORT


def test_a_live_runs_files_and_other_hidden_files_are_kept(drafters, tmp_path,  # noqa: F811
                                                            live_pid):
    """Only a dead process's staged report files go: another compare writing into the same
    folder, and hidden files that are no compare's, stay."""
    out, dead = tmp_path / "out", _dead_pid()
    out.mkdir()
    kept = [f".{live_pid}.compare.json", f".{live_pid}.old.compare.md", ".gitignore",
            f".{dead}.notes.txt", f".{'9' * 40}.compare.json", ".x.compare.json"]
    for name in kept:
        (out / name).write_text("keep")
    (out / f".{dead}.compare.md").mkdir()  # a folder is never a staged file
    _run(drafters, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*kept, f".{dead}.compare.md",
                                                            *REPORT])


def test_a_count_claimed_twice_for_one_name_is_refused():
    """`--claimed A=1e9 --claimed A=2e9` kept 2e9 and dropped 1e9 without a word."""
    from draftsmith.compare import parse_claims
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError) as e:
        parse_claims(["A=1e9", "B=5M", " A =2e9"])
    said = str(e.value)
    assert "\n" not in said and said.startswith("--claimed A given twice ('A=1e9', ' A =2e9')")
    assert parse_claims(["A=1e9", "B=1e9"]) == {"A": 1e9, "B": 1e9}


def test_one_drafter_claimed_by_its_letter_and_its_name_is_refused(drafters):  # noqa: F811
    """`--claimed A=1e9 --claimed small=2e9` named one drafter twice: two lines of its
    "published" count, each matched to a convention, neither said to be in conflict."""
    from draftsmith.errors import DraftsmithError

    opts = CompareOptions([str(drafters["A"]), str(drafters["B"])],
                          claimed={"A": 1e9, "small": 2e9})
    with pytest.raises(DraftsmithError) as e:
        run_compare(opts)
    said = str(e.value)
    assert "\n" not in said and said.startswith("--claimed A=... and --claimed small=... both "
                                                "name drafter small")


def test_a_claim_naming_no_drafter_is_refused_before_the_target_loads(drafters,  # noqa: F811
                                                                       tmp_path):
    """A typo in --claimed was refused only once --target had loaded (a GGUF's conversion,
    a fingerprint's hashing), though the drafters' names were known from the start."""
    from draftsmith.errors import DraftsmithError

    opts = CompareOptions([str(drafters["A"]), str(drafters["B"])], claimed={"C": 1e9},
                          target=str(tmp_path / "no-such-target"))
    with pytest.raises(DraftsmithError, match=r"^--claimed C=\.\.\.: no drafter called 'C'"):
        run_compare(opts)
