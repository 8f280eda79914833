"""Answers the built-in engine decoded train on its own ids, not their text tokenized again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.chat import AnswerTally, assistant_spans, span_mask
from draftsmith.data.prompts import Conversation, encode_conversation, encode_conversations
from draftsmith.data.shards import Dataset
from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import CHARS, SPECIALS, save_chatml

CFG = CaptureConfig(batch_size=2, max_len=256, samples_per_shard=4)
QUIET = {"progress": False, "log": lambda s: None}


def write_bpe_tokenizer(path: Path, merges: list[tuple[str, str]]) -> None:
    """The byte tokenizer's characters plus the `merges` (so "ab" is one token and "a", "b"
    a split of it that BPE never makes), with the ChatML template."""
    from tokenizers import Tokenizer, models

    pieces = SPECIALS + CHARS + [a + b for a, b in merges]
    vocab = {t: i for i, t in enumerate(pieces)}
    save_chatml(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>")), path)


@pytest.fixture(scope="module")
def bpe_target(tmp_path_factory, tiny_llama_dir):
    """The tiny llama's weights with `write_bpe_tokenizer`'s tokenizer ("\nq" one token too)."""
    path = tmp_path_factory.mktemp("bpe_llama")
    for f in tiny_llama_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            (path / f.name).symlink_to(f)
    write_bpe_tokenizer(path, [("a", "b"), ("\n", "q")])
    return load_target(path)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def answered(messages: list[dict], answers: list[dict]) -> Conversation:
    return Conversation(messages, meta={"prompt_id": "p", "answers": answers})


def text_path(tok, conv: Conversation) -> tuple[list[int], list[bool]]:
    """The encoding before recorded ids were taken: the rendered text tokenized, its mask."""
    text, spans = assistant_spans(tok, conv.messages, conv.cut_turns())
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), span_mask(enc["offset_mapping"], spans)


def loss_ids(ids, mask) -> list[int]:
    return [int(i) for i, m in zip(ids, mask, strict=True) if m]


def test_a_non_canonical_split_is_captured_as_the_recorded_ids(bpe_target, tmp_path):
    tok = bpe_target.tokenizer
    split = ids_of(tok, "c") + ids_of(tok, "a") + ids_of(tok, "b")
    assert len(ids_of(tok, "cab")) == 2 and tok.decode(split) == "cab"  # BPE: "c", "ab"
    conv = answered([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "cab"}],
                    [{"turn": 0, "tokens": 3, "finish": "stop", "ids": split}])
    m = capture(bpe_target, [conv], tmp_path, CFG, **QUIET)
    ids, mask = Dataset(tmp_path).tokens(0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert loss_ids(ids, mask) == split + [end]  # the ids and the closing marker trained
    prefix = ids_of(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.tolist() == prefix + split + ids_of(tok, "<|im_end|>\n")
    assert m["input"]["answers"] == {"target_ids": 1, "text": 0, "fallback": 0}
    # without ids the same answer is its text's two tokens, as before
    plain = Conversation(conv.messages, meta={"answers": [{"turn": 0, "finish": "stop"}]})
    assert loss_ids(*encode_conversation(tok, plain)) == ids_of(tok, "cab") + [end]


def test_an_answer_without_ids_encodes_exactly_as_before(bpe_target, target):
    for tok in (bpe_target.tokenizer, target.tokenizer):
        conv = answered([{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "ab?"},
                         {"role": "assistant", "content": "abab cut here"},
                         {"role": "user", "content": "more"},
                         {"role": "assistant", "content": "ab"}],
                        [{"turn": 0, "tokens": 9, "finish": "length"},
                         {"turn": 1, "tokens": 1, "finish": "stop"}])
        tally = AnswerTally()
        assert encode_conversation(tok, conv, tally) == text_path(tok, conv)
        assert tally.as_dict() == {"target_ids": 0, "text": 2, "fallback": 0}
        many = list(encode_conversations(tok, [conv, Conversation(conv.messages)], "f"))
        assert many == [text_path(tok, conv), text_path(tok, Conversation(conv.messages))]


def test_ids_on_some_turns_of_a_multi_turn_conversation(bpe_target):
    tok = bpe_target.tokenizer
    a, b = ids_of(tok, "a"), ids_of(tok, "b")
    msgs = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "abab"},
            {"role": "user", "content": "two"}, {"role": "assistant", "content": "ab x"}]
    second = a + b + ids_of(tok, " x")  # cut at max tokens: no closing marker trained
    conv = answered(msgs, [{"turn": 0, "tokens": 2, "finish": "stop"},
                           {"turn": 1, "tokens": 4, "finish": "length", "ids": second}])
    tally = AnswerTally()
    ids, mask = encode_conversation(tok, conv, tally)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert loss_ids(ids, mask) == ids_of(tok, "abab") + [end] + second
    assert tally.as_dict() == {"target_ids": 1, "text": 1, "fallback": 0}
    want, _ = text_path(tok, conv)  # all but the second answer's tokens as the text path has
    assert want[-5:-2] == ids_of(tok, "ab x") and ids == want[:-5] + second + want[-2:]


def test_a_straddling_boundary_falls_back_to_the_text_and_is_counted(bpe_target, tmp_path):
    tok = bpe_target.tokenizer
    # "assistant\n" + "q..." tokenizes "\nq" as one token across the answer's start
    conv = answered([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "qa"}],
                    [{"turn": 0, "tokens": 2, "finish": "stop",
                      "ids": ids_of(tok, "q") + ids_of(tok, "a")}])
    tally = AnswerTally()
    assert encode_conversation(tok, conv, tally) == text_path(tok, conv)
    assert tally.as_dict() == {"target_ids": 0, "text": 0, "fallback": 1}
    # ids that do not decode to the answer (an edited text) fall back too
    edited = answered(conv.messages, [{"turn": 0, "finish": "stop", "ids": ids_of(tok, "zz")}])
    assert encode_conversation(tok, edited) == text_path(tok, edited)
    m = capture(bpe_target, [conv, edited], tmp_path, CFG, **QUIET)
    assert m["input"]["answers"] == {"target_ids": 0, "text": 0, "fallback": 2}
    from draftsmith.data.cli import describe

    assert "2 from their text although ids were recorded" in describe(
        Dataset(tmp_path))["answer turns"]


def test_regenerate_records_the_decoded_ids_and_capture_trains_on_them(target, model, tmp_path):
    from draftsmith.data.prompts import load_prompts
    from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
    from draftsmith.engine.generate import generate

    cfg = RegenConfig(max_new_tokens=10, max_len=96, batch_size=2, temperature=0.0)
    convs = [Conversation([{"role": "user", "content": f"say {i}"}]) for i in range(4)]
    out = tmp_path / "a.jsonl"
    backend = EngineBackend(target, model, cfg)
    regenerate(convs[:2], out, backend, target.tokenizer, cfg, False, lambda s: None)
    # answers written before ids were recorded: a rerun goes on after them
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    for r in recs:
        for a in r["meta"]["answers"]:
            del a["ids"]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    stats = regenerate(convs, out, backend, target.tokenizer, cfg, False, lambda s: None)
    assert stats["done_before"] == 2 and stats["answered"] == 2
    read = load_prompts(out).conversations
    assert [("ids" in c.meta["answers"][0]) for c in read] == [False, False, True, True]
    for c in read[2:]:
        a = c.meta["answers"][0]
        want = generate(model, [target.chat_ids(c.messages[:1])], 10, eos_ids=target.eos_ids)[0]
        assert a["ids"] == [int(t) for t in want] and a["tokens"] == len(want)
    m = capture(target, read, tmp_path / "d", CFG, model=model, **QUIET)
    assert m["input"]["answers"] == {"target_ids": 2, "text": 2, "fallback": 0}
    ds = Dataset(tmp_path / "d")
    end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k in range(len(read)):
        c = next(c for c in read if c.id == ds.sample_id(k))
        a = c.meta["answers"][0]
        if "ids" in a:
            ids, mask = ds.tokens(k)
            assert loss_ids(ids, mask) == a["ids"] + ([end] if a["finish"] == "stop" else [])


def test_online_training_takes_the_same_samples_as_capture(bpe_target, tmp_path):
    from draftsmith.train.sources import open_online

    tok = bpe_target.tokenizer
    split = ids_of(tok, "a") + ids_of(tok, "b") + ids_of(tok, "c")
    convs = [answered([{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "abc"}],
                      [{"turn": 0, "finish": "stop", "ids": split}]),
             answered([{"role": "user", "content": "yo"},
                       {"role": "assistant", "content": "qab"}],
                      [{"turn": 0, "finish": "length", "ids": ids_of(tok, "qab")}]),
             Conversation([{"role": "user", "content": "x"},
                           {"role": "assistant", "content": "ab ab"}])]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(c.to_json()) + "\n" for c in convs))
    capture(bpe_target, convs, tmp_path / "d", CFG, **QUIET)
    ds = Dataset(tmp_path / "d")
    stored = [tuple(t.tolist() for t in ds.tokens(k)) for k in range(len(convs))]
    data = open_online(path, bpe_target, None, None, CFG.max_len)
    online = [(ids, [bool(x) for x in mask]) for ids, mask in data.source.samples]
    assert online == [(ids, [bool(x) for x in mask]) for ids, mask in stored]
    assert data.summary["answers"] == {"target_ids": 1, "text": 1, "fallback": 1}
    assert torch.tensor(stored[0][0][-5:-2]).tolist() == split
