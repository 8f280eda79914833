"""Read a GGUF file with the `gguf` package: dequantized tensors in HF names, config, tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith.errors import DraftsmithError

_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias)$")


def reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a bad file
        raise DraftsmithError(f"{path}: not a readable GGUF file ({e})") from None


def hf_name(name: str) -> str | None:
    m = _NAME.match(name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if layer is None:
        return f"{_TOP[part]}.{kind}" if part in _TOP else None
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}" if part in _BLOCK else None


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp interleaves the rotary halves of q/k rows for the llama architecture.
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_tensors(path: Path, arch: str, heads: int, kv_heads: int,
                 rd: Any = None) -> dict[str, torch.Tensor]:
    """The tensors in HF names, dequantized; `rd`: a reader of `path` already open (a parse of
    the default target's metadata takes seconds)."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in (rd if rd is not None else reader(path)).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise DraftsmithError(
                f"{path}: tensor {t.name} uses quantization type {t.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        w = torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = unpermute(w, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = unpermute(w, kv_heads)
        out[name] = w
    return out


def hf_config_and_tokenizer(path: Path):
    from transformers import AutoConfig, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF reader raises many kinds
        raise DraftsmithError(f"{path}: cannot read config/tokenizer from GGUF ({e})") from None
    return cfg.to_dict(), tok
