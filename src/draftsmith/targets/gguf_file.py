"""Read a GGUF file with the `gguf` package: dequantized tensors in HF names, config, tokenizer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
        why = " ".join(str(e).split())[:200]
        fix = _newer_type(e) or _damage(path)
        raise DraftsmithError(f"{path}: not a readable GGUF file ({why}); {fix}") from None


def _newer_type(e: Exception) -> str | None:
    """A tensor type id the gguf package has no name for (a quantization newer than it): the
    file is whole, so fetching it again, as for a damaged one, cannot help."""
    if not (isinstance(e, ValueError) and "GGMLQuantizationType" in str(e)):
        return None
    from importlib import metadata

    return (f"a tensor type the installed gguf package ({metadata.version('gguf')}) does not "
            "know: upgrade it (pip install -U gguf), or use another quantization of the model")


def _damage(path: Path) -> str:
    """What a GGUF the reader refuses most likely is: not GGUF at all, or one cut short."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"it cannot be opened: {e.strerror}"
    if magic != b"GGUF":
        return "it does not begin with GGUF's magic bytes: is it a GGUF file?"
    return "cut short or damaged (an interrupted download or copy?): fetch it again"


# llama.cpp's names of the architectures draftsmith reads (a Mistral's GGUF is "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_architecture(rd: Any, path: Path) -> None:
    """A GGUF of another family refused by its name before transformers reads it (whose errors
    name a missing tokenizer field or say "not supported yet")."""
    arch = architecture(rd)
    if arch not in ARCHITECTURES:
        raise DraftsmithError(f"{path}: a GGUF of architecture {arch or 'unnamed'!r}; draftsmith "
                              f"reads Llama-family GGUFs ({', '.join(ARCHITECTURES)})")


def hf_name(name: str) -> str | None:
    m = _NAME.match(name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if layer is None:
        return f"{_TOP[part]}.{kind}" if part in _TOP else None
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}" if part in _BLOCK else None


def field(rd: Any, key: str) -> Any:
    f = rd.get_field(key)
    return None if f is None else f.contents()


def architecture(rd: Any) -> str:
    """llama.cpp's name of the file's architecture (a Mistral model is "llama" there)."""
    return str(field(rd, "general.architecture") or "")


def check_whole(rd: Any, path: Path) -> None:
    """A file of a split GGUF (llama.cpp's gguf-split) holds some layers only."""
    count = field(rd, "split.count")
    if count is not None and int(count) > 1:
        raise DraftsmithError(f"{path}: one file of a GGUF split in {int(count)}; merge them "
                              "first (llama-gguf-split --merge FIRST-FILE OUT.gguf)")


def end_of_turn_ids(rd: Any) -> list[int]:
    """The ids llama.cpp ends generation at beside the EOS: the end-of-turn, end-of-message and
    FIM ids the metadata names, and the tokens it recognises by their text (`eog_ids`)."""
    from draftsmith.targets.tokenizer import eog_ids

    tokens = field(rd, "tokenizer.ggml.tokens") or []
    named = {k: field(rd, f"tokenizer.ggml.{k}_token_id") for k in NAMED_EOG}
    vocab = {str(text): i for i, text in enumerate(tokens)}  # a repeated text: its last id
    ids = eog_ids(vocab, {k: None if v is None else int(v) for k, v in named.items()})
    return [i for i in ids if not tokens or i < len(tokens)]  # llama.cpp drops one past them


