"""A drafter's greedy head in two launches: final RMSNorm, lm_head and argmax (mapped to target ids).

    hidden [R,H], norm_weight [H], weight [V,H] (lm_head, no bias), ids [V] int64 or None,
    out [R] int64 (any stride) → out[r] = ids[argmax(weight @ rms_norm(hidden[r]))]

Why a kernel: a greedy chain step is bound by its number of launches (2-4 µs each on an H200),
and the torch form of this head is four (norm, matmul, the argmax's two). Here each program
normalises the rows itself (they are short: H values), multiplies them by a BLOCK_V-row slice
of the lm_head and keeps only that slice's maximum and its first column; the second launch is
the argmax's merge (kernels/argmax.py), which also maps draft-vocabulary rows to target ids and
stores into the caller's buffer (a chain's column). The logits never reach memory.

Numerics of the torch form: the norm as kernels/rms_norm.py (float32 statistics, rounded to the
hidden dtype before and after the weight), the products summed in float32 and each logit rounded
to the lm_head's dtype, as a matmul's output is, before the maximum; ties go to the lowest
index. Only the summation order differs from a cuBLAS matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith_kernels.dispatch import INTERPRETED, use_kernel
from draftsmith_kernels.argmax import argmax_rows_reference
from draftsmith_kernels.rms_norm import rms_norm_reference

try:
    import triton
    import triton.language as tl

    from draftsmith_kernels.argmax import merge_chunks_into
except ImportError:
    triton = None

BLOCK_V = 128  # lm_head rows per program: 128 programs for a 16,384-row draft vocabulary
BLOCK_H = 64  # hidden columns per tile of the dot
# Triton's CPU interpreter (kernels.INTERPRETED) gets 16-bit dots wrong (3.9): there the products
# are taken in float32, which is what a GPU's tensor cores compute for bfloat16 operands (exact
# products, float32 sums).
BLOCK_R = 16  # rows of hidden per program (tl.dot's least M; one row pays for 16 of compute, not memory)
# lm_head rows per program as the runtime calls it: BLOCK_V on a GPU; 8,192 in Triton's CPU
# interpreter, whose cost is per program (the tests' device loops drafted each chain token through
# 384 programs of a 49,152-row head: 3.7 s a call; 48 programs of 1,024 rows: 0.59 s, 6 of 8,192:
# 0.18 s, still more than one slice to merge), unless a caller asks for slices of its own (the
# kernel's tests take the GPU's)
ARGMAX_BLOCK_V = 8192 if INTERPRETED else BLOCK_V


def norm_lm_head_argmax_reference(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                  out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    normed, _ = rms_norm_reference(hidden, norm_weight, eps)
    return argmax_rows_reference(F.linear(normed, weight), out, ids)


if triton is not None:

    @triton.jit
    def _norm_gemv_chunks_kernel(x_ptr, nw_ptr, w_ptr, best_ptr, index_ptr, R, V, H, eps, stride_x, stride_w, NSPLIT,
                                 IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                                 BLOCK_H: tl.constexpr):
        """One (slice of BLOCK_V lm_head rows, block of BLOCK_R hidden rows): for each hidden row,
        the slice's largest logit and the first column holding it."""
        split = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = split * BLOCK_V + tl.arange(0, BLOCK_V)
        row_in, col_in = rows < R, cols < V
        hs = tl.arange(0, BLOCK_H)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        square_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):  # the rows' statistics first (H values each: cheap to read twice)
            x = tl.load(x_rows + h0 + hs[None, :], mask=row_in[:, None] & (h0 + hs < H)[None, :], other=0.0)
            square_sum += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
        rstd = 1.0 / tl.sqrt(square_sum / H + eps)
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        for h0 in range(0, H, BLOCK_H):
            h_in = h0 + hs < H
            x = tl.load(x_rows + h0 + hs[None, :], mask=row_in[:, None] & h_in[None, :], other=0.0)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            nw = tl.load(nw_ptr + h0 + hs, mask=h_in, other=0.0).to(tl.float32)
            xn = (normed * nw[None, :]).to(w_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_H], as the norm stores it
            w = tl.load(w_rows + h0 + hs[None, :], mask=col_in[:, None] & h_in[None, :], other=0.0)
            if IEEE:  # float32 products, exact (no TF32): float32 weights, or the interpreter (below)
                acc = tl.dot(xn.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xn, tl.trans(w), acc)
        logits = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # each logit rounded as a matmul's output
        logits = tl.where(logits != logits, float("inf"), logits)  # NaN wins, as in torch.argmax
        logits = tl.where(col_in[None, :], logits, float("-inf"))
        m = tl.max(logits, 1)  # [BLOCK_R]
        first = tl.min(tl.where((logits == m[:, None]) & col_in[None, :], cols[None, :], V - 1), 1)
        slot = rows.to(tl.int64) * NSPLIT + split
        tl.store(best_ptr + slot, m, mask=row_in)
        tl.store(index_ptr + slot, first.to(tl.int64), mask=row_in)


def norm_lm_head_argmax_triton(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                               out: torch.Tensor, ids: torch.Tensor | None = None,
                               block_v: int = ARGMAX_BLOCK_V) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not installed")
    R, H = hidden.shape if hidden.dim() == 2 else (None, None)
    if R is None or weight.dim() != 2 or weight.shape[1] != H or norm_weight.shape != (H,):
        raise ValueError(f"norm_lm_head_argmax: hidden {tuple(hidden.shape)}, norm weight {tuple(norm_weight.shape)}, "
                         f"lm_head {tuple(weight.shape)}: need [R,H], [H] and [V,H]")
    if out.shape != (R,) or out.dtype != torch.long:
        raise ValueError(f"norm_lm_head_argmax: out {tuple(out.shape)} {out.dtype}, need [{R}] int64")
    V = weight.shape[0]
    if ids is not None and ids.shape != (V,):
        raise ValueError(f"norm_lm_head_argmax: ids {tuple(ids.shape)} for an lm_head of {V} rows")
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    nsplit = triton.cdiv(V, block_v)
    best = torch.empty(R, nsplit, dtype=torch.float32, device=hidden.device)
    index = torch.empty(R, nsplit, dtype=torch.long, device=hidden.device)
    if R:
        _norm_gemv_chunks_kernel[(nsplit, triton.cdiv(R, BLOCK_R))](
            hidden, norm_weight, weight, best, index, R, V, H, eps, hidden.stride(0), weight.stride(0), nsplit,
            IEEE=weight.dtype == torch.float32 or INTERPRETED, BLOCK_R=BLOCK_R, BLOCK_V=block_v, BLOCK_H=BLOCK_H)
    return merge_chunks_into(best, index, out, ids)


def norm_lm_head_argmax(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere."""
    fn = norm_lm_head_argmax_triton if use_kernel(hidden) else norm_lm_head_argmax_reference
    return fn(hidden, norm_weight, eps, weight, out, ids)
