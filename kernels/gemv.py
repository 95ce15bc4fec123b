"""Matrix-vector products of one row (or a few) for the drafter's steps, spread over the whole GPU.

    gemv(x [M,K], weight [N,K], residual [M,N] | None, out=None) -> [M,N]     x @ weight.T (+ residual)
    swiglu_gemv(gate_up [M,2I], weight [N,I], residual [M,N], out=None) -> [M,N]   silu(gate) * up first
        (M = 1, or up to MAX_ROWS rows: a tree level's 8 frontier nodes, a verified path's k + 1 entries)

Why: a chain step of the EAGLE-3 drafter (batch 1) multiplies one row by each projection. cuBLAS
tiles such a product over N alone, 64 columns a block, and walks K inside each block: the
drafter's q/k/v projection (N = 960, K = 1,152) runs on 15 blocks and its down projection
(N = 576, K = 1,536) on 9, 5.2 and 4.7 µs on an H200 for 2.2 and 1.8 MB of weights (session 13's
trace: a third of a chain step). Here each program takes BLOCK_N rows of the weight (sized so that
100-250 programs share the work) and walks K; `swiglu_gemv` forms silu(gate) * up as it reads
the down projection's input (no launch of its own), and the residual sum is rounded once, as
`addmm` with beta = 1 rounds it.

The few-row form of `swiglu_gemv` (M > 1) takes the down projection of a draft tree's level and
of the proposer's advance, where cuBLAS's product needed the separate `silu_mul` launch before it:
each program then holds an [M, BLOCK_N] block of outputs and reads its weight rows once for all M.

Numerics: products summed in float32 (in another order than cuBLAS: last-bit differences in
16-bit outputs); silu(gate) and the product rounded to the input dtype as `silu_mul` does.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import use_kernel
from kernels.silu_mul import silu_mul_reference

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, weight)
    return y if residual is None else residual + y


def swiglu_gemv_reference(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return gemv_reference(silu_mul_reference(gate_up), weight, residual)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, res_ptr, out_ptr, M, N, K, stride_w, stride_x, stride_r, stride_o,
                     HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """One block of BLOCK_N output columns for the M <= BLOCK_M rows of x (BLOCK_M = 1: one row,
        the chain step's form; rows are strided by stride_x / stride_r / stride_o)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns of this program
        row_ok = rows < N
        if BLOCK_M == 1:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)  # [BK]
                col_ok = cols < K
                if SWIGLU:  # x = silu(gate) * up, gate in x_ptr[0:K], up in x_ptr[K:2K]
                    g = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                    u = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
                    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
                    x = (s * u).to(x_ptr.dtype.element_ty).to(tl.float32)
                else:
                    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BN,BK]
                acc += tl.sum(w * x[None, :], axis=1)
            if HAS_RES:  # read before the store: out may be the residual itself (h += ...)
                acc += tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)
        else:
            ms = tl.arange(0, BLOCK_M)
            m_ok = ms < M
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < K
                x_at = x_ptr + ms[:, None] * stride_x + cols[None, :]
                x_ok = m_ok[:, None] & col_ok[None, :]
                if SWIGLU:
                    g = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
                    u = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
                    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
                    x = (s * u).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BM,BK]
                else:
                    x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BN,BK]
                acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BM,BN]
            both = m_ok[:, None] & row_ok[None, :]
            if HAS_RES:
                acc += tl.load(res_ptr + ms[:, None] * stride_r + rows[None, :], mask=both, other=0.0).to(tl.float32)
            tl.store(out_ptr + ms[:, None] * stride_o + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=both)


def _rows(t: torch.Tensor, M: int, N: int, what: str) -> torch.Tensor:
    """t (M rows of N) as [M,N] with a unit column stride, without a copy (out may be the residual)."""
    try:
        t2 = t.view(M, N)
    except RuntimeError:
        t2 = None
    if t2 is None or t.shape[-1] != N or t2.stride(-1) != 1:
        raise ValueError(f"{what} must be {M} row(s) of {N} with a contiguous last dimension, got shape "
                         f"{tuple(t.shape)}")
    return t2


