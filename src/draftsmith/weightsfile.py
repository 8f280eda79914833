"""Reading one weights file (a target's shard or a drafter's) with one set of errors."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError


def read_weights_file(path: Path, device: str | torch.device = "cpu",
                      ) -> dict[str, torch.Tensor]:
    """The tensors of one .safetensors (or PyTorch .bin) weights file; one that cannot be read is
    named (cut short by a kill, a full disk or a download, or a Git LFS pointer)."""
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    safetensors = path.suffix == ".safetensors"
    try:
        if safetensors:
            return load_file(str(path), device=str(device))
        return torch.load(path, map_location=device, weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, OSError,
            ValueError) as e:
        why = " ".join(str(e).split())[:300]  # torch's message spans lines
        kind = "safetensors" if safetensors else "PyTorch"
        raise DraftsmithError(f"{path}: cannot read its weights ({kind} file: {why}); a file cut "
                              "short, or a Git LFS pointer?") from None
