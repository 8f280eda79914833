"""Targets for tensor-parallel timing: the real default (or a checkpoint), or random weights of
a realistic shape built shard by shard on the rank's device (timing only, nothing loaded), and
a twin whose collectives do nothing, so a forward's compute can be timed alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.models.llama import Transformer
from draftsmith.models.parallel import TP

RANDOM_8B = ModelConfig(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = ModelConfig(
    arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=16,
)
RANDOM = {"random-8b": RANDOM_8B, "tiny": TINY}
TIMING_ONLY = "random weights: timing only"


class QuietTP(TP):
    """A rank's TP whose collectives do nothing but keep every shape: compute alone."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else torch.cat([x] * self.size, dim=-1)


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """'default', 'random-8b', 'tiny' (a small random Llama for CPU tests) or a checkpoint path."""

    name: str

    @property
    def random(self) -> bool:
        return self.name in RANDOM

    @property
    def label(self) -> str:
        if self.name == "random-8b":
            return f"random-8b (Llama-3-8B shape, {TIMING_ONLY})"
        return f"tiny ({TIMING_ONLY})" if self.name == "tiny" else self.name

    def config(self) -> ModelConfig:
        if self.random:
            return RANDOM[self.name]
        if Path(self.name).is_dir():  # its config.json: the sweep's parent needs no weights
            from draftsmith.targets.hf import read_config

            return ModelConfig.from_hf(read_config(Path(self.name)))
        from draftsmith.targets import load_target

        return load_target(self.name).cfg

    def build(self, tp: TP, dtype: torch.dtype) -> Transformer:
        if self.random:
            return random_model(RANDOM[self.name], tp, dtype)
        from draftsmith.targets import load_target

        return load_target(self.name).build(dtype, tp.device, tp)


def check_split(cfg: ModelConfig, size: int) -> str | None:
    """Why cfg cannot be split over size ranks, or None when it can."""
    return split_problem(split_dims(cfg), size)


def split_dims(cfg: ModelConfig) -> dict[str, int]:
    """The sizes tensor parallelism divides over its ranks (the vocabulary is padded instead)."""
    return {"attention heads": cfg.num_heads, "kv heads": cfg.num_kv_heads,
            "intermediate size": cfg.intermediate_size}


def split_problem(dims: dict[str, int], size: int) -> str | None:
    for what, n in dims.items():
        if n % size:
            return f"{n} {what} do not split over {size} ranks"
    return None


def source_split_dims(source: str) -> dict[str, int]:
    """`split_dims` of a target named as `--target` names it, read without its weights: a
    folder's config.json, a GGUF file's header ({} where the header lacks them: the ranks'
    own check then answers)."""
    from draftsmith.targets import default_gguf
    from draftsmith.targets.hf import read_config

    if source in RANDOM:
        return split_dims(RANDOM[source])
    path = default_gguf() if source in ("", "default") else Path(source)
    if not path.exists():
        raise DraftsmithError(f"{path}: no such file or folder")
    if path.is_dir():
        return split_dims(ModelConfig.from_hf(read_config(path)))
    return _gguf_split_dims(path) if path.suffix == ".gguf" else {}


def _gguf_split_dims(path: Path) -> dict[str, int]:
    from draftsmith.targets.gguf_file import architecture, field, reader

    rd = reader(path)
    arch = architecture(rd)
    got = {what: field(rd, f"{arch}.{key}") for what, key in (
        ("attention heads", "attention.head_count"), ("kv heads", "attention.head_count_kv"),
        ("intermediate size", "feed_forward_length"))}
    if got["kv heads"] is None:  # llama.cpp leaves it out where it equals the heads
        got["kv heads"] = got["attention heads"]
    if not all(isinstance(v, int) for v in got.values()):  # absent, or one a layer
        return {}
    return got


def refuse_split(source: str, size: int) -> None:
    """A target that cannot run over `size` ranks refused before they start (they would each
    load it first, then fail in `TP.split`)."""
    if size > 1 and (why := split_problem(source_split_dims(source), size)):
        raise DraftsmithError(f"--tp {size}: {why} (target {source})")


def _fill_random(module: torch.nn.Module, device: torch.device, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms (and any bias) stay neutral
            else:
                p.normal_(0.0, 0.02, generator=g)
            p.requires_grad_(False)


def random_model(cfg: ModelConfig, tp: TP, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """Built on meta, then only this rank's shards are allocated and filled on its device."""
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    model = model.to(dtype=dtype).to_empty(device=tp.device)
    _fill_random(model, tp.device, seed + tp.rank)
    model.inv_freq = torch.tensor(cfg.inv_freq(), device=tp.device, dtype=torch.float32)
    return model.eval()


def quiet_twin(model: Transformer) -> Transformer:
    """The same weights (shared, not copied) under a QuietTP: the forward without collectives."""
    tp = model.tp
    with torch.device("meta"):
        twin = Transformer(model.cfg, QuietTP(tp.rank, tp.size, None, tp.device))
    twin.load_state_dict(model.state_dict(), strict=True, assign=True)
    if model.lm_head.weight is model.embed.weight:
        twin.lm_head.weight = twin.embed.weight
    twin.inv_freq = model.inv_freq
    return twin.eval()


def random_drafter_on(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                      seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for cfg, replicated (not sharded) as under TP, built on the
    device; its own embedding, since a sharded target's cannot be shared."""
    if cfg.num_layers < 2:
        raise DraftsmithError("a drafter needs a target of at least 2 layers")
    dcfg = Eagle3Config.for_target(cfg, min(cfg.vocab_size, 32000),
                                   default_aux_layers(cfg.num_layers))
    with torch.device("meta"):
        d = Eagle3Drafter(dcfg)
    d = d.to(dtype=dtype).to_empty(device=device)
    _fill_random(d, device, seed)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
    t2d[: dcfg.draft_vocab_size] = True
    d.set_vocab(torch.zeros(dcfg.draft_vocab_size, dtype=torch.long, device=device), t2d)
    d.inv_freq = torch.tensor(d.lc.inv_freq(), device=device)
    return d.eval()
