"""Conversations → token ids and a loss mask on assistant tokens, through the target's own chat
template, cached with `datasets`.

The template is rendered as text; assistant spans are located by rendering growing prefixes
(the text before turn i with the generation prompt must be a prefix of the text through turn i),
then the whole text is tokenized once and tokens whose first character falls inside an
assistant span are marked. This works for any template without `{% generation %}` markers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the tokenized layout changes, to invalidate caches


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]] | None:
    """Rendered text and [start, end) character spans of each assistant turn (trailing
    whitespace excluded: the model stops at its end-of-turn token, it never generates the
    newline after it). None when the template is not prefix-consistent for this conversation."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(through) or not through.startswith(before):
            return None
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> dict:
    """{'input_ids': [T], 'loss_mask': [T]} truncated to max_length; empty if unusable."""
    rendered = assistant_spans(tokenizer, messages)
    if rendered is None:
        return {"input_ids": [], "loss_mask": []}
    text, spans = rendered
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids = enc["input_ids"][:max_length]
    mask = []
    j = 0
    for start, _ in enc["offset_mapping"][:max_length]:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        mask.append(int(j < len(spans) and spans[j][0] <= start < spans[j][1]))
    return {"input_ids": ids, "loss_mask": mask}


def _is_heldout(messages: list[dict], fraction: float) -> bool:
    digest = hashlib.sha1(json.dumps(messages[:2], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def dataset_key(spec: str, tokenizer, max_length: int, limit: int | None, heldout_fraction: float) -> str:
    src = Path(spec).expanduser()
    src_id = f"{src.resolve()}:{src.stat().st_size}:{src.stat().st_mtime_ns}" if src.exists() else spec
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template)
    vocab_hash = hashlib.sha1(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    blob = json.dumps([FORMAT_VERSION, src_id, template, vocab_hash, max_length, limit, heldout_fraction])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def build_datasets(spec: str, tokenizer, max_length: int, limit: int | None = None,
                   heldout_fraction: float = 0.02, num_proc: int | None = None):
    """(train, heldout) `datasets.Dataset`s with columns input_ids, loss_mask, num_tokens.

    Tokenized once and cached on disk under $DRAFTSMITH_CACHE/datasets/<key>; a second run
    loads the cache and tokenizes nothing.
    """
    import datasets

    from models.zoo import cache_dir, file_lock

    key = dataset_key(spec, tokenizer, max_length, limit, heldout_fraction)
    root = cache_dir() / "datasets" / key
    with file_lock(f"dataset-{key}"):  # several ranks (DDP) tokenize once
        if not ((root / "train").exists() and (root / "heldout").exists()):
            _tokenize_to(root, spec, tokenizer, max_length, limit, heldout_fraction, num_proc)
        else:
            log.info("loading tokenized data from cache %s", root)
    return datasets.load_from_disk(str(root / "train")), datasets.load_from_disk(str(root / "heldout"))


def _tokenize_to(root: Path, spec, tokenizer, max_length, limit, heldout_fraction, num_proc):
    import datasets

    from data.sources import load_conversations

    key = root.name

    conversations = load_conversations(spec, limit)
    heldout_flags = [_is_heldout(c, heldout_fraction) for c in conversations]
    raw = datasets.Dataset.from_dict({
        "messages_json": [json.dumps(c) for c in conversations],
        "heldout": heldout_flags,
    })
    if num_proc is None:
        num_proc = min(8, os.cpu_count() or 1)
    num_proc = max(1, min(num_proc, len(raw) // 64))

    def encode(row):
        out = tokenize_conversation(tokenizer, json.loads(row["messages_json"]), max_length)
        out["num_tokens"] = len(out["input_ids"])
        out["num_loss_tokens"] = sum(out["loss_mask"])
        return out

    tokenized = raw.map(encode, num_proc=num_proc if num_proc > 1 else None, remove_columns=["messages_json"],
                        desc=f"tokenizing {spec}")
    tokenized = tokenized.filter(lambda r: r["num_loss_tokens"] > 0, desc="dropping rows without assistant tokens")
    train = tokenized.filter(lambda r: not r["heldout"]).remove_columns(["heldout"])
    heldout = tokenized.filter(lambda r: r["heldout"]).remove_columns(["heldout"])
    if len(train) == 0:
        raise RuntimeError(f"{spec}: no training conversations left after tokenization")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=key + ".tmp"))
    train.save_to_disk(str(tmp / "train"))
    heldout.save_to_disk(str(tmp / "heldout"))
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered with the chat template and the generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
