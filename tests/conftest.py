"""Tiny random targets of each supported family, written as real HF checkpoint folders."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

# Tiny models on 2 cores: one thread avoids OpenMP barrier stalls (20x slower under load).
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter; it must be on before anything
# imports triton (the engine's modules do).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_hf_config(arch: str, **over):
    import transformers as tf

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    common.update(over)
    cls = {
        "llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
        "mistral": tf.MistralConfig,
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    return cls(**common)


def tiny_hf_model(arch: str = "llama", seed: int = 0, **over):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **over)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():  # random norms and biases too, so a wrong wiring shows
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.float().eval()


def write_tiny_folder(path: Path, arch: str = "llama", seed: int = 0, **over) -> Path:
    from draftsmith.targets.tokenizer import write_byte_tokenizer

    model = tiny_hf_model(arch, seed, **over)
    model.save_pretrained(path)
    write_byte_tokenizer(path, vocab_size=model.config.vocab_size)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def train_root(tmp_path_factory, tiny_llama_dir) -> Path:
    """A folder of a captured dataset of 24 samples (`data/`) and the tiny llama (`target`),
    one a test module, for training tests."""
    from test_train_helpers import write_dataset

    from draftsmith.targets import load_target

    root = tmp_path_factory.mktemp("train_root")
    write_dataset(root / "data", load_target(tiny_llama_dir), n=24)
    (root / "target").symlink_to(tiny_llama_dir)
    return root


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    """The tiny llama as a `Target` (a module may define its own `target` instead)."""
    from draftsmith.targets import load_target

    return load_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def model(target):
    return target.build(torch.float32)


# A script's head that makes Triton compile for an sm_90 GPU where there is none: the driver
# only names the target (`compile_for_hopper` runs the rest after it, Triton's interpreter off).
HOPPER_PREAMBLE = """
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

hopper = GPUTarget("cuda", 90, 32)


class Hopper:
    def get_current_target(self):
        return hopper


importlib.import_module("triton.runtime.driver").driver.set_active(Hopper())
"""


def compile_for_hopper(body: str) -> None:
    """Runs HOPPER_PREAMBLE + body in a fresh Python without the interpreter and asserts it
    printed "compiled"; skips where this Triton cannot compile for a GPU."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", HOPPER_PREAMBLE + body], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode and "ImportError" in r.stderr and "draftsmith" not in r.stderr:
        pytest.skip(f"this Triton cannot compile for a GPU here: {r.stderr[-300:]}")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def count_compiled_calls(monkeypatch, owner, name: str, when) -> torch.Tensor:
    """Wrap `owner.name` so that each run, inside compiled code, of a call for which
    `when(*args)` holds bumps the returned CUDA counter. The counter lives in the graph and adds
    no guard; a Python list that traced code appended to made dynamo guard on it and recompile
    every captured shape up to its limit (H200 runs 10 and 11)."""
    hits = torch.zeros((), device="cuda")
    plain = getattr(owner, name)

    def counted(*a, **kw):
        if torch.compiler.is_compiling() and when(*a, **kw):
            hits.add_(1)
        return plain(*a, **kw)

    monkeypatch.setattr(owner, name, counted)
    return hits


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    # Every GPU test compiles its own tiny models; dynamo's recompile limit counts across tests.
    if request.node.get_closest_marker("gpu"):
        torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_raises():
    # A suite started in the background of a non-interactive shell (nohup, `make test &`)
    # inherits SIGINT ignored, as draftsmith then keeps it; the ctrl-C tests model a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
