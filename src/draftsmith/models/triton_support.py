"""Whether draftsmith's Triton kernels can be defined here."""

from __future__ import annotations


def importable() -> bool:
    """Triton, and torch.library.triton_op (torch >= 2.6), import here."""
    try:
        import triton  # noqa: F401
        from torch.library import triton_op  # noqa: F401
    except ImportError:
        return False
    return True
