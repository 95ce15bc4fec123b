"""Conversation sources → a list of OpenAI-style conversations.

A conversation is `[{"role": "system"|"user"|"assistant", "content": str}, ...]`.
Sources: zoo names (`sharegpt`, `mt-bench`, `humaneval`), a ShareGPT-style JSON file (list of
`{"conversations": [{"from", "value"}]}`), JSONL with OpenAI `messages` (or ShareGPT rows),
or an HF dataset folder / hub id with such columns.
"""
from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# ShareGPT speakers → chat-template roles. Unknown speakers make the conversation unusable.
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant", "system": "system",
}


class DataError(RuntimeError):
    pass


def iter_json_array(text: str, source: str):
    """Yield the complete objects of a JSON array, tolerating a truncated tail.

    The zoo's ShareGPT file is cut mid-object, so `json.load` fails; a streaming parse keeps
    every complete element and warns once with the number of bytes dropped.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            dropped = len(text[i:].encode("utf-8"))
            log.warning("%s is truncated: kept the complete conversations, dropped the last %d bytes", source, dropped)
            return
        yield obj


ROLES = ("system", "user", "assistant")


def sharegpt_to_messages(row: dict) -> list[dict] | None:
    return usable_messages(row)[0]


def _sharegpt(row: dict) -> tuple[list[dict] | None, str | None]:
    turns = row.get("conversations") or row.get("conversation")
    if not isinstance(turns, list):
        return None, "no turns"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "a turn that is not an object"
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            return None, "a turn without a known speaker"
        if not isinstance(turn.get("value"), str):
            return None, "a turn without text"
        messages.append({"role": role, "content": turn["value"]})
    return messages, None


def _openai(row: dict) -> tuple[list[dict] | None, str | None]:
    msgs = row["messages"]
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        return None, "messages that are not a list of objects"
    if not all(m.get("role") in ROLES for m in msgs):
        return None, "a message without a role (system, user or assistant)"
    if not all(isinstance(m.get("content"), str) for m in msgs):
        return None, "a message without text content"
    return [{"role": m["role"], "content": m["content"]} for m in msgs], None


def usable_messages(row, plain_text: bool = False) -> tuple[list[dict] | None, str | None]:
    """(messages, None) for a usable row, else (None, the reason it is dropped). Plain-text
    mode also takes rows with a `text` field (as one message)."""
    if not isinstance(row, dict):
        return None, "a row that is not a JSON object"
    if plain_text and isinstance(row.get("text"), str):
        return ([{"role": "user", "content": row["text"]}], None) if row["text"].strip() else (None, "empty text")
    msgs, reason = _openai(row) if "messages" in row else _sharegpt(row)
    if msgs is None:
        return None, reason
    if not plain_text and not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        return None, "no assistant turn"
    if plain_text and not any(m["content"].strip() for m in msgs):
        return None, "empty text"
    return msgs, None


def normalize(row: dict) -> list[dict] | None:
    """A raw row (OpenAI `messages` or ShareGPT `conversations`) → messages, or None if unusable."""
    return usable_messages(row)[0]


def load_conversations(spec: str, limit: int | None = None, plain_text: bool = False) -> list[list[dict]]:
    """All usable conversations of a source, in file order (first `limit` if given); the ones
    dropped are counted in the log, by reason."""
    from collections import Counter

    from models import zoo

    if spec == "sharegpt":
        path = zoo.fetch("sharegpt")
    elif spec in PROMPT_SETS:
        raise DataError(f"{spec} is a benchmark of prompts without answers; train on sharegpt or a chat file "
                        f"(`python -m inference.regenerate --dataset {spec}` writes the target's answers as one)")
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        if "/" in spec and not spec.startswith((".", "/")):
            return _from_hf(spec, limit)
        raise DataError(f"dataset {spec!r} is not a zoo name or an existing file")
    if path.is_dir():
        return _from_hf(str(path), limit)
    out, dropped = [], Counter()
    for row in _read_rows(path):
        msgs, reason = usable_messages(row, plain_text)
        if msgs is None:
            dropped[reason] += 1
            continue
        out.append(msgs)
        if limit is not None and len(out) >= limit:
            break
    if dropped:
        log.warning("%s: kept %d conversations, dropped %d: %s", spec, len(out), sum(dropped.values()),
                    "; ".join(f"{n} with {why}" for why, n in dropped.most_common()))
    else:
        log.info("%s: %d conversations", spec, len(out))
    if not out:
        what = "rows with `text`, `messages` or `conversations`" if plain_text else \
            "`messages` or ShareGPT `conversations` with an assistant turn"
        raise DataError(f"{spec} has no usable conversations (need {what})"
                        + (f"; dropped: {', '.join(f'{n} with {why}' for why, n in dropped.most_common())}" if dropped else ""))
    return out


def _read_rows(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        return iter_json_array(text, str(path))

    rows = []
    # split on newlines only: str.splitlines also breaks at U+2028, U+0085 and other
    # separators that JSON strings may hold raw (json.dumps(..., ensure_ascii=False))
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def _from_hf(spec: str, limit: int | None):
    import datasets

    try:
        ds = datasets.load_dataset(spec, split="train")
    except (OSError, ValueError) as e:  # ConnectionError, DatasetNotFoundError, DataFilesNotFoundError, ...
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        if Path(spec).is_dir():  # a folder datasets cannot read (of .md files, say)
            raise DataError(f"dataset {spec}: a folder Hugging Face datasets cannot read as a data set ({reason}); "
                            "give a chat JSON/JSONL file or a saved data set") from None
        raise DataError(f"dataset {spec!r}: not a zoo name or an existing file, and the Hugging Face hub does not give "
                        f"it ({reason})") from None
    out = []
    for row in ds:
        msgs = normalize(row)
        if msgs is not None:
            out.append(msgs)
            if limit is not None and len(out) >= limit:
                break
    return out


PROMPT_SETS = ("mt-bench", "humaneval")  # benchmarks of questions without answers


def first_user_turn(messages: list[dict]) -> str | None:
    """A conversation's first question (None: it asks nothing)."""
    return next((m["content"] for m in messages if m.get("role") == "user"), None)


