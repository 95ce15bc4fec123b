"""A hybrid target's recurrent-state rollback after verification, in one launch with no host sync.

    state_rollback: states [B, P, S] (or [B, P, ...]: flattened to S), n_acc [B] integer, out [B, S]
        → out[b] = states[b, n_acc[b]]

Index convention: a verify step feeds a row P = k + 1 tokens, fed[b, 0] (the last token already
decided: the previous step's bonus) then the k drafts fed[b, 1..k]; states[b, j] is the row's
recurrent state (every recurrent layer's conv and SSM states, flattened and side by side) AFTER
consuming fed[b, j]. With n_acc[b] = a drafts accepted (0 <= a <= k), the tokens that stay are
fed[b, 0..a], so the state to continue from is states[b, a]; the bonus token is fed next step.
n_acc stays on the device: each program reads its row's count itself (vLLM's
`postprocess_mamba_fused_kernel` does the same for its Mamba slots), so the step needs no
`.item()` and can sit inside a captured graph. A count outside [0, P) is clamped into it (the
reference does the same), so a stray value can never read another row's memory.

Why a kernel: the torch form is an index build, a gather and a copy (three launches, one reading
every position's state into a temporary); here each program copies one tile of one row once.
"""
from __future__ import annotations

import torch

from draftsmith_kernels.dispatch import INTERPRETED, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _flat(states, out):
    B, P = states.shape[:2]
    flat = states.reshape(B, P, -1)
    if out.shape[0] != B or out[0].numel() != flat.shape[2]:
        raise ValueError(f"state_rollback: states {tuple(states.shape)} and out {tuple(out.shape)}: out must be "
                         f"[B, ...] with the states' per-position size")
    return flat, out.view(B, -1)


def state_rollback_reference(states, n_acc, out):
    """out[b] = states[b, clamp(n_acc[b], 0, P - 1)]; written in place, returned."""
    flat, target = _flat(states, out)
    pick = n_acc.long().clamp(0, flat.shape[1] - 1)
    target.copy_(flat.gather(1, pick[:, None, None].expand(-1, 1, flat.shape[2]))[:, 0])
    return out


if triton is not None:

    @triton.jit
    def _state_rollback_kernel(states_ptr, n_acc_ptr, out_ptr, P, S, stride_b, stride_p, stride_out,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < S
        a = tl.load(n_acc_ptr + row).to(tl.int64)
        a = tl.minimum(tl.maximum(a, 0), P - 1)
        x = tl.load(states_ptr + row * stride_b + a * stride_p + cols, mask=inside)
        tl.store(out_ptr + row * stride_out + cols, x.to(out_ptr.dtype.element_ty), mask=inside)


def state_rollback_triton(states, n_acc, out, block=None):
    if triton is None:
        raise RuntimeError("triton is not installed")
    B, P = states.shape[:2]
    if n_acc.shape != (B,):
        raise ValueError(f"state_rollback: n_acc {tuple(n_acc.shape)} for {B} rows: need [B]")
    flat, target = _flat(states, out)
    if flat.stride(2) != 1 or target.stride(1) != 1:
        raise ValueError("state_rollback: states and out need a unit stride along their flattened state")
    S = flat.shape[2]
    n_acc = n_acc.contiguous()
    # the interpreter's cost is per program: wide tiles there; 1,024 elements a program on a GPU
    block = block or (triton.next_power_of_2(max(S, 1)) if INTERPRETED else min(1024, triton.next_power_of_2(S)))
    if B and S:
        _state_rollback_kernel[(B, triton.cdiv(S, block))](flat, n_acc, target, P, S, flat.stride(0), flat.stride(1),
                                                           target.stride(0), BLOCK=block)
    return out


def state_rollback(states, n_acc, out):
    """The kernel on CUDA tensors, the reference elsewhere (kernels/dispatch.py)."""
    return (state_rollback_triton if use_kernel(states) else state_rollback_reference)(states, n_acc, out)
