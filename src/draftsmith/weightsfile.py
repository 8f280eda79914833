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
        return _state_dict(torch.load(path, map_location=device, weights_only=True), path)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, OSError,
            ValueError) as e:
        why = " ".join(str(e).split())[:300]  # torch's message spans lines
        kind = "safetensors" if safetensors else "PyTorch"
        raise DraftsmithError(f"{path}: cannot read its weights ({kind} file: {why}); a file cut "
                              "short, or a Git LFS pointer?") from None


def _state_dict(state: object, path: Path) -> dict[str, torch.Tensor]:
    """A pickle's contents checked to be a flat state dict (tensor name -> tensor): a training
    checkpoint ({"model": ..., "step": ...}) or a list otherwise fails later as a traceback."""
    if isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                       for k, v in state.items()):
        return state
    if isinstance(state, dict):
        odd = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))[:3]
        what = f"a dict whose entries {odd} are not tensors"
    else:
        what = f"a {type(state).__name__}"
    raise DraftsmithError(f"{path}: holds {what}, not a state dict of tensor names to tensors; "
                          "save the model's state_dict() alone")
