"""Acceptance: one definition, used by training (predicted) and the runtime (measured).

For a chain of k drafts, a_i = P(draft i accepted | drafts 1..i-1 accepted) and
tau = 1 + sum_i prod_{j<=i} a_j (accepted drafts plus the bonus token; plain decoding = 1).
Everything is computed from the histogram of accepted lengths, so counts from many batches,
ranks or requests simply add.
"""
from __future__ import annotations

import torch


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
    """{'a': [a_1..a_k], 'tau': float, 'num_chains': int, 'histogram': [...]}."""
    hist = torch.as_tensor(hist, dtype=torch.float64)
    k = hist.numel() - 1
    n = hist.sum().item()
    at_least = hist.flip(0).cumsum(0).flip(0)  # at_least[i] = #chains with >= i accepted
    a = [(at_least[i] / at_least[i - 1]).item() if at_least[i - 1] > 0 else 0.0 for i in range(1, k + 1)]
    tau = 1.0 + (at_least[1:].sum() / n).item() if n else 1.0
    return {"a": a, "tau": tau, "num_chains": int(n), "histogram": [int(x) for x in hist.tolist()]}


@torch.no_grad()
def predicted_histogram(target, drafter, ids, loss_mask, lengths, k: int, anchors_per_sequence: int,
                        features=None, greedy=None) -> torch.Tensor:
    """Accepted-length histogram of greedy k-chains drafted exactly as a runtime drafts.

    ids, loss_mask [B,T], lengths [B]. Chains start at anchors a whose bonus token x_{a+1} is
    loss-masked (answer) text, evenly spaced, at most `anchors_per_sequence` per row; draft i
    is judged against the target's full-vocabulary argmax given x_0..x_{a+1} and drafts
    1..i-1 (`target.greedy_after_chains`). `features` (what the drafter reads) and `greedy`
    may come from a target pass the caller already made. Used by training (held-out data) and
    validation (replaying answers).
    """
    if features is None or greedy is None:
        out = target(ids)
        features = drafter.features(out)
        _, greedy = target.head_outputs(out.last_hidden)
    blockwise = hasattr(drafter, "draft_at")  # DFlash drafts a whole block per anchor
    if not blockwise:
        draft_ids = drafter.draft_ids()
        steps = drafter.unroll(ids, features, k, greedy=True)  # k x [B,T,Vd]
        drafts = torch.stack([draft_ids[logits.argmax(-1)] for logits in steps], dim=2)  # [B,T,k] target ids
    hist = torch.zeros(k + 1, dtype=torch.long)
    for b in range(ids.shape[0]):
        n = int(lengths[b])
        candidates = torch.nonzero(loss_mask[b, 1:n]).flatten()  # a with x_{a+1} answer text
        if candidates.numel() == 0:
            continue
        m = min(anchors_per_sequence, candidates.numel())
        pick = torch.linspace(0, candidates.numel() - 1, m, device=ids.device).round().long()
        anchors = candidates[pick]
        chain = drafter.draft_at(ids[b, :n], features[b, :n], anchors, k) if blockwise else drafts[b, anchors]  # [m, k]
        choice = torch.empty_like(chain)
        choice[:, 0] = greedy[b, anchors + 1]
        if k > 1:
            choice[:, 1:] = target.greedy_after_chains(ids[b, :n], anchors, chain[:, : k - 1])
        hist += length_histogram(accepted_lengths(chain, choice), k)
    return hist
