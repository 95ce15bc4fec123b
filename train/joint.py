"""Joint training of the target with its heads (Medusa-2, joint MTP): the target's own losses.

Small pure functions over the target's final hidden state and its head, computed in row
chunks so that no [B, T, V] float32 logits tensor is built whole.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(hidden, head_weight, ids, loss_mask, chunk_rows: int = 2048):
    """Next-token cross-entropy of the target on loss-masked tokens (mean over them).

    hidden [B,T,H] (final normed), head_weight [V,H], ids / loss_mask [B,T]: the logits at t
    are scored against x_{t+1} where loss_mask[t+1]."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = ids[:, 1:].reshape(-1)
    mask = loss_mask[:, 1:].reshape(-1).bool()
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        if mask[sl].any():
            logits = F.linear(h[sl], head_weight).float()
            total = total + (F.cross_entropy(logits, labels[sl], reduction="none") * mask[sl]).sum()
    return total / mask.sum().clamp_min(1)


def keep_close_kl(hidden, original_hidden, head_weight, original_head_weight, loss_mask, chunk_rows: int = 2048):
    """KL(original target || current target) over the full vocabulary, on loss-masked
    positions (mean over them): what keeps a jointly trained target's outputs where they were."""
    h = hidden.reshape(-1, hidden.shape[-1])
    h0 = original_hidden.reshape(-1, original_hidden.shape[-1])
    mask = loss_mask.reshape(-1).bool()
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        if mask[sl].any():
            log_q = torch.log_softmax(F.linear(h[sl], head_weight).float(), -1)
            with torch.no_grad():
                log_p = torch.log_softmax(F.linear(h0[sl], original_head_weight).float(), -1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            total = total + (kl * mask[sl]).sum()
    return total / mask.sum().clamp_min(1)


@torch.no_grad()
def heldout_perplexity(target, batches) -> float:
    """exp(mean next-token cross-entropy) of the target on the answers of held-out batches."""
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = batch["input_ids"], batch["loss_mask"]
        device = next(target.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        out = target(ids)
        n = int(mask[:, 1:].sum())
        total += float(lm_loss(out.last_hidden, target.head_weight, ids, mask)) * n
        count += n
    return float(torch.exp(torch.tensor(total / max(count, 1))))
