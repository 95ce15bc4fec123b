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
