"""What validation serves and replays: questions through the runtime with an exported drafter,
turn by turn (`measure`), and the served text through training's walk (`replay`), so that the
promise, the runtime and the predictor can be compared on the same text (inference/validate.py).
"""
from __future__ import annotations


def load_prompts_for(dataset: str, provenance: dict, limit: int | None, leave_out: frozenset[str] = frozenset(),
                     left_out: list | None = None) -> list[dict]:
    """[{id, category, turns}] for a zoo benchmark, `sharegpt-heldout` or a JSON/JSONL file;
    questions whose first turn is in `leave_out` are not among them (appended to `left_out`
    when given)."""
    from data.sources import load_prompts

    if dataset == "sharegpt-heldout":
        from data.chat import _is_heldout
        from data.sources import load_conversations

        data_cfg = provenance.get("training_config", {}).get("data", {})
        fraction = data_cfg.get("heldout_fraction", 0.02)
        rows = []
        for i, conv in enumerate(load_conversations("sharegpt")):
            if _is_heldout(conv, fraction):
                turns = [m["content"] for m in conv if m["role"] == "user"]
                if turns:
                    rows.append({"id": f"sharegpt-{i}", "category": "sharegpt", "turns": turns})
    else:
        rows = load_prompts(dataset)
    if not rows:
        raise ValueError(f"--dataset {dataset}: no prompts")
    if left_out is not None:
        left_out.extend(r for r in rows if r["turns"][0] in leave_out)
    rows = [r for r in rows if r["turns"][0] not in leave_out]
    if not rows:
        raise ValueError(f"--dataset {dataset}: every question is in the promise set (left out of serving)")
    return spread_over_categories(rows, limit) if limit else rows


def first_questions(spec: str) -> frozenset[str]:
    """The first user turn of every conversation of a data set (a promise set's questions; a
    conversation without a user turn asks nothing)."""
    from data.sources import first_user_turn, load_conversations

    return frozenset(q for q in map(first_user_turn, load_conversations(spec)) if q is not None)