def _launch(x, weight, residual, out, swiglu: bool):
    if triton is None:
        raise RuntimeError("triton is not installed")
    N, K = weight.shape
    width = 2 * K if swiglu else K
    M = x.numel() // width if x.shape[-1] == width else 0
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows of {width} values, got shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("gemv needs a weight with a contiguous last dimension")
    lead = x.shape[:-1]
    x2 = x.reshape(M, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = _rows(residual, M, N, "residual") if residual is not None else None
    if out is None:
        out = torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    elif out.device != x.device:
        raise ValueError(f"out must be on {x.device}, not {out.device}")
    out2 = _rows(out, M, N, "out")
    # output columns per program: the largest power of 2 not above N / 128, 1 to 16, so about 128-256
    # programs share a large N (N = 576 or 960: 4 columns, 144 or 240 programs; 3,072: 16, 192); K
    # read 256 at a time, fewer for several rows (an [M, BLOCK_N, BLOCK_K] product in registers)
    BLOCK_N = max(1, min(16, triton.next_power_of_2(N // 128 + 1) // 2))
    BLOCK_M = triton.next_power_of_2(M)
    BLOCK_K = 256 if M == 1 else max(32, 4096 // (BLOCK_M * BLOCK_N))
    res2 = out2 if res2 is None else res2
    _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](x2, weight, res2, out2, M, N, K, weight.stride(0), x2.stride(0),
                                             res2.stride(0), out2.stride(0), HAS_RES=residual is not None,
                                             SWIGLU=swiglu, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def gemv_triton(x, weight, residual=None, out=None):
    return _launch(x, weight, residual, out, swiglu=False)


def swiglu_gemv_triton(gate_up, weight, residual=None, out=None):
    return _launch(gate_up, weight, residual, out, swiglu=True)


# DRAFTSMITH_GEMV=0 leaves one-row products to cuBLAS (a side-by-side measurement of these kernels)
ENABLED = os.environ.get("DRAFTSMITH_GEMV", "1") != "0"
# the most rows the kernels take (a tree level's frontier of 8, a verified path's k + 1). The
# runtime sends several rows only to `swiglu_gemv` (the down projection, whose silu_mul launch it
# saves), and to `gemv` too where FEW_ROW_PROJECTIONS says so (q/k/v, o and gate_up: cuBLAS's
# or these, whichever times faster). DRAFTSMITH_GEMV_ROWS=1: several rows all to cuBLAS.
MAX_ROWS = int(os.environ.get("DRAFTSMITH_GEMV_ROWS", "16"))
FEW_ROW_PROJECTIONS = os.environ.get("DRAFTSMITH_GEMV_FEW", "0") == "1"


def one_row_mode() -> tuple:
    """Whether the one-row kernels are on, and for how many rows (part of a captured graph's identity)."""
    return ENABLED, MAX_ROWS, FEW_ROW_PROJECTIONS


def one_row(x: torch.Tensor) -> bool:
    """Whether x [..., K] is a single row on a device where the kernels run."""
    return ENABLED and x.numel() == x.shape[-1] and use_kernel(x)


def few_rows(x: torch.Tensor) -> bool:
    """Whether x [..., K] is 1 to MAX_ROWS rows on a device where the kernels run (`swiglu_gemv`)."""
    return ENABLED and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and use_kernel(x)


def few_row_projections(x: torch.Tensor) -> bool:
    """Whether `gemv` takes x's projections: one row, or a few where FEW_ROW_PROJECTIONS."""
    return one_row(x) or (FEW_ROW_PROJECTIONS and few_rows(x))


def gemv(x, weight, residual=None, out=None):
    """x @ weight.T (+ residual) for one row (a few where FEW_ROW_PROJECTIONS): the kernel on CUDA
    (unless DRAFTSMITH_KERNELS=0), the reference elsewhere. `out` may be `residual` (an in-place
    residual sum)."""
    if few_row_projections(x):
        return gemv_triton(x, weight, residual, out)
    y = gemv_reference(x, weight, residual)
    return y if out is None else out.copy_(y)


def swiglu_gemv(gate_up, weight, residual=None, out=None):
    """(silu(gate) * up) @ weight.T (+ residual) for 1 to MAX_ROWS rows, as `gemv`."""
    if few_rows(gate_up):
        return swiglu_gemv_triton(gate_up, weight, residual, out)
    y = swiglu_gemv_reference(gate_up, weight, residual)
    return y if out is None else out.copy_(y)
