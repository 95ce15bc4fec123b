"""Draft vocabulary: the Vd most frequent target tokens among loss-masked training tokens.

`d2t[i]` (int64 [Vd]) is the offset with target_id = i + d2t[i]; ids are sorted ascending so
the offsets are non-decreasing. `t2d` (bool [V]) marks the chosen target ids.
"""
from __future__ import annotations

import numpy as np
import torch


def count_tokens(input_ids_rows, loss_mask_rows, vocab_size: int) -> np.ndarray:
    """[V] int64 counts of tokens at loss-masked positions."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids_rows, loss_mask_rows):
        ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def check_draft_vocab(draft_vocab_size: int, vocab_size: int) -> None:
    """The draft head's Vd rows are a subset of the target's V tokens (d2t maps each to one)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size}")


def build_draft_vocab(counts, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool). Ties and unseen tokens are broken by lower target id,
    so the result is deterministic."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    V = counts.numel()
    check_draft_vocab(draft_vocab_size, V)
    # stable sort on -count keeps lower ids first among equal counts
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def register_maps(drafter: torch.nn.Module, cfg) -> None:
    """The maps as the drafter's buffers (in its state dict, so checkpoints and exports carry
    them): d2t [Vd] int64, t2d [V] bool, zeros until init_from_target copies the built ones."""
    drafter.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
    drafter.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of each draft-vocabulary row: r + d2t[r]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


@torch.no_grad()
def copy_from_target(drafter: torch.nn.Module, target_model, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """The start every drafter with a token embedding and one head shares: the built maps, the
    target's embedding [V, H] and its head rows of the draft vocabulary [Vd, H]."""
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
    drafter.lm_head.weight.copy_(target_model.get_output_embeddings().weight[drafter.draft_ids()])


def coverage(counts, t2d: torch.Tensor) -> float:
    """Fraction of loss-masked training tokens inside the draft vocabulary."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    total = counts.sum().item()
    return counts[t2d].sum().item() / total if total else 0.0