def spread_over_categories(rows: list[dict], limit: int) -> list[dict]:
    """The first `limit` rows taken in turn from each category (MT-bench lists its 8 categories
    one after another: its first 16 questions would be writing and roleplay only)."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row.get("category", ""), []).append(row)
    picked = []
    for depth in range(max(len(group) for group in by_category.values())):
        picked += [group[depth] for group in by_category.values() if depth < len(group)]
    return picked[:limit]


def measure(rt, tokenizer, drafter, questions: list[dict], k: int, max_new_tokens: int, temperature: float,
            seed: int = 0, max_turns: int | None = None, progress: bool = True, verification: str = "standard",
            make_proposer=None, deadline: float | None = None, batch_size: int = 1, verify_tokens: int | None = None,
            adaptive=None):
    """Serve the questions turn by turn, `batch_size` questions at a time (turn r of each, then
    turn r+1 after those answers); returns per-answer records with their own histograms.

    make_proposer(prompts, max_len) → proposer replaces the drafter (the reference rows: n-gram,
    suffix; draft trees), built for that cache length; verify_tokens: drafts verified per step
    when not k (a tree's nodes), which the cache must hold room for.
    adaptive: inference.runtime.adaptive's AdaptiveVerification, passed to generate (None: k drafts verified every step).
    deadline (time.time()): no batch after the first is started after it. A record's seconds are
    its share (by new tokens) of its batch's time, so sums give the throughput."""
    import time

    import torch
    from tqdm import tqdm

    from data.chat import encode_prompt
    from inference.cli import check_fits
    from inference.runtime.engine import CACHE_BUCKET, cache_size, generate
    from inference.proposers import drafter_proposer

    device = rt.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    eos = tokenizer.eos_token_id
    records = []
    context = getattr(rt.config, "max_position_embeddings", None)
    proposers = {}  # one drafter proposer per (batch, cache length): its captured graphs are reused
    with tqdm(total=len(questions), desc="validating", unit="question", disable=not progress) as bar:
        for start in range(0, len(questions), batch_size):
            if deadline is not None and records and time.time() > deadline:
                break
            batch = questions[start : start + batch_size]
            conversations = [[] for _ in batch]
            for turn in range(max(len(q["turns"][:max_turns]) for q in batch)):
                rows = [i for i, q in enumerate(batch) if turn < len(q["turns"][:max_turns])]
                prompts = []
                for i in rows:
                    conversations[i].append({"role": "user", "content": batch[i]["turns"][turn]})
                    prompts.append(encode_prompt(tokenizer, conversations[i]))
                    check_fits(len(prompts[-1]), max_new_tokens, context, f"question {batch[i]['id']}, turn {turn + 1}")
                max_len = -(-cache_size(prompts, max_new_tokens, verify_tokens or k) // CACHE_BUCKET) * CACHE_BUCKET
                if make_proposer:
                    proposer = make_proposer(prompts, max_len)
                else:
                    key = (len(prompts), max_len)
                    proposer = proposers.get(key) or proposers.setdefault(
                        key, drafter_proposer(drafter, k, len(prompts), max_len, rt.config))
                outs, stats = generate(rt, prompts, max_new_tokens, proposer=proposer, eos_ids=(eos,), max_len=max_len,
                                       temperature=temperature, generator=generator, verification=verification,
                                       adaptive=adaptive)
                new_tokens = max(sum(len(o) for o in outs), 1)
                for i, prompt, answer, hist in zip(rows, prompts, outs, stats.row_histograms):
                    text = tokenizer.decode(answer[:-1] if answer and answer[-1] == eos else answer, skip_special_tokens=True)
                    conversations[i].append({"role": "assistant", "content": text})
                    records.append({"id": batch[i]["id"], "category": batch[i]["category"], "turn": turn + 1,
                                    "prompt": prompt, "answer": answer, "histogram": hist, "new_tokens": len(answer),
                                    "seconds": stats.total_seconds * len(answer) / new_tokens})
                    if stats.verified_drafts is not None and len(rows) == 1:  # adaptive verification, one row: its own
                        records[-1]["verified_drafts"] = stats.verified_drafts
            bar.update(len(batch))
    return records


def replay(target, drafter, records: list[dict], k: int, anchors: int | None, part: str, temperature: float = 0.0,
           verification: str = "standard", seed: int = 0, tree: tuple[int, int, int] | None = None, verify_width=None):
    """Training's predictor on the served text (at most `anchors` chains per text, None: all), walking the
    answers as serving did (greedy: the very chains the runtime drafted) or the prompts. At T > 0 the
    sampled predictor (inference/walks/sampled.py) at that temperature and verification. tree
    (depth, top_k, total_tokens; k = depth): the tree walk instead (inference/walks/tree.py). verify_width
    (confidence [m,k] → [m]): adaptive verification's width per chain (inference.walks.greedy.chain_widths)."""
    import torch

    from inference.walks.greedy import predicted_histogram
    from inference.walks.sampled import sampled_histogram

    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    hist = torch.zeros(k + 1, dtype=torch.long if temperature == 0 else torch.float64)
    for r in records:
        ids = r["prompt"] + r["answer"]
        mask = [0] * len(r["prompt"]) + [1] * len(r["answer"]) if part == "answer" else \
            [1] * len(r["prompt"]) + [0] * len(r["answer"])
        t = torch.as_tensor([ids], device=device)
        mask, length = torch.as_tensor([mask], device=device), torch.as_tensor([len(ids)])
        if tree is not None:
            from inference.walks.tree import predicted_tree_histograms

            hist += predicted_tree_histograms(target, drafter, t, mask, length, [tree], anchors)[tree]
        else:
            hist += predicted_histogram(target, drafter, t, mask, length, k, anchors, verify_width=verify_width) \
                if temperature == 0 else sampled_histogram(target, drafter, t, mask, length, k, anchors, temperature,
                                                           verification, generator, verify_width=verify_width)
    return hist
