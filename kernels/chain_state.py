"""An EAGLE drafter's bookkeeping between verify and the next chain, in two launches.

    advance_inputs: fed [B,q], bonus [B], accepted [B], last [B]
        → next_tokens [B,q] (fed[:, 1:], then the bonus; the bonus also replaces the first rejected
          draft, at column `accepted`) and positions [B,q] (last + 1 + j)
    keep_entry: out [B,q,H], positions [B,q], accepted [B], active [B] bool, hidden [B,H] and
        last [B] (updated in place), chain_positions [B,k] (written)
        → for active rows: hidden = out[:, accepted], last = positions[:, accepted]; for every row:
          chain_positions = last + 1 + j (the next chain's positions)

Why kernels: the torch form is a cat, a scatter and two adds before the drafter's step and two
gathers, two `where`s and two adds after it, ten launches of a few elements each; a chain step
is bound by its launches (inference/proposers/drafters.py, `Eagle3Proposer.advance`).
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def advance_inputs_reference(fed, bonus, accepted, last):
    nxt = torch.cat([fed[:, 1:], bonus[:, None]], 1).scatter(1, accepted[:, None], bonus[:, None])
    positions = (last + 1)[:, None] + torch.arange(fed.shape[1], device=fed.device)
    return nxt, positions


def keep_entry_reference(out, positions, accepted, active, hidden, last, chain_positions):
    pick = accepted[:, None]
    chosen = out.gather(1, pick[..., None].expand(-1, 1, out.shape[-1]))[:, 0]
    torch.where(active[:, None], chosen.to(hidden.dtype), hidden, out=hidden)
    torch.where(active, positions.gather(1, pick)[:, 0], last, out=last)
    chain_positions.copy_(last[:, None] + 1 + torch.arange(chain_positions.shape[1], device=last.device))


if triton is not None:

    @triton.jit
    def _advance_inputs_kernel(fed_ptr, bonus_ptr, accepted_ptr, last_ptr, nxt_ptr, pos_ptr, Q, stride_fed,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        inside = j < Q
        bonus = tl.load(bonus_ptr + row)
        shifted = tl.load(fed_ptr + row * stride_fed + j + 1, mask=j + 1 < Q, other=0)
        nxt = tl.where((j == Q - 1) | (j == tl.load(accepted_ptr + row)), bonus, shifted)
        tl.store(nxt_ptr + row * Q + j, nxt, mask=inside)
        tl.store(pos_ptr + row * Q + j, tl.load(last_ptr + row) + 1 + j, mask=inside)

    @triton.jit
    def _keep_entry_kernel(out_ptr, pos_ptr, accepted_ptr, active_ptr, hidden_ptr, last_ptr, chain_ptr, H, K,
                           stride_ob, stride_oq, stride_pos, stride_hidden, stride_chain,
                           BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        a = tl.load(accepted_ptr + row)
        active = tl.load(active_ptr + row) != 0
        last = tl.load(last_ptr + row)
        if active:
            last = tl.load(pos_ptr + row * stride_pos + a)
            tl.store(last_ptr + row, last)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                x = tl.load(out_ptr + row * stride_ob + a * stride_oq + cols, mask=cols < H)
                tl.store(hidden_ptr + row * stride_hidden + cols, x.to(hidden_ptr.dtype.element_ty), mask=cols < H)
        j = tl.arange(0, BLOCK_K)
        tl.store(chain_ptr + row * stride_chain + j, last + 1 + j, mask=j < K)


def advance_inputs_triton(fed, bonus, accepted, last):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, q = fed.shape
    if bonus.shape != (B,) or accepted.shape != (B,) or last.shape != (B,):
        raise ValueError(f"advance_inputs: fed {tuple(fed.shape)} with bonus {tuple(bonus.shape)}, accepted "
                         f"{tuple(accepted.shape)}, last {tuple(last.shape)}: need [B,q] and three [B]")
    # per-row inputs are read at row offsets: a strided view (a column of a bigger tensor) is copied
    fed, bonus, accepted, last = (t.contiguous() for t in (fed, bonus, accepted, last))
    nxt = torch.empty(B, q, dtype=fed.dtype, device=fed.device)
    positions = torch.empty(B, q, dtype=last.dtype, device=fed.device)
    if B:
        _advance_inputs_kernel[(B,)](fed, bonus, accepted, last, nxt, positions, q, fed.stride(0),
                                     BLOCK=triton.next_power_of_2(q))
    return nxt, positions


def keep_entry_triton(out, positions, accepted, active, hidden, last, chain_positions):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, q, H = out.shape
    K = chain_positions.shape[1]
    if positions.shape != (B, q) or hidden.shape != (B, H) or last.shape != (B,) or chain_positions.shape[0] != B:
        raise ValueError(f"keep_entry: out {tuple(out.shape)}, positions {tuple(positions.shape)}, hidden "
                         f"{tuple(hidden.shape)}, last {tuple(last.shape)}, chain {tuple(chain_positions.shape)}")
    if out.stride(-1) != 1 or hidden.stride(-1) != 1 or positions.stride(-1) != 1 or chain_positions.stride(-1) != 1:
        raise ValueError("keep_entry: every tensor needs a unit stride along its last dimension")
    if not last.is_contiguous():  # updated in place: a copy would lose the update
        raise ValueError("keep_entry: last must be contiguous (it is updated in place)")
    accepted, active = accepted.contiguous(), active.contiguous()
    if B:
        _keep_entry_kernel[(B,)](out, positions, accepted, active, hidden, last, chain_positions, H, K,
                                 out.stride(0), out.stride(1), positions.stride(0), hidden.stride(0),
                                 chain_positions.stride(0), BLOCK_H=min(1024, triton.next_power_of_2(H)),
                                 BLOCK_K=triton.next_power_of_2(K))
    return hidden, last


def advance_inputs(fed, bonus, accepted, last):
    """The kernel on CUDA tensors, the reference elsewhere."""
    return (advance_inputs_triton if use_kernel(fed) else advance_inputs_reference)(fed, bonus, accepted, last)


def keep_entry(out, positions, accepted, active, hidden, last, chain_positions):
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = keep_entry_triton if use_kernel(out) else keep_entry_reference
    return fn(out, positions, accepted, active, hidden, last, chain_positions)
