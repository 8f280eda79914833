"""Chat-template rendering for data: assistant spans (the loss mask) and the user-turn prefix.

Assistant spans are found by rendering the conversation turn by turn: the text an assistant
message adds after the generation prompt of the turns before it. The whitespace a template puts
after its end-of-turn marker is not part of the span (the target never generates it).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import DraftsmithError

SENTINEL = "DRAFTSMITH_SENTINEL_5a1f"


def template_ids(tok: Any, messages: list[dict[str, str]],
                 add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template (the template's own error
    if it fails: a server reports it as the request's)."""
    text = tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def render(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        return tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja raises anything a template author chose
        raise DraftsmithError(f"the chat template failed on this conversation: {e}") from None


def assistant_spans(tok: Any, messages: list[dict[str, str]], cut: Collection[int] = (),
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The full conversation text and the [start, end) character spans of assistant turns.
    `cut`: indices of assistant messages cut at max tokens, whose span stops before the
    end-of-turn marker the template closes them with (the target never wrote it)."""
    full, turns = assistant_turns(tok, messages, cut)
    return full, [(start, end) for _, start, end in turns if end > start]


def assistant_turns(tok: Any, messages: list[dict[str, str]], cut: Collection[int] = (),
                    ) -> tuple[str, list[tuple[int, int, int]]]:
    """`assistant_spans` with each assistant message's index: (i, start, end), empty ones too."""
    full = render(tok, messages, False)
    turns: list[tuple[int, int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = _span(tok, full, messages, i, cursor)
        cursor = max(cursor, end)
        if i in cut:
            end = _before_close(tok, full, start, end)
        turns.append((i, start, end))
    return full, turns


def _before_close(tok: Any, full: str, start: int, end: int) -> int:
    for marker in (closing_marker(tok), getattr(tok, "eos_token", None)):
        if marker and full.startswith(marker, end - len(marker)) and end - len(marker) >= start:
            return end - len(marker)
    return end


def closing_marker(tok: Any) -> str:
    """What the chat template writes after an assistant message's text ("<|im_end|>"), up to
    the whitespace before the next turn; "" where it cannot tell."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    try:
        text = _turns_only(tok, render(tok, msgs, False))
    except DraftsmithError:
        return ""
    at = text.rfind(SENTINEL)
    return text[at + len(SENTINEL):].rstrip() if at >= 0 else ""


_ENDS: dict[tuple[int, str, str | None], str] = {}


def conversation_end(tok: Any) -> str:
    """What the template writes once the last message is closed, when rendered without a
    generation prompt (Phi-3's eos_token after the last "<|end|>\n"): no turn's text, and never
    written by the target after an answer; "" for most templates, and where it cannot tell."""
    key = (id(tok), str(getattr(tok, "chat_template", "")), getattr(tok, "eos_token", None))
    if key not in _ENDS:
        if len(_ENDS) > 64:
            _ENDS.clear()
        _ENDS[key] = _conversation_end(tok)
    return _ENDS[key]


def _conversation_end(tok: Any) -> str:
    one = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
    try:
        last = render(tok, one, False)
        more = render(tok, [*one, {"role": "user", "content": "hi"}], False)
    except DraftsmithError:
        return ""
    after = last.rfind(SENTINEL) + len(SENTINEL)
    if after < len(SENTINEL) or more.startswith(last):
        return ""
    # where the two part, in whole tokens: "<|end|>\n<|endoftext|>" and "<|end|>\n<|user|>"
    # share "<|end|>\n", not the "<|" of two special tokens
    enc = tok(last, add_special_tokens=False, return_offsets_mapping=True)
    ids, other = enc["input_ids"], tok(more, add_special_tokens=False)["input_ids"]
    k = next((j for j in range(min(len(ids), len(other))) if ids[j] != other[j]),
             min(len(ids), len(other)))
    cut = enc["offset_mapping"][k][0] if k < len(ids) else len(last)
    # parting at the answer itself is a template that renders the last turn otherwise (Qwen3's
    # empty think block), not an end of conversation
    return last[cut:] if cut > after and last[after:cut].strip() else ""


def _turns_only(tok: Any, text: str) -> str:
    """`text`, rendered without a generation prompt, less the template's `conversation_end`."""
    end = conversation_end(tok)
    return text[: len(text) - len(end)] if end and text.endswith(end) else text


def _span(tok: Any, full: str, messages: list[dict[str, str]], i: int,
          cursor: int) -> tuple[int, int]:
    content = messages[i]["content"]
    if i == 0:  # no history renders this turn's opening (role header, a default system prompt)
        return _find_content(tok, full, content, _first_turn(tok, full, messages), i)
    before = render(tok, messages[:i], True)
    upto = _turns_only(tok, render(tok, messages[: i + 1], False))
    if upto.startswith(before) and full.startswith(upto) and len(before) >= cursor:
        return len(before), len(upto.rstrip())
    eos_end = _eos_after(tok, full, before, _next_text(full, messages, i, len(before)))
    if full.startswith(before) and len(before) >= cursor and eos_end:
        return len(before), eos_end
    return _find_content(tok, full, content, _after_question(full, messages, i, cursor), i)


def _first_turn(tok: Any, full: str, messages: list[dict[str, str]]) -> int:
    # The text is searched for from where the one-message render puts it, not from 0: a short
    # answer may also occur in a default system prompt ("helpful").
    try:
        alone = _turns_only(tok, render(tok, messages[:1], False))
    except DraftsmithError:  # a template that wants a user message in any conversation
        return 0
    at = alone.rfind(messages[0]["content"].strip())
    return at if at >= 0 and full.startswith(alone) else 0


def _after_question(full: str, messages: list[dict[str, str]], i: int, cursor: int) -> int:
    # Past the user message this turn answers, so a short answer ("yes") is not found inside
    # the question ("Say yes"); templates that move the system prompt take this path (Mistral).
    asked = next((m["content"].strip() for m in reversed(messages[:i]) if m["role"] == "user"),
                 "")
    at = full.find(asked, cursor) if asked else -1
    return at + len(asked) if at >= 0 else cursor


def _eos_after(tok: Any, full: str, before: str, limit: int) -> int:
    # A template that rewrites earlier turns still opens the turn the same way: the span runs
    # to the first end-of-turn marker, if that comes before the next message's text (an eos the
    # template writes only at the conversation's end is no close of this turn).
    eos = getattr(tok, "eos_token", None)
    at = full.find(eos, len(before), limit) if eos else -1
    return at + len(eos) if at >= 0 else 0


def _next_text(full: str, messages: list[dict[str, str]], i: int, start: int) -> int:
    """Where the next message's text first occurs in `full` past `start` (its end if nowhere):
    found early (inside this answer), it only sends the span to `_find_content`."""
    later = next((m["content"].strip() for m in messages[i + 1:] if m["content"].strip()), "")
    at = full.find(later, start) if later else -1
    return at if at >= 0 else len(full)


def _find_content(tok: Any, full: str, content: str, cursor: int, i: int) -> tuple[int, int]:
    # Templates that rewrite history (e.g. dropping reasoning) do not extend turn by turn:
    # find the content itself and the end-of-turn token right after it.
    stripped = content.strip()
    start = full.find(stripped, cursor)
    if start < 0:
        raise DraftsmithError(
            f"message {i}: the chat template does not render this assistant message's text"
        )
    end = start + len(stripped)
    for close in (closing_marker(tok), getattr(tok, "eos_token", None)):
        if close and full.startswith(close, end):
            return start, end + len(close)
    return start, end


# assistant message index -> the ids the target decoded for it (None: recorded, but unusable)
AnswerIds = Mapping[int, "list[int] | None"]


@dataclass
class AnswerTally:
    """How the assistant turns encoded were tokenized: as the target's own recorded ids, from
    their text (no ids recorded), or from their text although ids were recorded (`fallback`:
    a token straddles the answer's edge in the template, or the ids do not decode to it)."""

    target_ids: int = 0
    text: int = 0
    fallback: int = 0

    def add(self, other: AnswerTally) -> None:
        self.target_ids += other.target_ids
        self.text += other.text
        self.fallback += other.fallback

    def as_dict(self) -> dict[str, int]:
        return {"target_ids": self.target_ids, "text": self.text, "fallback": self.fallback}


def encode(tok: Any, messages: list[dict[str, str]], cut: Collection[int] = (),
           answers: AnswerIds | None = None, tally: AnswerTally | None = None,
           ) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and a mask that is True on assistant tokens (`cut`:
    as in `assistant_spans`). `answers`: the target's recorded ids of some assistant turns,
    which stand in for their text's tokens (`splice_answers`); `tally` counts how each turn
    was taken."""
    text, turns = assistant_turns(tok, messages, cut)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return splice_answers(tok, text, turns, list(enc["input_ids"]), enc["offset_mapping"],
                          messages, answers, tally)


def encode_many(tok: Any, conversations: list[list[dict[str, str]]],
                names: list[str] | None = None, chunk: int = 256,
                cut: list[Collection[int]] | None = None,
                answers: list[AnswerIds] | None = None, tally: AnswerTally | None = None,
                ) -> Iterator[tuple[list[int], list[bool]]]:
    """`encode` of each conversation, in order, tokenized `chunk` texts at a time: a fast
    tokenizer spreads a batch over the cores (48,000 conversations one by one took ~20 s on
    2 cores), and a chunk of 256 long conversations stays in the hundreds of MB. A template
    error names the conversation (names[i], else its index). `cut[i]`: conversation i's
    assistant turns cut at max tokens (`Conversation.cut_turns`); `answers[i]`: its turns'
    recorded ids (`Conversation.answer_ids`)."""
    for start in range(0, len(conversations), chunk):
        rendered = []
        for i, messages in enumerate(conversations[start : start + chunk], start):
            try:
                rendered.append((i, *assistant_turns(tok, messages, cut[i] if cut else ())))
            except DraftsmithError as e:
                raise DraftsmithError(f"{names[i] if names else f'conversation {i}'}: {e}",
                                      ) from None
        enc = tok([text for _, text, _ in rendered], add_special_tokens=False,
                  return_offsets_mapping=True)
        for ids, offsets, (i, text, turns) in zip(enc["input_ids"], enc["offset_mapping"],
                                                  rendered, strict=True):
            yield splice_answers(tok, text, turns, list(ids), offsets, conversations[i],
                                 answers[i] if answers else None, tally)
        del enc, rendered  # ~240 bytes a token: one chunk held at a time, not two


def splice_answers(tok: Any, text: str, turns: list[tuple[int, int, int]], ids: list[int],
                   offsets: list[tuple[int, int]], messages: list[dict[str, str]],
                   answers: AnswerIds | None, tally: AnswerTally | None = None,
                   ) -> tuple[list[int], list[bool]]:
    """The conversation's ids and loss mask with each assistant turn that has recorded ids
    holding those ids in place of its content's tokens: the template's tokens before the
    content, the ids the target decoded (masked), the template's tokens after it (the closing
    marker masked as the text path masks it). A turn whose content's token range has no clean
    edges (a token straddling its start or end), or whose ids do not decode to its text, keeps
    its text's tokens (`fallback`). Without recorded ids: exactly the text's tokens and mask."""
    mask = span_mask(offsets, [(a, b) for _, a, b in turns if b > a])
    tally = tally if tally is not None else AnswerTally()
    starts = [a for a, _ in offsets]
    pieces: list[tuple[int, int, list[int]]] = []
    for i, start, _ in turns:
        if not answers or i not in answers:
            tally.text += 1
            continue
        span = _content_tokens(tok, text, start, messages[i]["content"], answers[i], offsets,
                               starts)
        if span is None:
            tally.fallback += 1
            continue
        tally.target_ids += 1
        pieces.append((*span, list(answers[i] or ())))
    if not pieces:
        return ids, mask
    out_ids: list[int] = []
    out_mask: list[bool] = []
    at = 0
    for a, b, recorded in pieces:
        out_ids += ids[at:a] + recorded
        out_mask += mask[at:a] + [True] * len(recorded)
        at = b
    return out_ids + ids[at:], out_mask + mask[at:]


def _content_tokens(tok: Any, text: str, start: int, content: str, recorded: list[int] | None,
                    offsets: list[tuple[int, int]], starts: list[int]) -> tuple[int, int] | None:
    """[a, b): the tokens of `content` rendered at `start`, where the recorded ids decode to it
    (as regenerate decoded them) and no token straddles its edges; else None."""
    if recorded is None or not text.startswith(content, start):
        return None
    try:
        said = tok.decode(recorded, skip_special_tokens=True).strip()
    except Exception:  # ids past the tokenizer's vocabulary (an edited file)
        return None
    if said != content.strip():
        return None
    end = start + len(content)
    a = bisect.bisect_left(starts, start)
    b = bisect.bisect_left(starts, end, lo=a)
    clean_start = a == 0 or offsets[a - 1][1] <= start
    clean_end = b == 0 or offsets[b - 1][1] <= end
    return (a, b) if clean_start and clean_end else None


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose start offset lies in one of the (sorted) character spans."""
    mask, k = [], 0
    for a, _ in offsets:
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and spans[k][0] <= a < spans[k][1])
    return mask


def user_prefix(tok: Any, system: str | None = None) -> tuple[str, str]:
    """(text before a user message's content, text right after it) in the chat template."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": SENTINEL}
    ]
    try:
        text = render(tok, msgs, False)
    except DraftsmithError as e:
        raise (_no_system(tok, e) if system else e) from None
    at = text.find(SENTINEL)
    if at < 0:
        raise DraftsmithError("the chat template does not render the user message's text")
    return text[:at], text[at + len(SENTINEL):]


def _no_system(tok: Any, e: DraftsmithError) -> DraftsmithError:
    """`e`, or where the template takes the user's message alone (Gemma's refuses a system
    role), an error that says the system message is what it refuses."""
    try:
        render(tok, [{"role": "user", "content": SENTINEL}], False)
    except DraftsmithError:
        return e
    said = str(e).removeprefix("the chat template failed on this conversation: ")
    return DraftsmithError(f"the chat template refuses a system message ({said}): make the "
                           "prompts without a system message (no --system)")


def role_headers(tok: Any, system: str | None = None) -> tuple[str, ...]:
    """The plain text that opens a user turn and the assistant's reply in the chat template
    ("User:", "Assistant:"), each its own line's, stripped. One holding an added token
    (`<|im_start|>assistant`) is left out, its token marks the turn already, and one of no
    letter or digit."""
    prefix, suffix = user_prefix(tok, system)
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": SENTINEL}]
    try:
        after = render(tok, msgs, True).split(SENTINEL, 1)[-1]
    except DraftsmithError:  # a template that fails on the reply's prompt: the user's alone
        after = suffix
    reply = after[len(suffix):] if after.startswith(suffix) else after
    heads = (prefix.rstrip().rsplit("\n", 1)[-1].strip(), reply.strip().split("\n", 1)[0].strip())
    added = [str(t) for t in (getattr(tok, "added_tokens_decoder", None) or {}).values()
             if str(t).strip()]
    # a header of no word (a quote's ">") would cut questions at their own text
    return tuple(h for h in dict.fromkeys(heads)
                 if any(c.isalnum() for c in h) and not any(a in h for a in added))
