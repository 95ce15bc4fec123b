"""Emission of a verified step into the device loop's state, one launch instead of about twenty;
and `feed`, the next verify step's input (a chain's or a tree's), one launch instead of six.

    drafts [B,k] (target ids; -1 in empty slots), accepted [B] in 0..k, bonus [B],
    eos [E] end-of-sequence ids, budget [1] (max new tokens)
    state, updated in place: tokens [B,S], length [B], n_out [B], done [B] bool,
    histogram [B,k+1], row_steps [B]

Row b (when not done) appends its first `accepted` drafts and then the bonus token at
tokens[b, length:], cut after the first end-of-sequence token and at the budget; counts its
accepted length in the histogram and the step in row_steps; is done once it has emitted an
end-of-sequence token or `budget` tokens. A done row is left as it is. Writes stay inside
[length, length + k] of the row, which the caller's cache size leaves room for.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


class EmitState(NamedTuple):
    """The device loop's per-row state that `emit` updates (shapes above); active_out [B] bool
    or None (see `emit`)."""
    eos: torch.Tensor
    budget: torch.Tensor
    tokens: torch.Tensor
    length: torch.Tensor
    n_out: torch.Tensor
    done: torch.Tensor
    histogram: torch.Tensor
    row_steps: torch.Tensor
    active_out: torch.Tensor | None = None

    def check(self):
        """The kernels' layout: unit steps along the tokens' and histogram's rows, the rest contiguous."""
        for name in ("tokens", "histogram"):
            if getattr(self, name).stride(-1) != 1:
                raise ValueError(f"{name} needs a contiguous last dimension")
        per_row = (self.eos, self.budget, self.length, self.n_out, self.done, self.row_steps, self.active_out)
        if not all(t.is_contiguous() for t in per_row if t is not None):
            raise ValueError("the per-row state tensors must be contiguous")


class Feed(NamedTuple):
    """The verify step's input and what it is made from: the loop's tokens [B,S] and length [B]
    (read), fed and positions [B,q+1] (written: each row's last token at length - 1, then the
    drafts). A tree's rerank writes it as an epilogue (kernels/tree_select.py `finalize_triton`)."""
    tokens: torch.Tensor
    length: torch.Tensor
    fed: torch.Tensor
    positions: torch.Tensor


def feed_reference(tokens, length, drafts, fed, positions, draft_positions=None):
    """The verify step's input: each row's last token, then its drafts (an empty slot, -1, fed as
    token 0), at positions length-1 .. length-1+k, or length-1 and then `draft_positions`
    [B,k] (a tree's nodes sit at their depth). tokens [B,S], length [B], drafts [B,k] →
    fed, positions [B,k+1], written in place."""
    last = (length - 1)[:, None]
    fed.copy_(torch.cat([tokens.gather(1, last), drafts.clamp_min(0)], 1))
    if draft_positions is None:
        positions.copy_(last + torch.arange(drafts.shape[1] + 1, device=drafts.device))
    else:
        positions.copy_(torch.cat([last, draft_positions], 1))


def emit_reference(drafts, accepted, bonus, eos, budget, tokens, length, n_out, done, histogram, row_steps,
                   active_out=None):
    B, k = drafts.shape
    columns = torch.arange(k + 1, device=drafts.device)
    active = ~done
    emitted = torch.cat([drafts.clamp_min(0), bonus[:, None]], 1).scatter(1, accepted[:, None], bonus[:, None])
    n_new = accepted + 1
    is_eos = (emitted[:, :, None] == eos).any(-1) & (columns < n_new[:, None])  # [B,k+1]
    first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1), k + 1)
    n_new = torch.minimum(torch.minimum(n_new, first_eos + 1), budget - n_out)
    n_new = torch.where(active, n_new, 0)
    write = length[:, None] + columns
    tokens.scatter_(1, write, torch.where(columns < n_new[:, None], emitted, tokens.gather(1, write)))
    histogram.scatter_add_(1, accepted[:, None], active.long()[:, None])
    row_steps.add_(active.long())
    length.add_(n_new)
    n_out.add_(n_new)
    done.logical_or_(active & ((n_out >= budget) | (first_eos < n_new)))
    if active_out is not None:
        active_out.copy_(~done)


