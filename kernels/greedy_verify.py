"""Greedy verification in two launches: argmax chunks over the vocabulary at each of the k+1
verified positions (kernels/argmax.py), then per row the merged choices, the leading matches
against the drafts and the bonus token.

    drafts [B,k] int64 (target ids; -1 where a proposer left a slot empty)
    logits [B,k+1,V] (the target's logits after the last verified token and after each draft)
    → accepted [B] in 0..k, bonus [B]: the target's token after the accepted prefix

Ties in the argmax go to the lowest token id, as torch.argmax does.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def greedy_verify_reference(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    choice = logits.argmax(-1)  # [B,k+1]
    k = drafts.shape[1]
    accepted = (drafts == choice[:, :k]).long().cumprod(1).sum(1) if k else torch.zeros_like(choice[:, 0])
    bonus = choice.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


if triton is not None:
    from draftsmith_kernels.argmax import argmax_chunks, merge_chunks

    @triton.jit
    def _accept_kernel(best_ptr, index_ptr, drafts_ptr, accepted_ptr, bonus_ptr, K, stride_d, NSPLIT,
                       BLOCK_S: tl.constexpr):
        """One program per row: the target's choice at each position (merged from the argmax
        chunks), leading drafts equal to those choices, then the bonus."""
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int64)
        bonus = tl.zeros([], tl.int64)
        for j in range(0, K + 1):
            idx = merge_chunks(best_ptr, index_ptr, row * (K + 1) + j, NSPLIT, BLOCK_S)
            has_draft = j < K
            d = tl.load(drafts_ptr + row * stride_d + j, mask=has_draft, other=-1)
            match = (d == idx) & has_draft
            bonus = tl.where((alive == 1) & (~match), idx, bonus)
            acc += tl.where((alive == 1) & match, 1, 0)
            alive = tl.where(match, alive, 0)
        tl.store(accepted_ptr + row, acc)
        tl.store(bonus_ptr + row, bonus)


def greedy_verify_triton(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches: argmax chunks of every (row, position) in parallel (kernels/argmax.py),
    then the per-row merge and acceptance scan."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, q, V = logits.shape
    k = drafts.shape[1]
    if q != k + 1:
        raise ValueError(f"logits have {q} positions for {k} drafts (need k+1)")
    drafts = drafts.contiguous()
    accepted = torch.empty(B, dtype=torch.long, device=logits.device)
    bonus = torch.empty(B, dtype=torch.long, device=logits.device)
    if B:
        best, index, nsplit = argmax_chunks(logits.reshape(B * q, V))
        _accept_kernel[(B,)](best, index, drafts, accepted, bonus, k, max(drafts.stride(0), 1), nsplit,
                             BLOCK_S=triton.next_power_of_2(nsplit))
    return accepted, bonus


def greedy_verify(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA tensors, the reference elsewhere."""
    from draftsmith_kernels.dispatch import use_kernel

    if use_kernel(logits):
        return greedy_verify_triton(drafts, logits)
    return greedy_verify_reference(drafts, logits)
