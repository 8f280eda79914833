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


CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # printable ASCII and newline


def write_byte_tokenizer(path: Path, vocab_size: int = 128) -> None:
    """A character-level HF tokenizer (printable ASCII + newline) with a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS[: vocab_size - len(SPECIALS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    save_chatml(tok, path)


def save_chatml(tok, path: Path) -> None:
    """`tok` (a `tokenizers.Tokenizer` whose vocabulary starts with SPECIALS) saved as an HF
    tokenizer with those special tokens and the ChatML template."""
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>", "</s>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(path)


# The tokens llama.cpp ends generation at by their text (llama-vocab.cpp's `special_eog_ids`),
# whatever the metadata names, as of the families draftsmith reads (o200k_harmony's, Gemma's and
# Kimi's left out); and the first FIM pad, repo and file-separator token, unless named.
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})
FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def eog_ids(vocab: dict[str, int], named: dict[str, int | None] | None = None) -> list[int]:
    """The end-of-generation ids llama.cpp takes from a vocabulary (text -> id) beside the EOS:
    those of `EOG_TEXTS`, the ids `named` gives (eot, eom, fim_pad, fim_rep, fim_sep), and for
    each FIM kind it names none of, the lowest id among its texts."""
    named = named or {}
    ids = {i for text, i in vocab.items() if text in EOG_TEXTS}
    ids |= {i for i in named.values() if i is not None}
    for kind, texts in FIM_TEXTS.items():
        found = [vocab[t] for t in texts if t in vocab]
        if named.get(kind) is None and found:
            ids.add(min(found))
    return sorted(ids)


def special_eog_ids(tok) -> list[int]:
    """The `EOG_TEXTS` among an HF tokenizer's special tokens (added ones marked special):
    Llama 3's <|eot_id|>, ChatML's <|im_end|>, Gemma's <end_of_turn> where no config lists them
    (the FIM ones, which a config may name otherwise, a converted GGUF's own list holds)."""
    added = getattr(tok, "added_tokens_decoder", None) or {}
    return sorted(int(i) for i, t in added.items()
                  if getattr(t, "special", False) and str(t) in EOG_TEXTS)


def tokenizer_hash(tok) -> str:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


# Text whose ids show how a tokenizer splits, beyond its vocabulary: digit runs after spaces and
# in numbers (SmolLM2's Digits split), space runs, indentation, contractions, case, accents in
# composed and decomposed form, full-width and ligature forms (NFKC), CJK and emoji. No special
# token's text: how plain text holding one splits is the kind of thing library versions change,
# and a refusal over it would stop data that tokenizes alike.
PROBE = ("Hello, World!  x  1 12345 3.14159 1,000,000 -42 2024-01-02 0x1F v1.2.3\n\n"
         "\tdef f(x):\n        return x**2  # It's I'M you'll WE'VE\r\n"
         "caf\u00e9 cafe\u0301 \uff21\uff22\uff23 \ufb01 \u2460 \u00a0 \u3000 "
         "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587 "
         "\ud55c\uad6d\uc5b4 \U0001f600\U0001f44d\U0001f3fd   end   ")


def tokenization_hash(tok) -> str:
    """How a tokenizer splits text, by the ids it gives `PROBE` (as capture encodes: no special
    tokens added): two tokenizers of one vocabulary (`tokenizer_hash`, which the fingerprint
    reads) that normalize or pre-tokenize otherwise differ here, so data tokenized one way is
    told from the other's; by behaviour, not by tokenizer.json's text, which versions of
    `tokenizers` write differently."""
    ids = tok(PROBE, add_special_tokens=False)["input_ids"]
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


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