NAMED_EOG = ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def complete_config(rd: Any, hf_cfg: dict[str, Any], path: Path) -> None:
    """What transformers' GGUF reader leaves out of the config: the head size (it keeps Qwen3's
    default of 128), RoPE scaling (`rope.scaling.*` keys, or Llama 3's `rope_freqs` tensor) and
    the sliding window (it gives a Mistral its config's default of 4096, where llama.cpp, which
    reads Mistral as llama, windows none)."""
    arch = architecture(rd)
    if (k := field(rd, f"{arch}.attention.key_length")) is not None:
        hf_cfg["head_dim"] = int(k)
    if hf_cfg.get("model_type") == "mistral":
        window = field(rd, f"{arch}.attention.sliding_window")
        hf_cfg["sliding_window"] = None if window is None else int(window)
    if hf_cfg.get("model_type") == "llama" and _has_attention_bias(rd):
        hf_cfg["attention_bias"] = True  # llama.cpp's optional bq/bk/bv/bo; HF's reader drops
    scaling = _rope_scaling(rd, arch, hf_cfg, path)
    if scaling:
        key = "rope_parameters" if hf_cfg.get("rope_parameters") else "rope_scaling"
        hf_cfg[key] = {**(hf_cfg.get(key) or {}), **scaling}


# llama.cpp's attention tensors a llama GGUF may bias, each optional
_BIASED = frozenset({"attn_q", "attn_k", "attn_v", "attn_output"})


def _has_attention_bias(rd: Any) -> bool:
    return any(len(p := t.name.split(".")) == 4 and p[0] == "blk" and p[2] in _BIASED
               and p[3] == "bias" for t in rd.tensors)


def with_zero_biases(tensors: Iterable[tuple[str, torch.Tensor]], cfg: Any,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, then zeros for the attention biases a biased llama GGUF leaves out (a Qwen2
    written as llama: q/k/v alone): llama.cpp takes each of bq/bk/bv/bo as optional, where
    HF's Llama and the engines build all four under attention_bias; a zero bias adds nothing."""
    seen, dtype = set(), torch.float32
    for name, w in tensors:
        seen.add(name)
        if name.endswith("_proj.bias"):
            dtype = w.dtype  # the file's own float type
        yield name, w
    if cfg.arch != "llama" or not cfg.attention_bias:
        return
    kv = cfg.num_kv_heads * cfg.head_dim
    sizes = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": kv, "v_proj": kv,
             "o_proj": cfg.hidden_size}
    for i in range(cfg.num_layers):
        for proj, size in sizes.items():
            if (name := f"model.layers.{i}.self_attn.{proj}.bias") not in seen:
                yield name, torch.zeros(size, dtype=dtype)


