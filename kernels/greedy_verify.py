"""Greedy verification in two launches: argmax over the vocabulary at each of the k+1 verified
positions (one program per position), then leading matches against the drafts and the bonus
token (one program per row).

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

    @triton.jit
    def _argmax_kernel(logits_ptr, choice_ptr, V, Q, stride_b, stride_q, BLOCK: tl.constexpr):
        """One program per (row, position): the first index of the maximum."""
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        base = logits_ptr + b * stride_b + j * stride_q
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            better = x > best  # strict: each lane keeps its first maximum
            best = tl.where(better, x, best)
            best_idx = tl.where(better, cols.to(tl.int64), best_idx)
        m = tl.max(best, 0)
        tl.store(choice_ptr + b * Q + j, tl.min(tl.where(best == m, best_idx, V), 0))  # first occurrence

    @triton.jit
    def _accept_kernel(choice_ptr, drafts_ptr, accepted_ptr, bonus_ptr, K, stride_d):
        """One program per row: leading drafts equal to the target's choices, then the bonus."""
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int64)
        bonus = tl.zeros([], tl.int64)
        for j in range(0, K + 1):
            idx = tl.load(choice_ptr + row * (K + 1) + j)
            has_draft = j < K
            d = tl.load(drafts_ptr + row * stride_d + j, mask=has_draft, other=-1)
            match = (d == idx) & has_draft
            bonus = tl.where((alive == 1) & (~match), idx, bonus)
            acc += tl.where((alive == 1) & match, 1, 0)
            alive = tl.where(match, alive, 0)
        tl.store(accepted_ptr + row, acc)
        tl.store(bonus_ptr + row, bonus)


def greedy_verify_triton(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches: argmax per (row, position) in parallel, then the per-row acceptance scan."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, q, V = logits.shape
    k = drafts.shape[1]
    if q != k + 1:
        raise ValueError(f"logits have {q} positions for {k} drafts (need k+1)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    drafts = drafts.contiguous()
    choice = torch.empty(B, q, dtype=torch.long, device=logits.device)
    accepted = torch.empty(B, dtype=torch.long, device=logits.device)
    bonus = torch.empty(B, dtype=torch.long, device=logits.device)
    if B:
        _argmax_kernel[(B, q)](logits, choice, V, q, logits.stride(0), logits.stride(1),
                               BLOCK=min(4096, triton.next_power_of_2(V)))
        _accept_kernel[(B,)](choice, drafts, accepted, bonus, k, max(drafts.stride(0), 1))
    return accepted, bonus


def greedy_verify(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA tensors, the reference elsewhere."""
    from kernels import use_kernel

    if use_kernel(logits):
        return greedy_verify_triton(drafts, logits)
    return greedy_verify_reference(drafts, logits)