if triton is not None:

    @triton.jit
    def emit_row(row, j, draft, accepted, bonus, K, E, eos_ptr, budget_ptr, tokens_ptr, length_ptr, n_out_ptr, done_ptr,
                 histogram_ptr, row_steps_ptr, active_ptr, stride_t, stride_h, HAS_ACTIVE: tl.constexpr):
        """Row `row`'s emission: lanes j [BLOCK] (BLOCK >= K + 1) are its new tokens, `draft`
        [BLOCK] its drafts by lane (read below K only), `accepted` of them kept, then `bonus`.
        HAS_ACTIVE: also store whether the row is still running (not done) after the step. Also
        the tree's bookkeeping kernel's last part (kernels/tree_accept.py), on its accepted path."""
        if HAS_ACTIVE:  # a done row stays done; a running one is overwritten below when it finishes
            tl.store(active_ptr + row, (tl.load(done_ptr + row) == 0).to(tl.int1))
        if tl.load(done_ptr + row) == 0:
            token = tl.where(j == accepted, bonus, tl.maximum(draft, 0))  # [BLOCK]
            n_new = accepted + 1
            is_eos = tl.zeros(j.shape, tl.int1)
            for e in range(0, E):
                is_eos = is_eos | (token == tl.load(eos_ptr + e))
            is_eos = is_eos & (j < n_new)
            first_eos = tl.min(tl.where(is_eos, j, K + 1), 0)
            n_out = tl.load(n_out_ptr + row)
            budget = tl.load(budget_ptr)
            n_new = tl.minimum(tl.minimum(n_new, first_eos + 1), budget - n_out)
            length = tl.load(length_ptr + row)
            tl.store(tokens_ptr + row * stride_t + length + j, token, mask=j < n_new)
            hist = histogram_ptr + row * stride_h + accepted
            tl.store(hist, tl.load(hist) + 1)
            tl.store(row_steps_ptr + row, tl.load(row_steps_ptr + row) + 1)
            tl.store(length_ptr + row, length + n_new)
            tl.store(n_out_ptr + row, n_out + n_new)
            finished = (n_out + n_new >= budget) | (first_eos < n_new)
            tl.store(done_ptr + row, finished.to(tl.int1))
            if HAS_ACTIVE:
                tl.store(active_ptr + row, (~finished).to(tl.int1))

    @triton.jit
    def _emit_kernel(drafts_ptr, accepted_ptr, bonus_ptr, eos_ptr, budget_ptr, tokens_ptr, length_ptr, n_out_ptr,
                     done_ptr, histogram_ptr, row_steps_ptr, active_ptr, K, E, stride_d, stride_t, stride_h,
                     BLOCK: tl.constexpr, HAS_ACTIVE: tl.constexpr):
        """One program per row (`emit_row`); BLOCK >= k+1 lanes, lane j is the row's j-th new token."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        draft = tl.load(drafts_ptr + row * stride_d + j, mask=j < K, other=0)
        emit_row(row, j, draft, tl.load(accepted_ptr + row), tl.load(bonus_ptr + row), K, E, eos_ptr, budget_ptr,
                 tokens_ptr, length_ptr, n_out_ptr, done_ptr, histogram_ptr, row_steps_ptr, active_ptr, stride_t,
                 stride_h, HAS_ACTIVE)


if triton is not None:

    @triton.jit
    def _feed_kernel(tokens_ptr, length_ptr, drafts_ptr, fed_ptr, positions_ptr, dpos_ptr, K, stride_t, stride_d,
                     stride_f, stride_p, stride_dp, BLOCK: tl.constexpr, DRAFT_POSITIONS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        last = tl.load(length_ptr + row) - 1
        is_draft = (j >= 1) & (j <= K)
        draft = tl.load(drafts_ptr + row * stride_d + j - 1, mask=is_draft, other=0)
        token = tl.where(j == 0, tl.load(tokens_ptr + row * stride_t + last), tl.maximum(draft, 0))
        tl.store(fed_ptr + row * stride_f + j, token, mask=j <= K)
        if DRAFT_POSITIONS:
            position = tl.where(j == 0, last, tl.load(dpos_ptr + row * stride_dp + j - 1, mask=is_draft, other=0))
        else:
            position = last + j
        tl.store(positions_ptr + row * stride_p + j, position, mask=j <= K)


def feed_triton(tokens, length, drafts, fed, positions, draft_positions=None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, k = drafts.shape
    drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()  # the kernel reads unit steps
    if any(t.stride(-1) != 1 for t in (tokens, fed, positions)) or not length.is_contiguous():
        raise ValueError("feed: tokens, fed and positions need a contiguous last dimension, length contiguity")
    if draft_positions is not None and draft_positions.shape != drafts.shape:
        raise ValueError(f"feed: draft positions {tuple(draft_positions.shape)} for drafts {tuple(drafts.shape)}")
    dpos = drafts if draft_positions is None else draft_positions.contiguous()  # (unread without positions)
    if B:
        _feed_kernel[(B,)](tokens, length, drafts, fed, positions, dpos, k, tokens.stride(0), max(drafts.stride(0), 1),
                           fed.stride(0), positions.stride(0), max(dpos.stride(0), 1),
                           BLOCK=triton.next_power_of_2(k + 1), DRAFT_POSITIONS=draft_positions is not None)


def feed(tokens, length, drafts, fed, positions, draft_positions=None):
    """The kernel on CUDA tensors, the reference elsewhere."""
    from draftsmith_kernels.dispatch import use_kernel

    (feed_triton if use_kernel(tokens) else feed_reference)(tokens, length, drafts, fed, positions, draft_positions)


def emit_triton(drafts, accepted, bonus, eos, budget, tokens, length, n_out, done, histogram, row_steps,
                active_out=None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, k = drafts.shape
    if drafts.stride(-1) != 1:  # (a tree's path tokens may be a view)
        drafts = drafts.contiguous()
    EmitState(eos, budget, tokens, length, n_out, done, histogram, row_steps, active_out).check()
    if not (accepted.is_contiguous() and bonus.is_contiguous()):
        raise ValueError("the per-row state tensors must be contiguous")
    if B:
        _emit_kernel[(B,)](drafts, accepted, bonus, eos, budget, tokens, length, n_out, done, histogram, row_steps,
                           done if active_out is None else active_out, k, eos.numel(), max(drafts.stride(0), 1),
                           tokens.stride(0), histogram.stride(0), BLOCK=triton.next_power_of_2(k + 1),
                           HAS_ACTIVE=active_out is not None)


def emit(drafts, accepted, bonus, eos, budget, tokens, length, n_out, done, histogram, row_steps, active_out=None):
    """The kernel on CUDA tensors, the reference elsewhere.
    active_out [B] bool (optional): set to ~done after the step, for the launches that follow (the
    proposer's advance, the next verify's bookkeeping), which then need no `~done` of their own."""
    from draftsmith_kernels.dispatch import use_kernel

    fn = emit_triton if use_kernel(tokens) else emit_reference
    fn(drafts, accepted, bonus, eos, budget, tokens, length, n_out, done, histogram, row_steps, active_out)
