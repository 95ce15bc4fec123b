import json
import logging

import pytest

from data.chat import build_datasets, tokenize_conversation
from data.sources import iter_json_array, load_conversations


def test_loss_mask_covers_every_assistant_turn_and_nothing_else(tokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
    ]
    out = tokenize_conversation(tokenizer, msgs, max_length=4096)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask)
    # the masked tokens, joined per run, are exactly the two assistant turns + end-of-turn
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    texts = [tokenizer.decode(r) for r in runs]
    eot = tokenizer.eos_token
    assert texts == [f"Hello! How can I help?{eot}", f"Blue.{eot}"]
    # nothing of the system or user turns, nor the role headers, is masked
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Hi there" in unmasked and "Name a color." in unmasked and "Be brief." in unmasked
    assert "Hello" not in unmasked and "Blue" not in unmasked


def test_truncation(tokenizer):
    msgs = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "answer " * 50}]
    out = tokenize_conversation(tokenizer, msgs, max_length=40)
    assert len(out["input_ids"]) == 40 and len(out["loss_mask"]) == 40


def test_truncated_json_array_keeps_complete_objects(caplog):
    text = json.dumps([{"a": 1}, {"b": [1, 2]}, {"c": "x"}])[:-8]
    with caplog.at_level(logging.WARNING):
        rows = list(iter_json_array(text, "f.json"))
    assert rows == [{"a": 1}, {"b": [1, 2]}]
    assert len(caplog.records) == 1 and "dropped the last" in caplog.text


def test_split_is_deterministic_and_second_run_is_cached(tokenizer, chat_file, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    train, heldout = build_datasets(chat_file, tokenizer, 64, heldout_fraction=0.2, num_proc=1)
    assert len(train) > 0 and len(heldout) > 0
    calls = []
    import data.chat as chat

    monkeypatch.setattr(chat, "tokenize_conversation", lambda *a, **k: calls.append(1))
    train2, heldout2 = build_datasets(chat_file, tokenizer, 64, heldout_fraction=0.2, num_proc=1)
    assert calls == [], "the second run must load the cache, not tokenize"
    assert train2["input_ids"][:] == train["input_ids"][:] and heldout2["input_ids"][:] == heldout["input_ids"][:]
    held = {tuple(r) for r in heldout["input_ids"]}
    assert not any(tuple(r) in held for r in train["input_ids"]), "held-out rows never appear in training"


def test_benchmarks_are_not_training_data():
    from data.sources import DataError

    with pytest.raises(DataError, match="benchmark"):
        load_conversations("mt-bench")


@pytest.mark.slow
def test_zoo_sharegpt_loads_all_complete_conversations(caplog):
    with caplog.at_level(logging.INFO):
        convs = load_conversations("sharegpt")
    warnings = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warnings) == 1 and "2987 bytes" in warnings[0].getMessage()
    # 17,671 complete conversations, of which 143 have no assistant text (counted by reason)
    assert "kept 17528 conversations, dropped 143: 126 with no turns; 17 with no assistant turn" in caplog.text
    assert len(convs) == 17671 - 143


def test_jsonl_with_raw_unicode_line_separators(tmp_path):
    """Regenerated files hold U+2028 and friends raw inside strings; lines split on \\n only."""
    import json

    from data.sources import load_conversations

    path = tmp_path / "raw.jsonl"
    msgs = [{"role": "user", "content": "a\u2028b\x1cc\u0085d"}, {"role": "assistant", "content": "e\u2029f"}]
    path.write_text(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n" + json.dumps({"messages": msgs}) + "\n",
                    encoding="utf-8")
    assert load_conversations(str(path)) == [msgs, msgs]


def test_dropped_conversations_are_counted_by_reason(tmp_path, caplog):
    import logging

    from data.sources import load_conversations

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [good, good, {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]},
            {"messages": [{"role": "user", "content": "only a question"}]}, [1, 2], {"conversations": []}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        assert len(load_conversations(str(path))) == 2
    assert ("kept 2 conversations, dropped 4: " in caplog.text and "1 with a message without a role" in caplog.text
            and "1 with no assistant turn" in caplog.text and "1 with a row that is not a JSON object" in caplog.text
            and "1 with no turns" in caplog.text)
