"""The acceptance sections of `python -m inference.deploy`: by the context before the drafted
positions (long conversations of a data set, measured by the runtime and replayed through
training's predictor) and by the precision of the target's weights (inference/quantize.py)."""
from __future__ import annotations

from inference.deploy import bucket_label, bucket_of, serve


def context_prompts(tokenizer, spec: str, buckets, per_bucket: int, longest: int, scan: int = 5000) -> list[dict]:
    """Up to `per_bucket` prompts per bucket of prompt length, each a user turn of a conversation
    of `spec` after that conversation's own earlier turns (answers included), no longer than
    `longest` tokens: [{bucket, prompt, source}]. Conversations are read in order (at most
    `scan`), each turn tried from its last (the longest context)."""
    from data.chat import encode_prompt
    from data.sources import load_conversations

    found = {i: [] for i in range(len(buckets))}
    for c, messages in enumerate(load_conversations(spec, limit=scan)):
        if all(len(v) >= per_bucket for v in found.values()):
            break
        for i in reversed([j for j, m in enumerate(messages) if m["role"] == "user"]):
            ids = encode_prompt(tokenizer, messages[: i + 1])
            b = bucket_of(len(ids), buckets)
            if len(ids) <= longest and b is not None and len(found[b]) < per_bucket:
                found[b].append({"bucket": b, "prompt": ids, "source": f"conversation {c}, message {i + 1}"})
            if b is not None and all(len(found[j]) >= per_bucket for j in range(b + 1)):
                break  # the earlier turns' contexts are shorter: buckets already full
    return [p for b in found for p in found[b]]


def acceptance_batches(items: list, batch: int) -> list[list]:
    return [items[i : i + batch] for i in range(0, len(items), batch)]


def measure_acceptance(rt, module, prompts, k, max_new, eos, batch, device) -> list[tuple]:
    """The prompts answered with the drafter at k, `batch` at a time (a cache per batch sized to
    it): [(prompt, answer, row histogram)]."""
    from inference.proposers import drafter_proposer
    from inference.runtime.engine import CACHE_BUCKET, cache_size

    records = []
    for chunk in acceptance_batches(prompts, batch):
        max_len = -(-cache_size(chunk, max_new, k) // CACHE_BUCKET) * CACHE_BUCKET
        serve(rt, [chunk], drafter_proposer(module, k, len(chunk), max_len, rt.config), max_new, eos, max_len, device,
              records=records)
    return records


def context_section(records: list[tuple], buckets, target, module, k) -> dict:
    """records [(prompt, answer, row histogram)] → per bucket: measured tau (the runtime, by the
    context before each answer), predicted tau (training's predictor on the same answers, same
    bucketing) and the predictor's tau with each chain in the bucket of its own context."""
    import torch

    from inference.walks.greedy import predicted_histogram
    from models.acceptance import Acceptance

    zeros = lambda: torch.zeros(k + 1, dtype=torch.long)  # noqa: E731
    measured, predicted, by_chain = ([zeros() for _ in buckets] for _ in range(3))
    answers = [0] * len(buckets)
    device = next(target.parameters()).device
    for prompt, answer, hist in records:
        b = bucket_of(len(prompt), buckets)
        measured[b] += torch.as_tensor(hist)
        answers[b] += 1
        ids = torch.as_tensor([prompt + answer], device=device)
        mask = torch.as_tensor([[0] * len(prompt) + [1] * len(answer)], device=device)

        def on_chain(row, anchor, later, accepted):
            # a chain at anchor a drafts after x_0..x_{a+1}: a + 2 tokens of context
            by_chain[bucket_of(anchor + 2, buckets, clamp=True)][accepted] += 1

        predicted[b] += predicted_histogram(target, module, ids, mask, torch.as_tensor([ids.shape[1]]), k, None,
                                            on_chain=on_chain)
    out = []
    for i, bucket in enumerate(buckets):
        m, p, c = (Acceptance.from_histogram(h) for h in (measured[i], predicted[i], by_chain[i]))
        out.append({"bucket": list(bucket), "label": bucket_label(bucket), "answers": answers[i],
                    "drafted_positions": m.num_chains * k, "measured": m.to_dict(), "predicted": p.to_dict(),
                    "predicted_by_chain_context": c.to_dict(),
                    "relative_gap": (m.tau - p.tau) / p.tau if m.num_chains and p.num_chains else None})
    return {"k": k, "buckets": out}


def precision_section(rt, module, prompts, k, max_new, eos, batch, device) -> dict:
    """The prompts answered with the drafter at k against the target as loaded and with its
    layer matrices rounded by each scheme of inference/quantize.py."""
    from inference.quantize import SCHEMES, restore_, round_target_
    from models.acceptance import Acceptance

    out, base = {}, None
    for scheme in ("as loaded", *SCHEMES):
        saved = round_target_(rt, scheme) if scheme != "as loaded" else None
        try:
            records = measure_acceptance(rt, module, prompts, k, max_new, eos, batch, device)
        finally:
            if saved is not None:
                restore_(rt, saved)
        acc = Acceptance.from_histogram([sum(col) for col in zip(*(h for _, _, h in records))])
        answers = [a for _, a, _ in records]
        base = base or (acc, answers)
        out[scheme] = {**acc.to_dict(), "tau_vs_loaded": acc.tau / base[0].tau,
                       "a_minus_loaded": [x - y for x, y in zip(acc.a, base[0].a)],
                       "answers_equal_loaded": sum(x == y for x, y in zip(answers, base[1])), "answers": len(answers)}
        print(f"precision {scheme:10s} tau {acc.tau:.3f} ({acc.tau / base[0].tau - 1:+.1%} against as loaded)", flush=True)
    return {"k": k, "schemes": out}
