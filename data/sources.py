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


def sharegpt_to_messages(row: dict) -> list[dict] | None:
    turns = row.get("conversations") or row.get("conversation")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            return None
        messages.append({"role": role, "content": value})
    return messages


def normalize(row: dict) -> list[dict] | None:
    """A raw row (OpenAI `messages` or ShareGPT `conversations`) → messages, or None if unusable."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            return None
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
    else:
        msgs = sharegpt_to_messages(row)
    if not msgs or not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        return None
    return msgs


def load_conversations(spec: str, limit: int | None = None) -> list[list[dict]]:
    """All usable conversations of a source, in file order (first `limit` if given)."""
    from models import zoo

    if spec == "sharegpt":
        path = zoo.fetch("sharegpt")
    elif spec in ("mt-bench", "humaneval"):
        raise DataError(f"{spec} is a benchmark of prompts without answers; train on sharegpt or a chat file")
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        if "/" in spec and not spec.startswith((".", "/")):
            return _from_hf(spec, limit)
        raise DataError(f"dataset {spec!r} is not a zoo name or an existing file")
    if path.is_dir():
        return _from_hf(str(path), limit)
    rows = _read_rows(path)
    out, seen = [], 0
    for row in rows:
        seen += 1
        msgs = normalize(row) if isinstance(row, dict) else None
        if msgs is not None:
            out.append(msgs)
            if limit is not None and len(out) >= limit:
                break
    if limit is None:
        log.info("%s: %d complete conversations, %d without an assistant turn skipped", spec, seen, seen - len(out))
    if not out:
        raise DataError(f"{spec} has no usable conversations (need `messages` or ShareGPT `conversations` with an assistant turn)")
    return out


def _read_rows(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
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

    ds = datasets.load_dataset(spec, split="train")
    out = []
    for row in ds:
        msgs = normalize(row)
        if msgs is not None:
            out.append(msgs)
            if limit is not None and len(out) >= limit:
                break
    return out


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
    out = []
    for i, row in enumerate(_read_rows(Path(spec))):
        msgs = normalize(row) or row.get("messages") or []
        turns = [m["content"] for m in msgs if m["role"] == "user"] or ([row["prompt"]] if "prompt" in row else [])
        if turns:
            out.append({"id": str(row.get("id", i)), "category": row.get("category", "all"), "turns": turns})
    return out
