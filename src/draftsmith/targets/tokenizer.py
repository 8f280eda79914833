"""Tokenizer helpers: a tiny character tokenizer for tests and hashes of what the target reads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]


def write_byte_tokenizer(path: Path, vocab_size: int = 128) -> None:
    """A character-level HF tokenizer (printable ASCII + newline) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars[: vocab_size - len(SPECIALS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>", "</s>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)


def tokenizer_hash(tok) -> str:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def template_hash(tok) -> str:
    """The hash of the template prompts are rendered with: a tokenizer of several named
    templates (tokenizer_config.json's list form) renders with its "default" one."""
    return hashlib.sha256(chat_template(tok).encode()).hexdigest()[:16]


def chat_template(tok) -> str:
    """The template `apply_chat_template` renders with ("" for none); of several named ones, the
    "default", else all of them as JSON (transformers then asks for a name)."""
    t = tok.chat_template or ""
    if isinstance(t, dict):
        return t.get("default") or json.dumps(t, sort_keys=True)
    return t
