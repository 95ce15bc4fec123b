"""Regeneration: every assistant turn answered by the target, resumable without loss or duplicates."""
import json
import subprocess
import sys

import pytest

from inference.regenerate import read_finished, regenerate
from inference.runtime.engine import generate
from tests.conftest import make_conversations, run_module


def _sharegpt_file(tmp_path, n=5):
    rows = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in c["messages"]]}
            for c in make_conversations(n, seed=3)]
    rows[0]["conversations"].insert(0, {"from": "gpt", "value": "an answer before any question"})  # occurs in ShareGPT
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    return path, rows


def test_regeneration_resumes_after_an_interruption(tmp_path):
    source, rows = _sharegpt_file(tmp_path)
    out = tmp_path / "regen"
    calls = {"n": 0}

    def flaky_generate(*args, **kwargs):  # dies during the second batch
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        regenerate("tiny-random-llama", str(source), out, batch_size=2, max_new_tokens=6, max_length=512,
                   generate_fn=flaky_generate)
    first = read_finished(out / "conversations.jsonl")
    assert first and len(first) < 5
    with open(out / "conversations.jsonl", "a") as f:
        f.write('{"id": 4, "messa')  # a line cut mid-write by the interruption
    summary = regenerate("tiny-random-llama", str(source), out, batch_size=2, max_new_tokens=6, max_length=512)
    lines = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == [0, 1, 2, 3, 4]  # none lost, none twice
    assert summary["already_done"] == len(first)
    for r in lines:
        src = [t for t in rows[r["id"]]["conversations"]]
        src = src[1:] if src[0]["from"] == "gpt" else src
        msgs = r["messages"]
        # user turns kept verbatim, assistant turns replaced, in order
        assert [m["content"] for m in msgs if m["role"] == "user"] == [t["value"] for t in src if t["from"] == "human"][: len(msgs) // 2]
        assert msgs[-1]["role"] == "assistant" and r["regenerated_turns"] == sum(m["role"] == "assistant" for m in msgs)
        originals = {t["value"] for t in src if t["from"] == "gpt"}
        assert not any(m["content"] in originals for m in msgs if m["role"] == "assistant")


def test_regenerated_answers_are_the_targets_greedy_answers(tmp_path, tiny_target, tokenizer):
    import torch

    from data.chat import encode_prompt
    from inference.runtime.model import RuntimeModel

    source, _ = _sharegpt_file(tmp_path, n=2)
    out = tmp_path / "regen"
    regenerate("tiny-random-llama", str(source), out, batch_size=2, max_new_tokens=5, max_length=512)
    rec = json.loads((out / "conversations.jsonl").read_text().splitlines()[0])
    model = RuntimeModel.from_pretrained(tiny_target, dtype=torch.float32)
    prompt = encode_prompt(tokenizer, rec["messages"][:1])
    ids = generate(model, [prompt], 5, eos_ids=(tokenizer.eos_token_id,))[0][0]
    ids = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
    assert rec["messages"][1]["content"] == tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_resume_with_other_settings_and_bad_input_are_one_line_errors(tmp_path):
    source, _ = _sharegpt_file(tmp_path, n=2)
    out = tmp_path / "regen"
    regenerate("tiny-random-llama", str(source), out, batch_size=2, max_new_tokens=3, max_length=512)
    cmd = [sys.executable, "-m", "inference.regenerate", "--target", "tiny-random-llama", "--dataset", str(source), "--out", str(out)]
    res = subprocess.run(cmd + ["--max-new-tokens", "4", "--max-length", "512"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "max_new_tokens" in res.stderr and "Traceback" not in res.stderr
    # (the others through main in this process: seconds of imports saved each)
    res = run_module(*cmd[2:5], "no-such-data", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "no-such-data" in res.stderr and "Traceback" not in res.stderr
    res = run_module(*cmd[2:6], str(source), "--out", str(tmp_path / "y"), "--shard", "2/2")
    assert res.returncode == 2 and "--shard" in res.stderr and "Traceback" not in res.stderr


def test_shards_split_the_conversations_without_overlap(tmp_path):
    source, _ = _sharegpt_file(tmp_path, n=5)
    ids = []
    for i in range(2):
        regenerate("tiny-random-llama", str(source), tmp_path / f"s{i}", batch_size=2, max_new_tokens=3, max_length=512,
                   shard=(i, 2))
        ids.append([json.loads(line)["id"] for line in (tmp_path / f"s{i}" / "conversations.jsonl").read_text().splitlines()])
    assert ids == [[0, 2, 4], [1, 3]]
    with pytest.raises(ValueError, match="shard"):  # resuming a shard folder as another shard
        regenerate("tiny-random-llama", str(source), tmp_path / "s0", batch_size=2, max_new_tokens=3, max_length=512,
                   shard=(1, 2))


def test_loop_start_finds_the_end_of_the_first_copy_of_a_trailing_loop():
    from inference.regenerate import loop_start

    prose = list(range(1000, 1050))
    assert loop_start(prose + [7, 8, 9] * 40) == 53  # unit [7, 8, 9] from 50: keep one copy
    assert loop_start(prose + [5] * 60) == 51
    assert loop_start(prose + list(range(100, 160)) * 3) == 110  # a 60-token sentence, 3 times
    assert loop_start(list(range(300))) is None  # no repetition
    assert loop_start(prose + [7, 8, 9] * 40 + [1, 2, 3]) is None  # the loop was left: not a trailing loop
    assert loop_start(prose + [7, 8] * 10) is None  # 20 repeated tokens: shorter than min_repeat_tokens


def test_an_answer_cut_in_a_loop_keeps_one_copy_and_ends_the_conversation(tokenizer):
    from inference.regenerate import regenerate_batch

    unit = tokenizer.encode(" I like tea.", add_special_tokens=False)
    looping = tokenizer.encode("Sure.", add_special_tokens=False) + unit * 30
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": "more"}, {"role": "assistant", "content": "y"}]]

    def fake_generate(model, prompts, max_new_tokens, eos_ids=()):
        return [looping[:max_new_tokens] for _ in prompts], None

    kept, _ = regenerate_batch(None, tokenizer, convs, len(looping), 4096, fake_generate, keep_loops=True)
    cut, _ = regenerate_batch(None, tokenizer, convs, len(looping), 4096, fake_generate)
    assert kept[0]["messages"][-1]["content"].count("I like tea.") == 30 and "loop_cut" not in kept[0]
    # one copy kept (where the periodic tail begins may shift by a token: ". I like tea" repeats too)
    answer = cut[0]["messages"][-1]["content"]
    assert answer.startswith("Sure. I like tea") and answer.count("I like tea") == 1
    assert 29 * len(unit) <= cut[0]["loop_cut"] <= 29 * len(unit) + 1
    assert cut[0]["truncated"] and cut[0]["regenerated_turns"] == 1  # the second turn is not asked


def test_regeneration_continues_an_earlier_set_under_other_shards(tmp_path):
    """--continue-from: an earlier run's lines are kept (none answered again, none twice) even
    when the new run splits the ids into other shards."""
    source, _ = _sharegpt_file(tmp_path, n=7)
    old = tmp_path / "old"
    regenerate("tiny-random-llama", str(source), old, limit=None, batch_size=2, max_new_tokens=4, max_length=512,
               shard=(0, 2))  # ids 0, 2, 4, 6
    old_lines = {json.loads(line)["id"]: line for line in (old / "conversations.jsonl").read_text().splitlines()}
    assert sorted(old_lines) == [0, 2, 4, 6]
    written = 0
    for i in range(3):
        summary = regenerate("tiny-random-llama", str(source), tmp_path / f"new{i}", batch_size=8, max_new_tokens=4,
                             max_length=512, shard=(i, 3), continue_from=old / "conversations.jsonl")
        written += summary["written"]
        assert summary["continued_from"] == sum(1 for j in old_lines if j % 3 == i)
    lines = [line for i in range(3) for line in (tmp_path / f"new{i}" / "conversations.jsonl").read_text().splitlines()]
    ids = [json.loads(line)["id"] for line in lines]
    assert sorted(ids) == list(range(7))  # every conversation once
    for line in lines:  # the old answers kept as they were
        if json.loads(line)["id"] in old_lines:
            assert line == old_lines[json.loads(line)["id"]]
    assert written == 3  # only the conversations the old set lacked (ids 1, 3, 5) were answered


def test_continue_from_refuses_a_file_of_other_lines(tmp_path):
    source, _ = _sharegpt_file(tmp_path, n=3)
    bad = tmp_path / "bad.jsonl"
    run = lambda old: regenerate("tiny-random-llama", str(source), tmp_path / "out", batch_size=2, max_new_tokens=4,
                                 max_length=512, continue_from=old)
    bad.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="line 1: not a line of regenerated conversations"):
        run(bad)
    bad.write_text('{"id": 7, "skipped": "x"}\n')
    with pytest.raises(ValueError, match="id 7 is not a conversation of this source"):
        run(bad)
    bad.write_text(json.dumps({"id": 1, "messages": [{"role": "user", "content": "another question"}]}) + "\n")
    with pytest.raises(ValueError, match="conversation 1 asks another first question"):
        run(bad)
    assert not read_finished(tmp_path / "out" / "conversations.jsonl")  # nothing merged


def test_continued_answers_may_hold_line_separators(tmp_path):
    """Answers are written with ensure_ascii=False: U+2028 / U+2029 / U+0085 stay raw inside a
    line, and must not split it when the lines are read back."""
    source, _ = _sharegpt_file(tmp_path, n=4)
    old = tmp_path / "old"
    regenerate("tiny-random-llama", str(source), old, batch_size=2, max_new_tokens=4, max_length=512, shard=(0, 2))
    lines = [json.loads(line) for line in (old / "conversations.jsonl").read_text(encoding="utf-8").split("\n") if line]
    for r in lines:
        r["messages"][-1]["content"] += " a\u2028b\u2029c\x85d"
    carried = tmp_path / "carried.jsonl"
    carried.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines).encode("utf-8")
                        + b'{"id": 3, "mess')  # and an unfinished last line: left out
    summary = regenerate("tiny-random-llama", str(source), tmp_path / "new", batch_size=4, max_new_tokens=4,
                         max_length=512, continue_from=carried)
    assert summary["continued_from"] == len(lines) and summary["written"] == 4 - len(lines)
    assert read_finished(tmp_path / "new" / "conversations.jsonl") == {0, 1, 2, 3}


def test_a_batch_out_of_device_memory_is_answered_in_halves(tmp_path):
    """Device memory running out for a batch of 4 conversations: answered 2 and 2 (down to 1
    where needed), the same answers as a run that never ran out, each written once."""
    import torch

    source, _ = _sharegpt_file(tmp_path)
    biggest = []

    def small_device(model, prompts, *args, **kwargs):  # holds at most 2 rows
        biggest.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return generate(model, prompts, *args, **kwargs)

    settings = dict(batch_size=4, max_new_tokens=6, max_length=512)
    regenerate("tiny-random-llama", str(source), tmp_path / "small", generate_fn=small_device, **settings)
    regenerate("tiny-random-llama", str(source), tmp_path / "large", **settings)
    small, large = ([json.loads(line) for line in (tmp_path / name / "conversations.jsonl").read_text().splitlines()]
                    for name in ("small", "large"))
    assert max(biggest) == 4 and sorted(r["id"] for r in small) == [0, 1, 2, 3, 4]
    assert sorted(small, key=lambda r: r["id"]) == sorted(large, key=lambda r: r["id"])


def test_sampled_answers_of_the_heldout_conversations_alone(tmp_path):
    """--temperature T --heldout-only F: answers sampled at T (seeded: the same seed, the same
    answers; not the greedy ones) for exactly the conversations training holds out at F."""
    from data.chat import _is_heldout
    from data.sources import load_conversations

    source, _ = _sharegpt_file(tmp_path, n=40)
    convs = load_conversations(str(source))
    want = [i for i, c in enumerate(convs) if _is_heldout(c, 0.2)]
    assert 0 < len(want) < len(convs)
    common = dict(limit=None, batch_size=8, max_new_tokens=8, max_length=512, heldout_only=0.2)

    def answers(out, **kw):
        regenerate("tiny-random-llama", str(source), tmp_path / out, **common, **kw)
        rows = [json.loads(line) for line in (tmp_path / out / "conversations.jsonl").read_text().splitlines()]
        return {r["id"]: r.get("messages") for r in rows}

    a, b, greedy = answers("a", temperature=1.0, seed=5), answers("b", temperature=1.0, seed=5), answers("greedy")
    assert sorted(a) == sorted(greedy) == want
    assert a == b and a != greedy
    assert json.loads((tmp_path / "a" / "regenerate.json").read_text())["decoding"] == "sampled at T = 1, seed 5"


def test_a_benchmarks_questions_get_answers_and_half_of_them_make_a_heldout_set(tmp_path):
    """--dataset humaneval --heldout-only 0.5: the target answers exactly the HumanEval questions
    held out at 0.5 by prompt hash, each as a conversation of its question and the answer, which
    training then reads as a chat file (a promise set of code answers)."""
    from data.chat import _is_heldout
    from data.sources import load_conversations, load_prompts, prompt_conversations

    questions = prompt_conversations("humaneval")
    assert len(questions) == len(load_prompts("humaneval"))
    assert [m["role"] for m in questions[0]] == ["user", "assistant"] and questions[0][1]["content"] == ""
    want = [i for i, c in enumerate(questions) if _is_heldout(c, 0.5)]
    assert 0.3 * len(questions) < len(want) < 0.7 * len(questions)
    from transformers import AutoTokenizer

    from models.zoo import resolve_target

    code = AutoTokenizer.from_pretrained(resolve_target("tiny-random-llama")).encode("return x", add_special_tokens=False)

    def answer_in_code(model, prompts, max_new_tokens, eos_ids, **sampling):  # the tiny target's answers decode to nothing
        return [code + [eos_ids[0]] for _ in prompts], None

    regenerate("tiny-random-llama", "humaneval", tmp_path / "he", batch_size=64, max_new_tokens=4, max_length=1024,
               heldout_only=0.5, generate_fn=answer_in_code)
    rows = [json.loads(line) for line in (tmp_path / "he" / "conversations.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == want
    for r in rows:
        assert r["messages"] == [questions[r["id"]][0], {"role": "assistant", "content": "return x"}]
    answered = load_conversations(str(tmp_path / "he" / "conversations.jsonl"))
    assert len(answered) == len(want) and all(_is_heldout(c, 0.5) for c in answered)  # the same split, read back as chats