def _rope_scaling(rd: Any, arch: str, hf_cfg: dict[str, Any], path: Path) -> dict | None:
    from gguf.quants import dequantize

    kind = field(rd, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        return {"rope_type": kind, "factor": float(field(rd, f"{arch}.rope.scaling.factor") or 1)}
    t = next((t for t in rd.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    factors = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
    return _llama3_scaling(factors, hf_cfg, path)


def _llama3_scaling(factors: np.ndarray, hf_cfg: dict[str, Any], path: Path) -> dict:
    """llama.cpp keeps Llama 3's scaling only as per-frequency divisors; every Llama 3.x release
    scales with low 1, high 4 over 8192 positions, so those are checked against the divisors."""
    from dataclasses import replace

    from draftsmith.models.config import ModelConfig

    cfg = ModelConfig.from_hf(hf_cfg)
    guess = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    want = np.array(cfg.inv_freq()) / factors if len(factors) == cfg.head_dim // 2 else None
    got = np.array(replace(cfg, rope_scaling=guess).inv_freq())
    if want is None or not np.allclose(got, want, rtol=1e-5, atol=0):
        raise DraftsmithError(f"{path}: its rope_freqs tensor matches no Llama 3 RoPE scaling "
                              "that draftsmith reads; load the model's HF folder instead")
    return guess


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp interleaves the rotary halves of q/k rows for the llama architecture.
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_tensors(path: Path, arch: str, heads: int, kv_heads: int,
                 rd: Any = None) -> dict[str, torch.Tensor]:
    """The tensors in HF names, dequantized (`iter_tensors`); `rd`: a reader of `path` already
    open (a parse of the default target's metadata takes seconds)."""
    return dict(iter_tensors(path, arch, heads, kv_heads, rd))


def iter_tensors(path: Path, arch: str, heads: int, kv_heads: int, rd: Any = None,
                 skip: set[str] | frozenset[str] = frozenset(),
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time, each in the file's own float type (F32, F16, BF16) or,
    quantized, dequantized to float32; q/k (weights and biases) un-permuted for the llama
    architecture."""
    for t in (rd if rd is not None else reader(path)).tensors:
        name = hf_name(t.name)
        if name is None or name in skip:
            continue
        w = _tensor(t, path)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, heads)  # llama.cpp's converter permutes the biases as the weights
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, kv_heads)
        yield name, w


def _tensor(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as a writable torch tensor of its shape (a copy of the mapped file)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(reversed([int(d) for d in t.shape]))
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    if t.tensor_type == Q.BF16:
        raw = np.array(t.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise DraftsmithError(
            f"{path}: tensor {t.name} uses quantization type {t.tensor_type.name}, "
            "which the gguf package cannot dequantize; use another quantization of the model "
            "(F16, Q8_0, a K-quant) or its HF folder"
        ) from None
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)


def hf_config_and_tokenizer(path: Path, rd: Any = None):
    from transformers import AutoConfig, AutoTokenizer

    rd = rd if rd is not None else reader(path)
    check_tokenizer(rd, path)
    try:
        with _alone(path) as (folder, name):
            cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF reader raises many kinds
        why = " ".join(str(e).split())  # its messages may span lines
        raise DraftsmithError(f"{path}: cannot read config/tokenizer from GGUF ({why})") from None
    split_digits(tok, rd)
    return with_architecture(cfg.to_dict()), tok


@contextmanager
def _alone(path: Path) -> Iterator[tuple[str, str]]:
    """`path` linked alone into a scratch folder: transformers reads the tokenizer.json and
    tokenizer_config.json beside a GGUF before the GGUF's vocabulary, and llama.cpp's converter
    writes its GGUF into the HF folder it reads (another model's files may lie there too)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as scratch:
        (Path(scratch) / path.name).symlink_to(path.resolve())
        yield scratch, path.name


def check_tokenizer(rd: Any, path: Path) -> None:
    """A GGUF without its vocabulary (llama.cpp runs it given another's): transformers' error
    says "stating tokenizer None"."""
    if not field(rd, "tokenizer.ggml.model") or rd.get_field("tokenizer.ggml.tokens") is None:
        raise DraftsmithError(f"{path}: the GGUF holds no tokenizer (no tokenizer.ggml.model or "
                              "tokenizer.ggml.tokens), which draftsmith needs to prompt the "
                              "target; use a GGUF converted with its tokenizer, or the model's "
                              "HF folder")


# llama.cpp's pre-tokenizers that isolate every digit before GPT-2's split (llama-vocab.cpp);
# their HF tokenizers (SmolLM2's, StarCoder's) run Digits(individual) before ByteLevel
DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                        "minerva-7b"})


def split_digits(tok: Any, rd: Any) -> None:
    """transformers' GGUF reader gives these vocabularies GPT-2's split alone, which reads
    "x  1" as "x", " ", " 1" (Ġ Ġ 1) where the model's own tokenizer and llama.cpp read
    "x", "  ", "1" (ĠĠ 1): whitespace before digits, as in indented lists, tokenized unlike
    training."""
    if field(rd, "tokenizer.ggml.model") != "gpt2" or \
            field(rd, "tokenizer.ggml.pre") not in DIGIT_PRES:
        return
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def with_architecture(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """`architectures` named as transformers names the model type's causal LM (its GGUF reader
    leaves it null): engines (vLLM, SGLang, a speculators verifier) pick the model class by it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_cfg.get("model_type"))
    if not hf_cfg.get("architectures") and name:
        hf_cfg["architectures"] = [name]
    return hf_cfg
