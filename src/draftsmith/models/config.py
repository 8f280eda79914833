"""ModelConfig: the single source of truth for a Llama-family decoder's shape."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from draftsmith.errors import DraftsmithError

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # the layers the sliding window applies to where it is some only (Qwen2/3's
    # max_window_layers or layer_types); None: every layer, where there is a window
    window_layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED:
            raise DraftsmithError(
                f"unsupported architecture {self.arch!r}: draftsmith supports {sorted(SUPPORTED)}"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim")
        for name in sizes:
            if getattr(self, name) < 1:
                raise DraftsmithError(f"model config: {name} {getattr(self, name)} is not a size "
                                      "(at least 1)")
        if self.head_dim % 2:  # the rotary embedding turns pairs of a head's dims
            raise DraftsmithError(f"model config: head_dim {self.head_dim} is odd; RoPE needs an "
                                  "even head size")
        if self.window_layers is not None and (
                not self.sliding_window or not self.window_layers
                or not all(0 <= j < self.num_layers for j in self.window_layers)):
            raise DraftsmithError(f"model config: window_layers {self.window_layers} needs a "
                                  f"sliding_window and layers from 0 to {self.num_layers - 1}")
        if self.num_heads % self.num_kv_heads:
            raise DraftsmithError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json's fields (a missing or malformed one is named)."""
        if not isinstance(hf, dict):
            raise DraftsmithError(f"config.json holds a {type(hf).__name__}, not an object of "
                                  "model fields")
        try:
            return cls._from_hf(hf)
        except KeyError as e:
            raise DraftsmithError(f"config.json lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise DraftsmithError(f"config.json: a malformed field ({e})") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        arch = str(hf.get("model_type", "")).lower()
        if arch not in SUPPORTED:
            archs = hf.get("architectures") or [arch]
            raise DraftsmithError(
                f"unsupported architecture {archs[0]!r} (model_type {arch!r}): draftsmith "
                f"supports {sorted(SUPPORTED)}"
            )
        _check_mlp(hf, arch)
        _check_unquantized(hf)
        heads = int(hf["num_attention_heads"])
        if heads < 1:  # head_dim's default divides by it
            raise DraftsmithError(f"config.json: num_attention_heads {heads} is not a size (at "
                                  "least 1)")
        rope = _rope_fields(hf, arch)
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.get("eos_token_id")
        window, window_layers = _sliding_window(hf, arch, int(hf["num_hidden_layers"]))
        cfg = cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(_kv_heads(hf, arch, heads)),
            head_dim=int(hf.get("head_dim") or _default_head_dim(hf, arch, heads)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=_max_positions(hf, arch),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(hf, arch),
            qk_norm=arch == "qwen3",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            window_layers=window_layers,
        )
        if cfg.rope_scaling and rope_type in ("linear", "llama3"):
            try:  # a field these kinds need is named now, not at build
                cfg.inv_freq()
            except DraftsmithError as e:
                raise DraftsmithError(f"config.json: {e}") from None
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Its fields; window_layers only where set (a fingerprint of every other config stays
        as it was before the field)."""
        d = asdict(self)
        if d["window_layers"] is None:
            del d["window_layers"]
        return d

    def windowed(self, layer: int) -> bool:
        """Whether the sliding window applies to decoder layer `layer`."""
        return bool(self.sliding_window) and (self.window_layers is None
                                              or layer in self.window_layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(**d)

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies after the config's scaling (default, linear, llama3), in
        float32 as transformers, SGLang and vLLM compute them (double precision differed from
        them by an ulp in a third of them)."""
        dim = self.head_dim
        steps = torch.arange(0, dim, 2, device="cpu").float()  # cpu: models build on meta
        base = 1.0 / (self.rope_theta ** (steps / dim))
        scaling = self.rope_scaling
        if not scaling:
            return base.tolist()
        kind = scaling.get("rope_type", scaling.get("type", "default"))  # HF's reading
        if kind == "default":
            return base.tolist()
        if kind not in ("linear", "llama3"):
            raise DraftsmithError(
                f"unsupported rope scaling {kind!r}: supported default, linear, llama3"
            )
        try:  # a drafter's hand-edited rope_scaling reaches here without from_hf's checks
            if kind == "linear":
                return (base / float(scaling["factor"])).tolist()
            return _llama3_freqs(base, scaling).tolist()
        except KeyError as e:
            raise DraftsmithError(f"rope scaling {kind!r} lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise DraftsmithError(f"rope scaling {kind!r}: a malformed field ({e})") from None


# What transformers 5's config classes take for a field config.json leaves out, by family.
_KV_HEADS = {"qwen2": 32, "qwen3": 32, "mistral": 8}  # Llama's: num_attention_heads
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 4096 * 32}
_ORIGINAL = "original_max_position_embeddings"


def _kv_heads(hf: dict[str, Any], arch: str, heads: int) -> int:
    """A missing num_key_value_heads is the family's default; an explicit null is MHA."""
    if "num_key_value_heads" not in hf:
        return _KV_HEADS.get(arch, heads)
    return hf["num_key_value_heads"] or heads


def _max_positions(hf: dict[str, Any], arch: str) -> int:
    return int(hf.get("max_position_embeddings") or _MAX_POSITIONS[arch])


def _rope_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The RoPE fields as transformers 5 standardizes them: rope_scaling (transformers 4's key)
    over rope_parameters; llama3's original_max_position_embeddings from the top level over
    the dict's, else the dict's, else max_position_embeddings. Per-layer-type dicts and a
    partial_rotary_factor (which the engines apply and transformers ignores) refused."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise DraftsmithError(f"config.json: RoPE parameters {rope!r} are not an object")
    if any(isinstance(v, dict) for v in rope.values()):
        raise DraftsmithError("config.json: RoPE parameters per layer type "
                              f"({sorted(k for k, v in rope.items() if isinstance(v, dict))}) "
                              "are not supported")
    rope = dict(rope)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise DraftsmithError(f"config.json: partial_rotary_factor {partial} (RoPE over part of "
                              "each head) is not supported: transformers' Llama-family models "
                              "ignore it, SGLang and vLLM apply it")
    if rope.get("rope_type", rope.get("type")) == "llama3":
        if hf.get(_ORIGINAL) is not None:
            rope[_ORIGINAL] = hf[_ORIGINAL]
        rope.setdefault(_ORIGINAL, _max_positions(hf, arch))
    return rope


def _check_mlp(hf: dict[str, Any], arch: str) -> None:
    """HF's Llama alone reads mlp_bias (Qwen2/3 and Mistral ignore it); every family reads
    hidden_act, where draftsmith's MLP is silu's alone."""
    if arch == "llama" and hf.get("mlp_bias"):
        raise DraftsmithError("config.json: mlp_bias (biases on the MLP projections) is not "
                              "supported")
    act = hf.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise DraftsmithError(f"config.json: hidden_act {act!r} is not supported (draftsmith's "
                              "MLP is SwiGLU: silu)")


def _check_unquantized(hf: dict[str, Any]) -> None:
    """Quantized weights (FP8 with scales, GPTQ/AWQ packed ints) read as plain ones would be
    unscaled garbage or missing tensors: refused by the config that names them."""
    q = hf.get("quantization_config") or hf.get("compression_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise DraftsmithError(f"config.json: a quantized checkpoint (quant_method {method!r}) is "
                              "not supported; use the unquantized (bf16/fp16) model")


def _default_head_dim(hf: dict[str, Any], arch: str, heads: int) -> int:
    """HF's Qwen3 config defaults head_dim to 128; the other families to hidden / heads."""
    return 128 if arch == "qwen3" else int(hf["hidden_size"]) // heads


def _attention_bias(hf: dict[str, Any], arch: str) -> bool:
    """As HF builds each family: Qwen2 always biases q/k/v, Mistral never biases, Llama and
    Qwen3 follow attention_bias (a Qwen2 or Mistral config's attention_bias is ignored)."""
    if arch in ("qwen2", "mistral"):
        return arch == "qwen2"
    return bool(hf.get("attention_bias", False))


def _sliding_window(hf: dict[str, Any], arch: str, layers: int,
                    ) -> tuple[int | None, list[int] | None]:
    """The window and the layers it applies to (None: all). Mistral windows every layer;
    Qwen2/3 only under use_sliding_window, and only the layers from max_window_layers on, or
    those layer_types names sliding_attention (HF's layer_types). A config without the key
    windows 4096 tokens, HF's default in these three families."""
    window = hf.get("sliding_window", 4096)
    if window is None or arch == "mistral":
        return None if window is None else int(window), None
    if arch not in ("qwen2", "qwen3") or not hf.get("use_sliding_window"):
        return None, None
    first = int(hf.get("max_window_layers", 28))
    kinds = hf.get("layer_types") or (["full_attention"] * min(first, layers)
                                      + ["sliding_attention"] * max(0, layers - first))
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise DraftsmithError(f"config.json: layer_types must name full_attention or "
                              f"sliding_attention for each of its {layers} layers")
    windowed = [j for j, kind in enumerate(kinds) if kind == "sliding_attention"]
    if not windowed:
        return None, None
    return int(window), None if len(windowed) == layers else windowed


def _llama3_freqs(base: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3's smoothed scaling, in float32 step by step as transformers computes it."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old = float(s["original_max_position_embeddings"])
    low_wl, high_wl = old / low, old / high
    wl = 2 * math.pi / base
    scaled = torch.where(wl > low_wl, base / factor, base)
    smooth = (old / wl - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wl < high_wl) * ~(wl > low_wl)
    return torch.where(medium, smoothed, scaled)
