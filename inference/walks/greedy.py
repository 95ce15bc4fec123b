"""Acceptance: one walk, used by training (predicted) and validation (replayed), measured the
way the runtime drafts. The definition of a_i and tau, and the types that carry them, are
models/acceptance.py's.
"""
from __future__ import annotations

from itertools import accumulate, islice

import torch

from models.acceptance import Acceptance
from models.methods import predictor_of


def accepted_lengths(drafts: torch.Tensor, target_choice: torch.Tensor) -> torch.Tensor:
    """Leading matches per chain. drafts, target_choice [N, k] → [N] in 0..k.

    target_choice[:, i] is the target's token at the position of draft i (greedy: its argmax
    over the full vocabulary given the context and drafts 1..i-1).
    """
    match = (drafts == target_choice).long()
    return match.cumprod(dim=1).sum(dim=1)


def length_histogram(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[k+1] int64 counts of accepted lengths 0..k."""
    return torch.bincount(lengths.long().flatten().cpu(), minlength=k + 1)[: k + 1]


def acceptance_from_histogram(hist) -> dict:
    """{'a': [a_1..a_k], 'tau': float, 'num_chains': int, 'histogram': [...]} from counts [k+1]:
    the JSON view of models.acceptance.Acceptance.from_histogram (the runtime's stats and bench
    rows print it)."""
    return Acceptance.from_histogram(hist).to_dict()


def cap_answer_spans(loss_mask: torch.Tensor, max_new_tokens: int | None) -> torch.Tensor:
    """[B,T] answer mask → the same with every answer span (a run of answer tokens) cut to its
    first `max_new_tokens` tokens: the answers a server that stops there would have served
    (None: unchanged). The walks then start and end chains exactly as for served answers."""
    if max_new_tokens is None:
        return loss_mask
    answer = loss_mask.bool()
    index = torch.arange(answer.shape[1], device=answer.device).expand_as(answer)
    opens = answer & ~torch.nn.functional.pad(answer, (1, 0))[:, :-1]  # first token of a span
    span_start = torch.where(opens, index, 0).cummax(1).values  # [B,T] where the current span opened
    return (answer & (index - span_start < max_new_tokens)).to(loss_mask.dtype)


@torch.no_grad()
def predicted_histogram(target, drafter, ids, loss_mask, lengths, k: int, anchors_per_sequence: int | None,
                        features=None, greedy=None, window: int = 128, per_turn: bool = False,
                        on_chain=None, verify_width=None) -> torch.Tensor:
    """Accepted-length histogram [k+1] of greedy k-chains drafted exactly as a runtime drafts, at
    the places a runtime drafts them. per_turn: [2, k+1] instead, chains in each row's first
    answer span, then in its later ones (follow-up turns, which answer after the target's own
    first answer and can be far easier to draft: served sets weigh them differently).

    ids, loss_mask [B,T], lengths [B]. A chain at anchor a continues x_0..x_{a+1} (x_{a+1}, its
    last token, is answer text); draft i is judged against the target's full-vocabulary argmax
    given x_0..x_{a+1} and drafts 1..i-1. Anchors follow serving: each answer span is walked
    from its first token, and after n accepted drafts the next chain starts n + 1 tokens on
    (the bonus token), until the span's last token or `anchors_per_sequence` chains per row
    (None: every answer span whole).
    Why not evenly spaced anchors: serving starts chains right after a rejection, and where a
    drafter is right one chain covers k + 1 tokens, so per-chain acceptance is lower than at
    average positions (measured: 3.83 at evenly spaced anchors against 3.09 served, same text).
    On the target's own greedy answers the walk is exactly what the runtime does.

    `features` (what the drafter reads) and `greedy` may come from a target pass the caller
    already made. Used by training (held-out data) and validation (replaying served answers).
    on_chain(row, anchor, in_a_later_span, accepted), when given, sees every chain walked
    (scripts/acceptance_by_offset.py).
    verify_width(confidence [m,k]) → [m], when given: adaptive verification (a drafter with a
    confidence head, `draft_block`: DSpark): each chain verifies only its first width drafts,
    so it accepts min(L, width) (`chain_widths` makes it from a step-cost table).
    """
    if features is None or greedy is None:
        out = target(ids)
        features = drafter.features(out)
        _, greedy = target.head_outputs(out.last_hidden)
    blockwise = predictor_of(drafter) == "block"  # DFlash drafts a whole block per anchor
    if not blockwise:
        draft_ids = drafter.draft_ids()
        steps = drafter.unroll(ids, features, k, greedy=True)  # k x [B,T,Vd]
        drafts = torch.stack([draft_ids[logits.argmax(-1)] for logits in steps], dim=2)  # [B,T,k] target ids
    hist = torch.zeros(2, k + 1, dtype=torch.long)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        answer = loss_mask[b, :n].bool().tolist()

        def measure(window_anchors):
            anchors = torch.as_tensor(window_anchors, device=ids.device)
            width = None
            if verify_width is not None:
                chain, confidence = drafter.draft_block(ids[b, :n], features[b, :n], anchors, k)
                width = verify_width(confidence)
            else:
                chain = drafter.draft_at(ids[b, :n], features[b, :n], anchors, k) if blockwise else drafts[b, anchors]
            found = chain_lengths(ids[b, :n], greedy[b, :n], anchors, chain)
            graft = found < 0  # the text cannot judge these chains: graft them onto it
            if graft.any():
                choice = torch.empty_like(chain[graft])
                choice[:, 0] = greedy[b, anchors[graft] + 1]
                if k > 1:
                    choice[:, 1:] = target.greedy_after_chains(ids[b, :n], anchors[graft], chain[graft][:, : k - 1])
                found[graft] = accepted_lengths(chain[graft], choice)
            if width is not None:
                found = torch.minimum(found, width.to(found.device))
            return found.tolist()

        for anchor, later, accepted in walk_answer(answer, anchors_per_sequence, window, measure):
            hist[int(later), accepted] += 1
            if on_chain is not None:
                on_chain(b, anchor, later, accepted)
    return hist if per_turn else hist.sum(0)


def walk_answer(answer: list[bool], anchors_per_sequence: int | None, window: int, measure):
    """The serving walk over one text (`serving_walk`), its chains measured a window of anchors
    at a time, as the walk reaches them: measure(anchors: list[int]) → their accepted lengths
    (one batched drafter pass per window instead of one per chain). Yields (anchor, in a later
    answer span, accepted length) for each chain served."""
    lengths_at = {}

    def accepted_at(a):
        if a not in lengths_at:
            found = list(islice(anchorable_from(answer, a), window))
            lengths_at.update(zip(found, measure(found)))
        return lengths_at[a]

    for a, later in serving_walk(answer, anchors_per_sequence, accepted_at):
        yield a, later, lengths_at[a]


def window_for(anchors_per_sequence: int | None, k: int, largest: int) -> int:
    """Anchors to measure at once: `largest`, or fewer when a walk capped at anchors_per_sequence
    chains of at most k + 1 tokens reaches fewer (measuring past them is wasted)."""
    return min(largest, max(1, anchors_per_sequence * (k + 1))) if anchors_per_sequence else largest


def anchorable_from(answer: list[bool], a0: int):
    """Anchors a >= a0 that can start a chain: x_{a+1} is answer text and not its span's last
    token (serving stops after that token)."""
    n = len(answer)
    return (a for a in range(a0, n - 1) if answer[a + 1] and a + 2 < n and answer[a + 2])


def serving_walk(answer: list[bool], cap: int | None, accepted_at) -> list[tuple[int, bool]]:
    """The anchors a serving walk visits in one row, as [(anchor, in_a_later_span)].

    answer [n] marks answer text. Each span is walked from its first token; after
    `accepted_at(a)` accepted drafts the next chain starts that many + 1 tokens on (the bonus
    token), until the span's last token or `cap` chains (None: no cap). in_a_later_span: x_{a+1}
    is in the row's second or later answer span (a span at x_0 opened before any marker).
    """
    n = len(answer)
    anchorable = [answer[a + 1] and a + 2 < n and answer[a + 2] for a in range(n - 1)]
    span_start = [answer[a + 1] and not answer[a] for a in range(n - 1)]  # x_{a+1} opens a span
    later_span = [answer[0] + opened > 1 for opened in accumulate(span_start)]
    visits = []
    a = 0
    while a < n - 1 and (cap is None or len(visits) < cap):
        if not anchorable[a]:
            a += 1
            continue
        accepted = accepted_at(a)
        visits.append((a, later_span[a]))
        nxt = a + accepted + 1
        # the chain ran past its span (serving would have stopped there): on to the next span
        a = nxt if all(answer[a + 1 : min(nxt, n - 1) + 1]) else next(
            (s for s in range(a + 1, n - 1) if span_start[s]), n)
    return visits


def chain_lengths(ids: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """Accepted lengths of chains judged by the text alone, or -1 where the text cannot judge.

    ids, greedy [T] (greedy[t]: the target's argmax after x_0..x_t); anchors [m]; chains [m,k].
    While drafts 1..i-1 equal the text's x_{a+2..a+i}, the context of draft i is the text, so
    the target's choice is greedy[a+i]: no extra forward. That holds up to the first place
    where the text itself leaves the target's greedy path (human text), or the end of the
    text; a chain still matching there needs `greedy_after_chains` (-1 here). On the target's
    own greedy answers every chain is judged by the text.
    """
    T = ids.shape[0]
    m, k = chains.shape
    pos = anchors[:, None] + 1 + torch.arange(k, device=ids.device)  # [m,k]: the target predicts x_{pos+1}
    inside = pos + 1 < T
    choice = greedy[pos.clamp(max=T - 1)]
    text = ids[(pos + 1).clamp(max=T - 1)]
    match = (chains == choice) & inside
    on_text = (text == choice) & inside  # draft i's context is still the text after a match here
    length = match.long().cumprod(1).sum(1)
    # the matched run is judged by the text only if the text followed the target's greedy path
    # through it and the text goes on far enough to judge the draft after it
    text_run = on_text.long().cumprod(1).sum(1)
    judged = (length <= text_run) & ((length == k) | inside[torch.arange(m, device=ids.device), length.clamp(max=k - 1)])
    return torch.where(judged, length, torch.full_like(length, -1))


def chain_widths(step_ms: torch.Tensor, causal: bool = False):
    """Adaptive verification of one chain at a time (batch 1), as a walk's verify_width: each
    chain verifies the w in 1..k that maximises its expected tokens per millisecond,
    (1 + sum_{j<w} s_j) / step_ms[w], s the survival (cumulative product) of its confidences
    [m,k]; step_ms [k+1] the cost of a step verifying w drafts (inference.runtime.adaptive's
    step_ms_tensor at batch 1; its choose_width for one row). Ties go to the smaller width.
    causal: the rule the runtime follows for sampled drafts (choose_width(causal=True)): widen
    while one more draft raises the rate, stop at the first width where it does not."""
    def widths(confidence: torch.Tensor) -> torch.Tensor:
        s = confidence.float().clamp(0, 1).cumprod(-1)  # [m,k]
        rate = (1 + s.cumsum(-1)) / step_ms[1 : confidence.shape[1] + 1].to(s.device)  # [m,k]: w = 1..k
        if causal:
            return 1 + (rate[:, 1:] > rate[:, :-1]).long().cumprod(-1).sum(-1)  # [m]
        return rate.argmax(-1) + 1
    return widths
