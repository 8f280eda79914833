"""A drafter folder copied with its vocabulary head replaced by the int8 head's dequantized values
(`triton_head.quantize_head`: one fp32 scale a row), for an acceptance A/B on any device: the
greedy trees of this copy under the cuBLAS head are those of DRAFTSMITH_DRAFT_HEAD=triton-int8
over the original (`tests/test_triton_head_int8.py`), up to the dtype's rounding of the values.

Usage: python benchmarks/int8_head_copy.py SRC_DRAFTER DST_DRAFTER
then:  draftsmith compare SRC_DRAFTER DST_DRAFTER --target default --suite chat ...
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.models.triton_head import quantize_head

HEAD = "lm_head.weight"


def main(src: str, dst: str) -> None:
    if Path(dst).exists():
        sys.exit(f"{dst} exists: give a new folder")
    shutil.copytree(src, dst)
    path = Path(dst) / "model.safetensors"
    weights = load_file(path)
    w = weights[HEAD]
    q, scale = quantize_head(w)
    weights[HEAD] = (q.float() * scale[:, None]).to(w.dtype).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    err = (weights[HEAD].float() - w.float()).norm() / w.float().norm()
    print(f"{dst}: {HEAD} {tuple(w.shape)} {w.dtype} dequantized from int8, relative error "
          f"{float(err):.4f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with torch.no_grad():
        main(sys.argv[1], sys.argv[2])