def prompt_conversations(spec: str, limit: int | None = None) -> list[list[dict]]:
    """A benchmark's questions as conversations waiting for answers (inference.regenerate fills
    them): each user turn followed by an empty assistant turn, in the benchmark's order."""
    return [[m for turn in row["turns"] for m in ({"role": "user", "content": turn}, {"role": "assistant", "content": ""})]
            for row in load_prompts(spec)[:limit]]


def load_prompts(spec: str) -> list[dict]:
    """Benchmark prompts: `[{"id", "category", "turns": [str, ...]}]` (mt-bench, humaneval, JSONL)."""
    from models import zoo

    if spec == "mt-bench":
        rows = _read_rows(zoo.fetch("mt-bench"))
        return [{"id": str(r["question_id"]), "category": r["category"], "turns": list(r["turns"])} for r in rows]
    if spec == "humaneval":
        rows = _read_rows(zoo.fetch("humaneval"))
        return [{"id": r["task_id"], "category": "humaneval",
                 "turns": ["Complete this Python function.\n\n```python\n" + r["prompt"] + "```"]} for r in rows]
    path = Path(spec).expanduser()
    if path.is_dir():
        raise DataError(f"{spec}: a folder; prompts come from a JSON or JSONL file (rows with a `prompt` string or "
                        "`messages` holding a user turn)")
    out = []
    for i, row in enumerate(_read_rows(path)):
        where = f"{spec}: row {i + 1}"
        if not isinstance(row, dict):
            raise DataError(f"{where} is not a JSON object")
        if "category" in row and not isinstance(row["category"], str):
            raise DataError(f"{where}: `category` must be a string, got {_kind(row['category'])}")
        if "prompt" in row and not isinstance(row["prompt"], str):
            raise DataError(f"{where}: `prompt` must be a string, got {_kind(row['prompt'])}")
        msgs = normalize(row) or row.get("messages") or []
        if not isinstance(msgs, list):
            raise DataError(f"{where}: `messages` must be a list of {{role, content}}, got {_kind(msgs)}")
        turns = [m["content"] for m in msgs if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)] or ([row["prompt"]] if "prompt" in row else [])
        if not turns:
            raise DataError(f"{where} has no `prompt` (a string) and no `messages` with a user turn (keys: "
                            f"{', '.join(sorted(map(str, row))) or 'none'})")
        out.append({"id": str(row.get("id", i)), "category": row.get("category", "all"), "turns": turns})
    return out


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
